"""The worker process: receive, run handlers, heartbeat, shut down gracefully.

The worker runs an asyncio event loop. Each consumed queue has a long-polling receiver
(:mod:`sqla_outbox.worker.receive`) that takes handler slots before it receives; each
message is handled by its own task (:mod:`sqla_outbox.worker.handle`); a heartbeat task
extends visibility and leases (:mod:`sqla_outbox.worker.heartbeat`). Blocking calls
(boto3, the worker's own SQL) run on a thread pool; sync handlers run on a thread of
their own; async handlers run on the loop.

Shutdown (:meth:`Worker.stop`, SIGTERM/SIGINT in the CLI): readiness turns false, the
receivers stop (a long poll that returns afterwards gives its messages straight back),
in-flight handlers get up to ``worker_stop_budget_seconds`` to finish, and whatever is
still running is cancelled: its run goes back to ``queued`` and its message becomes
visible at once (ChangeMessageVisibility 0). Then the process exits 0.
"""

from __future__ import annotations

import asyncio
import dataclasses
import importlib
import json
import logging
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from sqlalchemy.engine import Connection, Engine
from sqlalchemy.orm import Session, sessionmaker

from sqla_outbox import backoff, envelope, errors, metrics, presence
from sqla_outbox.catalog import Catalog
from sqla_outbox.config import OutboxSettings
from sqla_outbox.logging import error_fields, log_extra, safe_traceback
from sqla_outbox.sqs.client import (
    SQS_MAX_VISIBILITY_SECONDS,
    QueueDirectory,
    error_code,
    is_missing_queue,
    make_client,
)
from sqla_outbox.worker import deferral
from sqla_outbox.worker import handle as handling
from sqla_outbox.worker.acks import AckBatcher
from sqla_outbox.worker.engine import make_worker_engine
from sqla_outbox.worker.flight import InFlight
from sqla_outbox.worker.heartbeat import heartbeat_loop
from sqla_outbox.worker.outcome import Outcomes
from sqla_outbox.worker.receive import RECEIVE_MAX_MESSAGES, SlotPool
from sqla_outbox.worker.registry import Registry
from sqla_outbox.worker.registry import registry as default_registry
from sqla_outbox.worker.runtime import Runtime, WorkerCounters

logger = logging.getLogger("sqla_outbox.worker")
T = TypeVar("T")


def import_task_modules(modules: tuple[str, ...] | list[str]) -> None:
    """Import the modules whose ``@task`` decorators register the handlers.

    The current directory is put on ``sys.path`` first (as ``python -m`` and Celery do), so
    ``python -m sqla_outbox.worker --imports myapp.tasks`` finds a project that is not installed.

    Raises:
        ConfigurationError: A module cannot be imported (names it).
    """
    if modules and "" not in sys.path and os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    for name in modules:
        try:
            importlib.import_module(name)
        except ImportError as exc:
            raise errors.ConfigurationError(
                f"cannot import task module {name!r}: {exc}",
                option="--imports / SQLA_OUTBOX_WORKER_IMPORTS",
            ) from exc


def visibility_ends_by(
    first_receive_ms: Any, *, now: float | None = None, wall: float | None = None
) -> float:
    """``time.monotonic()`` at which SQS stops allowing the message to be hidden: 43,200 s
    after its first receive (SQS ``ApproximateFirstReceiveTimestamp``, epoch milliseconds,
    untrusted: anything that is not a plausible past time counts as "just now")."""
    now = time.monotonic() if now is None else now
    wall = time.time() if wall is None else wall
    try:
        first = int(str(first_receive_ms)) / 1000
    except ValueError:
        first = wall
    first = min(max(first, wall - SQS_MAX_VISIBILITY_SECONDS), wall)
    return now + (first + SQS_MAX_VISIBILITY_SECONDS - wall)


def consumed_queues(settings: OutboxSettings, catalog: Catalog) -> list[str]:
    """The queues a worker consumes: ``worker_queues``, the four defaults first (critical
    first), then declared queues in catalog order.

    Raises:
        ConfigurationError: ``worker_queues`` names a queue that is neither a default nor
            declared in the catalog (``queues``).
    """
    known = catalog.queue_names()
    unknown = [q for q in settings.worker_queues if q not in known]
    if unknown:
        raise errors.ConfigurationError(
            f"unknown queue(s) {', '.join(map(repr, unknown))}: expected some of {', '.join(known)} "
            "(declare more under 'queues' in the task catalog, or with sqla_outbox.worker.queue())",
            option="--queues / SQLA_OUTBOX_WORKER_QUEUES",
        )
    return [q for q in known if q in settings.worker_queues]


def queue_weights(catalog: Catalog) -> dict[str, int]:
    """Slot weights: critical 8, default 4, bulk 2, maintenance 1, and each declared queue's."""
    return catalog.queue_registry.weights()


class Worker:
    """Consumes SQS queues and runs registered handlers.

    Args:
        settings: Worker settings (queues, concurrency, wait, backoff, stop budget, ...).
        registry: Where handlers are registered (default: the ``@task`` registry).
        catalog: Catalog for dispatches made by handlers; default the file at
            ``catalog_path`` when it exists, else the registry's own catalog.
        engine: Sync SQLAlchemy engine (default from ``database_url``).
        client: boto3 SQS client (default from the standard chain).
        name: Worker id in the trail and logs (default ``worker_id`` or ``host:pid``).
    """

    def __init__(
        self,
        settings: OutboxSettings,
        *,
        registry: Registry | None = None,
        catalog: Catalog | None = None,
        engine: Engine | None = None,
        client: Any = None,
        name: str | None = None,
    ) -> None:
        self.settings = settings
        registry = registry or default_registry
        concurrency = settings.worker_concurrency
        self._owns_engine = engine is None
        engine = engine or make_worker_engine(settings)
        if catalog is None:
            path = Path(settings.catalog_path)
            catalog = Catalog.load(path) if path.exists() else registry.catalog()
        self.queues = consumed_queues(settings, catalog)
        self.runtime = Runtime(
            settings,
            worker_id=name or settings.worker_id or f"{socket.gethostname()}:{os.getpid()}",
            registry=registry,
            catalog=catalog,
            engine=engine,
            client=client
            or make_client(
                settings,
                max_pool_connections=concurrency + len(settings.worker_queues) * 2 + 8,
                read_timeout_seconds=settings.worker_wait_seconds + 15,
            ),
            io_threads=concurrency + len(self.queues) + 6,
        )
        self.slots = SlotPool(concurrency, queue_weights(catalog))
        self.in_flight: dict[int, InFlight] = {}
        self._polls_end: dict[str, float] = {}  # queue → monotonic end of its pending long poll
        self.ready = False
        self.stopping = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop_event: asyncio.Event | None = None
        self._beat_at = time.monotonic()
        self.relay: Any = None

    # --- the runtime's parts, by their old names -----------------------------------------
    @property
    def registry(self) -> Registry:
        return self.runtime.registry

    @property
    def worker_id(self) -> str:
        return self.runtime.worker_id

    @property
    def engine(self) -> Engine:
        return self.runtime.engine

    @property
    def catalog(self) -> Catalog:
        return self.runtime.catalog

    @property
    def client(self) -> Any:
        return self.runtime.client

    @property
    def directory(self) -> QueueDirectory:
        return self.runtime.directory

    @property
    def outcomes(self) -> Outcomes:
        return self.runtime.outcomes

    @property
    def acks(self) -> AckBatcher:
        return self.runtime.acks

    @property
    def counters(self) -> WorkerCounters:
        return self.runtime.counters

    @property
    def visibility(self) -> dict[str, int]:
        return self.runtime.visibility

    @property
    def session_factory(self) -> sessionmaker[Session]:
        return self.runtime.session_factory

    @property
    def async_session_factory(self) -> Any:
        """``async_sessionmaker`` for async handlers (created on first use)."""
        return self.runtime.async_session_factory

    async def io(self, fn: Callable[..., T], *args: Any) -> T:
        """Run a blocking call on the worker's I/O threads."""
        return await self.runtime.io(fn, *args)

    def in_transaction(self, work: Callable[[Connection], T]) -> T:
        """Run ``work`` in its own committed transaction (blocking)."""
        return self.runtime.in_transaction(work)

    # --- control -------------------------------------------------------------------------
    def stop(self) -> None:
        """Begin a graceful shutdown (thread-safe; also what SIGTERM/SIGINT do)."""
        if self._loop is not None and self._stop_event is not None:
            self._loop.call_soon_threadsafe(self._stop_event.set)

    def is_alive(self) -> bool:
        return time.monotonic() - self._beat_at < 30

    def run(self, *, handle_signals: bool = True, stop_requested: threading.Event | None = None) -> None:
        """Run until stopped. Returns after a graceful shutdown.

        Args:
            handle_signals: Take SIGTERM/SIGINT as a graceful stop (the main thread only).
            stop_requested: Set when a stop was asked for before the worker's event loop
                took the signals over (the CLI's start-up: settings, task imports); the
                worker then stops as soon as it starts, receiving nothing.

        Raises:
            ConfigurationError: A consumed queue does not exist, or bad settings.
        """
        asyncio.run(self._main(handle_signals, stop_requested))

    async def _main(self, handle_signals: bool, stop_requested: threading.Event | None) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop_event = asyncio.Event()
        if handle_signals:
            for signum in (signal.SIGTERM, signal.SIGINT):
                self._loop.add_signal_handler(signum, self._stop_event.set)
        if stop_requested is not None and stop_requested.is_set():  # checked once the loop has them
            self._stop_event.set()
        if not await self._resolve_queues_patiently():
            return
        if self.settings.worker_run_relay:
            from sqla_outbox.relay import Relay

            self.relay = Relay(self.settings, name=f"{self.worker_id}/relay")
            self.relay.start_in_thread()
        limited = {name: d.limits for name, d in self.registry.tasks.items() if d.limits.any}
        if limited:  # flow control: what status and the dashboard show
            await self.io(self.runtime.gate.publish, limited)
        receivers = [asyncio.create_task(self._receiver(q), name=f"receive-{q}") for q in self.queues]
        heartbeat = asyncio.create_task(
            heartbeat_loop(self.runtime, lambda: list(self.in_flight.values())), name="heartbeat"
        )
        ticker = asyncio.create_task(self._tick(), name="liveness")
        present = asyncio.create_task(self._presence_loop(), name="presence")
        self.ready = True
        logger.info(
            "worker started",
            extra=log_extra(
                action="worker.started",
                worker_id=self.worker_id,
                queues=",".join(self.queues),
                concurrency=self.settings.worker_concurrency,
                tasks=len(self.registry.tasks),
            ),
        )
        await self._stop_event.wait()
        await self._shutdown(receivers, heartbeat, ticker, present)

    async def _resolve_queues_patiently(self) -> bool:
        """Look up queue URLs and visibility timeouts; wait out an unreachable endpoint.

        Returns False when stopped while waiting.

        Raises:
            ConfigurationError: A queue or its DLQ does not exist (run provisioning).
        """
        assert self._stop_event is not None
        delay, warned = backoff.Doubling(0.5, 10.0), False
        while True:
            try:
                await self.io(self._resolve_queues)
                return True
            except errors.ConfigurationError:
                raise
            except Exception as exc:
                if not warned:
                    warned = True
                    logger.warning(
                        "SQS not reachable at start; retrying",
                        extra=log_extra(action="worker.sqs_unreachable", error_code=error_code(exc)),
                    )
            try:
                await asyncio.wait_for(self._stop_event.wait(), delay.current)
                return False
            except TimeoutError:
                delay.grow()

    def _resolve_queues(self) -> None:
        for queue in self.queues:
            try:
                url = self.directory.url(queue)
                self.directory.dlq_url(queue)
            except Exception as exc:
                if not is_missing_queue(exc):
                    raise
                raise errors.ConfigurationError(
                    f"queue {self.settings.queue_url_name(queue)!r} or its DLQ does not exist "
                    f"({error_code(exc)}); run `python -m sqla_outbox provision`",
                    option="SQLA_OUTBOX_WORKER_QUEUES",
                ) from exc
            attributes = self.client.get_queue_attributes(
                QueueUrl=url, AttributeNames=["VisibilityTimeout", "RedrivePolicy", "MaximumMessageSize"]
            )["Attributes"]
            self.runtime.visibility[queue] = int(attributes["VisibilityTimeout"])
            self._check_redrive(queue, attributes.get("RedrivePolicy"))
            self._check_message_size(queue, attributes.get("MaximumMessageSize"))

    def _check_message_size(self, queue: str, maximum: str | None) -> None:
        """Refuse a queue that accepts larger messages than this worker reads.

        The worker refuses a message above ``max_message_bytes`` unexecuted, as untrusted
        input (``malformed-envelope:too-large``), and a genuine run's message refused that
        way leaves the run ``queued``. A queue provisioned for more (its
        ``MaximumMessageSize`` attribute) means some process dispatches or sends with a
        larger setting than this worker's: say so before receiving anything.

        Raises:
            ConfigurationError: Naming the queue and both sizes (bytes).
        """
        try:
            accepted = int(maximum) if maximum else 0
        except ValueError:
            return
        if accepted > self.settings.max_message_bytes:
            raise errors.ConfigurationError(
                f"queue {self.settings.queue_url_name(queue)!r} accepts messages up to {accepted} "
                f"bytes (MaximumMessageSize), but this worker refuses messages above "
                f"{self.settings.max_message_bytes}: the application, the relay and every worker "
                "must share one max_message_bytes; set it to the queue's size here too, or "
                "provision the queues with the smaller size (`python -m sqla_outbox provision --fix`)",
                option="SQLA_OUTBOX_MAX_MESSAGE_BYTES",
            )

    def _check_redrive(self, queue: str, redrive_policy: str | None) -> None:
        """Refuse a queue whose redrive ``maxReceiveCount`` would act before the worker.

        The worker decides a run's fate on its ``max_receives``-th receive; SQS moves a
        message to the DLQ once its receive count *exceeds* ``maxReceiveCount`` (SQS
        redrive policy), so each task's limit must stay below the queue's actual value,
        whatever ``max_receive_count`` the settings say.

        Raises:
            ConfigurationError: Naming the queue, the task and both numbers.
        """
        if not redrive_policy:
            return
        try:
            limit = int(json.loads(redrive_policy)["maxReceiveCount"])
        except (ValueError, KeyError, TypeError):
            return
        for definition in self.registry.tasks.values():
            if definition.queue != queue:
                continue
            receives = definition.retry_rules(self.settings).max_receives
            if receives >= limit:
                raise errors.ConfigurationError(
                    f"queue {self.settings.queue_url_name(queue)!r} has redrive maxReceiveCount "
                    f"{limit}, but task {definition.name!r} decides on receive {receives}: SQS would "
                    "dead-letter its messages before the worker records a verdict; raise the "
                    "queue's maxReceiveCount (`python -m sqla_outbox provision --max-receive-count N --fix`) "
                    "or lower max_receives",
                    option="SQLA_OUTBOX_WORKER_MAX_RECEIVES",
                )

    # --- presence (rolling deploys: sqla_outbox.presence) ----------------------------------
    def _record_presence(self, first: bool) -> None:
        tasks, queues = list(self.registry.tasks), list(self.queues)
        with self.engine.begin() as connection:
            if first:
                presence.register(connection, worker_id=self.worker_id, tasks=tasks, queues=queues)
            else:
                presence.beat(connection, worker_id=self.worker_id, tasks=tasks, queues=queues)

    async def _presence_loop(self) -> None:
        """Record the tasks this worker implements, then renew the heartbeat; a failure is
        logged and retried at the next beat (the row simply ages meanwhile)."""
        first = True
        while not self.stopping:
            try:
                await self.io(self._record_presence, first)
                first = False
            except Exception as exc:
                logger.warning(
                    "could not record worker presence; retrying",
                    extra=log_extra(action="worker.presence_failed", error_type=type(exc).__name__),
                )
            await asyncio.sleep(presence.PRESENCE_INTERVAL_SECONDS)

    def _forget_presence(self) -> None:
        with self.engine.begin() as connection:
            presence.unregister(connection, worker_id=self.worker_id)

    async def _tick(self) -> None:
        while True:
            self._beat_at = time.monotonic()
            metrics.IN_FLIGHT.set(len(self.in_flight))
            await asyncio.sleep(1)

    # --- receiving -----------------------------------------------------------------------
    async def _receiver(self, queue: str) -> None:
        assert self._stop_event is not None
        want = 1
        delay = backoff.Doubling(0.5, 10.0)
        while not self.stopping:
            acquire = asyncio.ensure_future(self.slots.acquire(queue, want))
            stop = asyncio.ensure_future(self._stop_event.wait())
            done, _ = await asyncio.wait({acquire, stop}, return_when=asyncio.FIRST_COMPLETED)
            stop.cancel()
            if acquire not in done:
                acquire.cancel()
                return
            granted = acquire.result()
            if self.stopping:
                self.slots.release(granted)
                return
            try:
                messages = await self.io(self._receive, queue, granted)
                delay.reset()
            except Exception as exc:
                self.slots.release(granted)
                logger.warning(
                    "receive failed",
                    extra=log_extra(action="worker.receive_failed", queue=queue, error_code=error_code(exc)),
                )
                await asyncio.sleep(delay.current)
                delay.grow()
                continue
            self.slots.release(granted - len(messages))
            want = RECEIVE_MAX_MESSAGES if messages else 1
            for message in messages:
                self._start(queue, message)

    def _receive(self, queue: str, count: int) -> list[dict[str, Any]]:
        self._polls_end[queue] = time.monotonic() + self.settings.worker_wait_seconds
        try:
            response = self.client.receive_message(
                QueueUrl=self.directory.url(queue),
                MaxNumberOfMessages=min(count, RECEIVE_MAX_MESSAGES),
                WaitTimeSeconds=self.settings.worker_wait_seconds,
                AttributeNames=[
                    "ApproximateReceiveCount",
                    "SentTimestamp",
                    "ApproximateFirstReceiveTimestamp",
                ],
                MessageAttributeNames=["All"],
            )
        finally:
            self._polls_end.pop(queue, None)
        messages: list[dict[str, Any]] = response.get("Messages", [])
        return messages

    def own_poll_seconds_left(self, queue: str) -> float:
        """Seconds until this worker's pending long poll on ``queue`` ends (0 if none).

        A message returned while stopping is hidden that long (plus a second), so the
        worker's own last poll cannot take it back, which would cost it a receive (SQS
        counts every receive toward the redrive limit) for nothing.
        """
        end = self._polls_end.get(queue)
        return max(end - time.monotonic(), 0.0) if end is not None else 0.0

    def _start(self, queue: str, message: dict[str, Any]) -> None:
        self.counters.received += 1
        attributes = message.get("Attributes", {})
        try:
            receive_count = int(attributes.get("ApproximateReceiveCount", "1"))
        except ValueError:
            receive_count = 1
        flight = InFlight(
            queue=queue,
            message_id=str(message.get("MessageId", "")),
            receipt_handle=str(message.get("ReceiptHandle", "")),
            receive_count=receive_count,
            body=str(message.get("Body", "")),
            attributes=dict(message.get("MessageAttributes", {})),
            visibility_ends_by=visibility_ends_by(attributes.get("ApproximateFirstReceiveTimestamp")),
        )
        key = id(flight)
        self.in_flight[key] = flight
        if self.stopping:
            flight.task = asyncio.create_task(self._give_back(key, flight))
        else:
            flight.task = asyncio.create_task(self._handle(key, flight))

    async def _handle(self, key: int, flight: InFlight) -> None:
        try:
            await handling.handle_message(self.runtime, flight)
        except asyncio.CancelledError:
            await self._give_back_safely(flight, "worker shutdown")
            raise
        except Exception as exc:
            # never exc_info: a database error's text carries statement parameters (the
            # envelope) or the failing row; error_fields and safe_traceback leave them out
            logger.error(
                "message handling failed; it will be delivered again",
                extra=log_extra(
                    action="worker.handle_error",
                    queue=flight.queue,
                    message_id=flight.message_id,
                    **error_fields(exc),
                    traceback=safe_traceback(exc),
                ),
            )
        finally:
            self.in_flight.pop(key, None)
            self.slots.release(1)

    async def _give_back(self, key: int, flight: InFlight) -> None:
        try:
            if not await self._defer_unread(flight):
                await self._give_back_safely(flight, "received during shutdown")
        finally:
            self.in_flight.pop(key, None)
            self.slots.release(1)

    async def _defer_unread(self, flight: InFlight) -> bool:
        """A message received while stopping, never started: hand its run back through the
        outbox (:mod:`sqla_outbox.worker.deferral`) rather than to the queue, so the receive
        it just cost does not count against the run (the outbox sends a fresh message).

        Returns:
            True when the run was deferred (or already pending) and the message deleted;
            False for anything else (a message that is not one of our runs, a run that is
            finished or leased elsewhere, a database error): it is returned to the queue.
        """
        keys = self.settings.signing_keys
        signature = flight.attributes.get(envelope.SIGNATURE_ATTRIBUTE, {}).get("StringValue")
        if keys and not envelope.signature_valid(flight.body, signature, keys):
            return False
        try:
            env = envelope.decode(flight.body, max_bytes=self.settings.max_message_bytes)
        except envelope.MalformedEnvelope:
            return False
        if env.queue != flight.queue:
            return False
        try:
            result = await asyncio.shield(
                deferral.defer_message(self.runtime, flight, env, reason="worker-stopping", delay_seconds=0)
            )
        except Exception:
            logger.warning(
                "could not defer a message received while stopping; returning it to the queue",
                extra=log_extra(action="worker.defer_failed", queue=flight.queue),
            )
            return False
        return result.status is not deferral.DeferStatus.NOT_DEFERRABLE

    async def _give_back_safely(self, flight: InFlight, reason: str) -> None:
        # while stopping, out of reach of this worker's own pending long poll on the queue
        hide = self.own_poll_seconds_left(flight.queue) if self.stopping else 0.0
        try:
            await asyncio.shield(handling.give_back(self.runtime, flight, reason=reason, hide_seconds=hide))
        except Exception as exc:
            logger.error(
                "could not return a message",
                extra=log_extra(
                    action="worker.return_failed", **error_fields(exc), traceback=safe_traceback(exc)
                ),
            )

    # --- shutdown ------------------------------------------------------------------------
    async def _drain_in_flight(self) -> None:
        pending = [f.task for f in list(self.in_flight.values()) if f.task is not None]
        if pending:
            await asyncio.gather(*pending, return_exceptions=True)

    async def _shutdown(self, receivers: list[asyncio.Task[None]], *others: asyncio.Task[None]) -> None:
        self.stopping = True
        self.ready = False
        try:  # at once: the relay stops sending this worker's tasks if nobody else has them
            await self.io(self._forget_presence)
        except Exception as exc:
            logger.warning(
                "could not remove worker presence",
                extra=log_extra(action="worker.presence_failed", error_type=type(exc).__name__),
            )
        logger.info(
            "worker stopping",
            extra=log_extra(
                action="worker.stopping",
                in_flight=len(self.in_flight),
                budget_s=self.settings.worker_stop_budget_seconds,
            ),
        )
        deadline = time.monotonic() + self.settings.worker_stop_budget_seconds
        while self.in_flight and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        for flight in list(self.in_flight.values()):
            if flight.ctx is not None:
                flight.ctx.cancel_event.set()
            if flight.task is not None and not flight.task.done():
                flight.task.cancel()
        await self._drain_in_flight()
        # receivers blocked in a long poll return within worker_wait_seconds; what they
        # bring is given straight back
        await asyncio.wait(receivers, timeout=self.settings.worker_wait_seconds + 5)
        for task in receivers:
            task.cancel()
        await asyncio.gather(*receivers, return_exceptions=True)
        await self._drain_in_flight()
        await self.acks.close()
        for task in others:
            task.cancel()
        await asyncio.gather(*others, return_exceptions=True)
        if self.relay is not None:
            self.relay.stop()
            await self.io(self.relay.join, 30)
        logger.info(
            "worker stopped", extra=log_extra(action="worker.stopped", **dataclasses.asdict(self.counters))
        )
        await self.runtime.close()
        if self._owns_engine:
            self.engine.dispose()
