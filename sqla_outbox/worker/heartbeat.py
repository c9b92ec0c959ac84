"""The heartbeat: keep running messages hidden and their runs' leases alive.

Every second the heartbeat looks at the messages in flight; each one whose visibility
was last extended a third of its queue's visibility timeout ago gets, in one batch per
queue, ChangeMessageVisibilityBatch back to the full visibility timeout (cut to what SQS
still allows: a message stays hidden at most 12 hours after its first receive,
:meth:`~sqla_outbox.worker.flight.InFlight.hideable_seconds`; past that nothing is asked),
and its run's lease renewed by as much (one UPDATE for all of them). A run whose lease
could not be renewed (another worker took it over after a long stall) has its attempt
cancelled; its result would be discarded anyway.

Every ``worker_cancel_check_seconds`` (while any run executes) the heartbeat also asks
PostgreSQL which of its running runs a committed ``Cancel`` asked to stop (one
primary-key query for all of them, :func:`~sqla_outbox.lifecycle.attempts.cancel_requests`),
and signals those attempts: ``ctx.cancel_event`` (what the handler sees, the signal
timeouts use) and the flight's ``stop_requested`` (the worker records ``cancelled``).

Each beat also renews the Valkey leases of the concurrency slots and breaker probes
this worker holds (:meth:`~sqla_outbox.worker.gate.Gate.renew`, every third of
``limits_slot_lease_seconds``).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Callable, Iterable

from sqla_outbox import metrics
from sqla_outbox.lifecycle import attempts
from sqla_outbox.logging import log_extra
from sqla_outbox.sqs.client import SQS_MAX_BATCH_ENTRIES, error_code
from sqla_outbox.worker.flight import InFlight
from sqla_outbox.worker.runtime import Runtime

logger = logging.getLogger("sqla_outbox.worker")


def due(flights: list[InFlight], visibility: dict[str, int], now: float) -> list[InFlight]:
    """Flights whose visibility should be extended now (every third of the timeout)."""
    return [f for f in flights if f.verdict is None and now - f.extended_at >= visibility[f.queue] / 3]


async def heartbeat_loop(
    runtime: Runtime, flights: Callable[[], Iterable[InFlight]], *, interval_seconds: float = 1.0
) -> None:
    """Run until cancelled.

    Args:
        runtime: The worker's resources (SQS client, queue visibility, the run store).
        flights: Returns the messages in flight now.
        interval_seconds: Time between beats.
    """
    checked_at = time.monotonic()
    while True:
        await asyncio.sleep(interval_seconds)
        try:
            if runtime.gate.held:  # concurrency slot leases (flow control)
                await runtime.io(runtime.gate.renew)
            current = list(flights())
            await beat(runtime, current)
            if time.monotonic() - checked_at >= runtime.settings.worker_cancel_check_seconds:
                checked_at = time.monotonic()
                await check_cancel_requests(runtime, current)
        except Exception as exc:
            logger.warning(
                "heartbeat failed",
                extra=log_extra(action="worker.heartbeat_error", error_type=type(exc).__name__),
            )


async def beat(runtime: Runtime, in_flight: list[InFlight]) -> None:
    """Extend what is due once."""
    now = time.monotonic()
    flights = due(in_flight, runtime.visibility, now)
    if not flights:
        return
    by_queue: dict[str, list[InFlight]] = {}
    for flight in flights:
        by_queue.setdefault(flight.queue, []).append(flight)
    for queue, group in by_queue.items():
        extendable = []
        for flight in group:
            left = flight.hideable_seconds(runtime.visibility[queue], now=now)
            if left < runtime.visibility[queue] and not flight.cap_reported:
                _report_cap(flight, left)
            if left >= 1:
                extendable.append(flight)
            else:  # SQS's 12-hour ceiling: nothing left to ask for
                flight.extended_at = now
        for start in range(0, len(extendable), SQS_MAX_BATCH_ENTRIES):
            chunk = extendable[start : start + SQS_MAX_BATCH_ENTRIES]
            failed = await runtime.io(_extend_visibility, runtime, queue, chunk)
            for flight in chunk:
                if flight.message_id not in failed:
                    flight.extended_at = now
            if failed:
                metrics.HEARTBEAT_FAILURES.labels(queue).inc(len(failed))
    leased = [f for f in flights if f.leased and f.run_id is not None and f.verdict is None]
    if not leased:
        return
    held_pairs: list[tuple[uuid.UUID, int]] = [(f.run_id, f.attempt) for f in leased if f.run_id is not None]
    lease_seconds = {f.run_id: float(runtime.visibility[f.queue]) for f in leased}
    longest = max(lease_seconds.values())
    still_held = await runtime.io(
        runtime.in_transaction, lambda conn: attempts.renew_leases(conn, held_pairs, lease_seconds=longest)
    )
    for flight in leased:
        if flight.run_id not in still_held and flight.verdict is None and flight.ctx is not None:
            metrics.HEARTBEAT_FAILURES.labels(flight.queue).inc()
            flight.ctx.cancel_event.set()
            logger.warning(
                "lease lost; cancelling the attempt",
                extra=log_extra(action="worker.lease_lost", run_id=str(flight.run_id), task=flight.task_name),
            )


def _report_cap(flight: InFlight, left_seconds: float) -> None:
    """Say once, per message, that SQS's 12-hour ceiling is near: the message becomes visible
    again about ``left_seconds`` from now whatever the heartbeat asks, and another worker may
    receive a copy while this handler runs (that copy finds the run leased and is deleted,
    and this attempt's verdict, if a retry, goes through the outbox)."""
    flight.cap_reported = True
    metrics.VISIBILITY_CAP_REACHED.labels(flight.queue).inc()
    logger.warning(
        "SQS's 12-hour visibility ceiling is near: the message will be visible again",
        extra=log_extra(
            action="worker.visibility_cap",
            run_id=str(flight.run_id) if flight.run_id else None,
            task=flight.task_name,
            queue=flight.queue,
            message_id=flight.message_id,
            visible_in_s=round(left_seconds, 1),
        ),
    )


async def check_cancel_requests(runtime: Runtime, in_flight: list[InFlight]) -> int:
    """Signal the attempts whose runs a committed ``Cancel`` asked to stop; return how many."""
    running = [f for f in in_flight if f.leased and f.verdict is None and f.run_id is not None and f.ctx]
    if not running:
        return 0
    run_ids = [f.run_id for f in running if f.run_id is not None]
    requested = await runtime.io(runtime.in_transaction, lambda conn: attempts.cancel_requests(conn, run_ids))
    signalled = 0
    for flight in running:
        if flight.run_id in requested and flight.ctx is not None:
            stop = flight.stop_requested
            if stop is not None and stop.is_set():
                continue
            flight.ctx.cancel_event.set()
            if stop is not None:
                stop.set()
            signalled += 1
            logger.info(
                "cancel requested; stopping the attempt",
                extra=log_extra(
                    action="worker.cancel_requested", run_id=str(flight.run_id), task=flight.task_name
                ),
            )
    return signalled


def _extend_visibility(runtime: Runtime, queue: str, flights: list[InFlight]) -> set[str]:
    """ChangeMessageVisibilityBatch; returns the message ids that failed."""
    try:
        response = runtime.client.change_message_visibility_batch(
            QueueUrl=runtime.directory.url(queue),
            Entries=[
                {
                    "Id": str(i),
                    "ReceiptHandle": f.receipt_handle,
                    "VisibilityTimeout": int(f.hideable_seconds(runtime.visibility[queue])),
                }
                for i, f in enumerate(flights)
            ],
        )
    except Exception as exc:
        logger.warning(
            "visibility extension failed",
            extra=log_extra(action="worker.heartbeat_failed", queue=queue, error_code=error_code(exc)),
        )
        return {f.message_id for f in flights}
    failed = {flights[int(entry["Id"])].message_id for entry in response.get("Failed", [])}
    if failed:
        logger.warning(
            "visibility extension refused",
            extra=log_extra(action="worker.heartbeat_failed", queue=queue, messages=len(failed)),
        )
    return failed
