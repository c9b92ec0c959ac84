"""What the worker's parts share: settings, handlers, the database, SQS and the I/O threads.

The worker (:mod:`sqla_outbox.worker.consumer`) is a loop: it receives messages and
hands each one to :func:`sqla_outbox.worker.handle.handle_message`; a heartbeat
(:mod:`sqla_outbox.worker.heartbeat`) keeps them hidden. Those parts never reach back
into the loop: they get a :class:`Runtime`, which holds the resources they use and
nothing of the loop's own state (receivers, slots, shutdown).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import functools
from collections.abc import Callable
from typing import Any, TypeVar

from sqlalchemy.engine import Connection, Engine
from sqlalchemy.orm import Session, sessionmaker

from sqla_outbox import flow
from sqla_outbox.catalog import Catalog
from sqla_outbox.config import OutboxSettings
from sqla_outbox.events import install
from sqla_outbox.sqs.client import QueueDirectory
from sqla_outbox.wakeup import Waker
from sqla_outbox.worker.acks import AckBatcher
from sqla_outbox.worker.gate import Gate
from sqla_outbox.worker.leases import LeaseBatcher
from sqla_outbox.worker.outcome import Outcomes
from sqla_outbox.worker.registry import Registry
from sqla_outbox.worker.threads import HandlerThreads

T = TypeVar("T")

ACK_LINGER_SECONDS = 0.05
"""How long a delete waits for companions (up to 10 per DeleteMessageBatch). The handler
slot is free already (the verdict is committed), so waiting costs no throughput, and a
busy worker fills batches sooner; at 5 ms most batches of a worker slowed by its SQS
held 1-3 deletes, a boto3 call (about 1 ms of CPU) per 1-3 runs."""


@dataclasses.dataclass
class WorkerCounters:
    """Totals since start (the same events are Prometheus metrics)."""

    received: int = 0
    succeeded: int = 0
    retried: int = 0
    failed: int = 0
    dead_lettered: int = 0
    duplicates_skipped: int = 0
    duplicates_held: int = 0
    foreign: int = 0
    returned: int = 0
    lost_leases: int = 0
    deferred: int = 0
    cancelled: int = 0


class Runtime:
    """The resources of one worker process, shared by handling and the heartbeat.

    Args:
        settings: The worker's settings.
        worker_id: Name recorded in the trail and logs.
        registry: Handlers by task name.
        catalog: Catalog for dispatches that handlers add to ``ctx.session``.
        engine: Sync engine for the worker's own SQL and sync handlers' sessions.
        client: boto3 SQS client (thread-safe).
        io_threads: Size of the thread pool for blocking calls (boto3, the worker's SQL).
            Sync handlers run on :class:`~sqla_outbox.worker.threads.HandlerThreads`.

    Attributes:
        session_factory: Installed ``sessionmaker`` of sync handlers' sessions.
        directory: Queue URLs. outcomes: Delete/retry/dead-letter calls. acks: Batched
            deletes. leases: Batched lease taking. counters: :class:`WorkerCounters`.
        visibility: Queue → its SQS visibility timeout in seconds, read at start.
        gate: The admission gate of tasks with rate limits, concurrency caps or breakers.
    """

    def __init__(
        self,
        settings: OutboxSettings,
        *,
        worker_id: str,
        registry: Registry,
        catalog: Catalog,
        engine: Engine,
        client: Any,
        io_threads: int,
    ) -> None:
        self.settings = settings
        self.worker_id = worker_id
        self.registry = registry
        self.catalog = catalog
        self.engine = engine
        self.client = client
        self.session_factory: sessionmaker[Session] = sessionmaker(engine)
        install(self.session_factory, settings, catalog=catalog)
        self.directory = QueueDirectory(client, settings)
        self.outcomes = Outcomes(client, self.directory, max_message_bytes=settings.max_message_bytes)
        self.acks = AckBatcher(client, self.directory, self.io, linger_seconds=ACK_LINGER_SECONDS)
        self.leases = LeaseBatcher(engine, self.io)
        self.counters = WorkerCounters()
        self.gate = Gate(settings, breakers=registry.breakers, worker_id=worker_id)
        self.visibility: dict[str, int] = {}
        self.pauses = flow.PauseCache(settings.flow_refresh_seconds)
        self._io_pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=io_threads, thread_name_prefix="sqla-outbox-io"
        )
        self._waker: Waker | None = None
        self.handler_threads = HandlerThreads(max_idle=settings.worker_concurrency)
        self._async_factory: Any = None
        self._async_engine: Any = None

    @property
    def async_session_factory(self) -> Any:
        """``async_sessionmaker`` for async handlers (created, and installed, on first use)."""
        if self._async_factory is None:
            from sqlalchemy.ext.asyncio import async_sessionmaker

            from sqla_outbox.worker.engine import make_worker_async_engine

            self._async_engine = make_worker_async_engine(self.settings)
            self._async_factory = async_sessionmaker(self._async_engine)
            install(self._async_factory, self.settings, catalog=self.catalog)
        return self._async_factory

    async def io(self, fn: Callable[..., T], *args: Any) -> T:
        """Run a blocking call on the I/O threads and await its result."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._io_pool, functools.partial(fn, *args))

    def in_transaction(self, work: Callable[[Connection], T]) -> T:
        """Run ``work`` in its own committed transaction (blocking: call it through :meth:`io`)."""
        with self.engine.begin() as connection:
            return work(connection)

    def wake_relay(self) -> None:
        """Push the Valkey wake (when ``wake_mode`` uses it), off this thread: after a
        deferral, so the relay's timer learns the deferred row's due time. Never blocks."""
        if self.settings.wake_valkey_url is None:
            return
        if self._waker is None:
            self._waker = Waker(self.settings)
        self._waker.wake()

    async def close(self) -> None:
        """Stop the I/O threads (without waiting) and dispose of the async engine."""
        self._io_pool.shutdown(wait=False)
        self.gate.close()
        if self._waker is not None:
            self._waker.close()
        self.handler_threads.close()
        if self._async_engine is not None:
            await self._async_engine.dispose()
