"""Deferring a run: hand it back to the outbox instead of running it, at no cost to the run.

The worker-side primitive for every "hold back" path (a rolling deploy today; rate
limits, concurrency caps, open breakers and pauses reuse it). The rule (ADR 0010): holding
work back never spends a run's attempts or SQS receive budget and never sends it to the DLQ.

Returning the message to its queue (ChangeMessageVisibility) would spend budget: SQS
counts every receive toward the redrive ``maxReceiveCount``, and a message that waits
long enough ends in the DLQ. So a deferral takes the message *out* of SQS and lets the
outbox send it again later, as a fresh message (new message id, receive count 1):

1. **Database first**, one transaction (:func:`sqla_outbox.lifecycle.deferral.defer_run`):
   the run row is locked and checked, its outbox row becomes pending again, due after the
   delay (or is written again from the run when ``maintenance.purge`` removed it), a lease
   this attempt took is given back, and the trail records the deferral.
2. **Then the message is deleted** (batched ack). A worker that dies between the two
   leaves both a pending row and the message; the copy that comes back finds the row
   pending and is only acknowledged, and whichever copy runs first wins by ``run_id``.

::

    outcome = await deferral.defer_message(runtime, flight, env, reason="rate-limit",
                                           delay_seconds=lambda deferrals: 2.0 ** deferrals)
    if outcome.claim is not None:   # not deferrable: finished, leased elsewhere, foreign
        ...                         # settle it like any unclaimed message

The relay picks the row up when it is due: its timer follows the earliest
``available_at`` it knows of, so :func:`defer_message` wakes it once the deferral is
committed (the Valkey wake, or a ``NOTIFY`` in the deferral's transaction, as
``wake_mode`` says); the pass that wake starts finds nothing due yet and sets its timer to
the deferred row's due time, instead of the next sweep (5 s by default) finding it late.
"""

from __future__ import annotations

import logging
from typing import Any

from sqlalchemy import text
from sqlalchemy.engine import Connection

from sqla_outbox import envelope, metrics
from sqla_outbox.lifecycle.attempts import Failure
from sqla_outbox.lifecycle.deferral import DeferResult, DeferStatus, Delay, defer_run
from sqla_outbox.logging import log_extra, short_handle
from sqla_outbox.types import WAKE_CHANNEL
from sqla_outbox.worker.flight import InFlight
from sqla_outbox.worker.runtime import Runtime

__all__ = ["DeferResult", "DeferStatus", "Delay", "defer_message", "defer_run"]

logger = logging.getLogger("sqla_outbox.worker")

_NOTIFY = text(f"SELECT pg_notify('{WAKE_CHANNEL}', '')")


async def defer_message(
    runtime: Runtime,
    flight: InFlight,
    env: envelope.Envelope,
    *,
    reason: str,
    delay_seconds: Delay,
    detail: dict[str, Any] | None = None,
    failure: Failure | None = None,
) -> DeferResult:
    """Defer the run of a received message: :func:`~sqla_outbox.lifecycle.deferral.defer_run`,
    then delete the message.

    Args:
        runtime: The worker's runtime.
        flight: The received message (``flight.leased``/``flight.attempt`` when this
            delivery holds the run's lease: the attempt is then not counted).
        env: Its decoded envelope.
        reason / delay_seconds / detail / failure: As for :func:`defer_run`.

    Returns:
        The :class:`DeferResult`. DEFERRED and ALREADY_PENDING: the message was deleted
        (batched); NOT_DEFERRABLE: nothing was changed, the caller settles the message
        by ``result.claim``.

    Raises:
        sqlalchemy.exc.DBAPIError: The database failed; nothing changed, the message
            comes back after its visibility timeout.
    """

    def work(conn: Connection) -> DeferResult:
        deferred = defer_run(
            conn,
            run_id=env.run_id,
            task=env.task,
            tenant_id=env.tenant_id,
            queue=env.queue,
            document=env.encode(),
            reason=reason,
            delay_seconds=delay_seconds,
            worker_id=runtime.worker_id,
            receive_count=flight.receive_count,
            attempt=flight.attempt if flight.leased else None,
            detail=detail,
            failure=failure,
        )
        if deferred.status is DeferStatus.DEFERRED and runtime.settings.wake_notify:
            conn.execute(_NOTIFY)  # delivered at commit: the relay learns the new due time
        return deferred

    result: DeferResult = await runtime.io(runtime.in_transaction, work)
    if result.status is DeferStatus.NOT_DEFERRABLE:
        return result
    if result.status is DeferStatus.DEFERRED:
        runtime.wake_relay()
        flight.verdict = "deferred"
        runtime.counters.deferred += 1
        metrics.RUNS_DEFERRED.labels(env.task, reason).inc()
    logger.info(
        "run deferred to the outbox" if result.status is DeferStatus.DEFERRED else "copy of a deferred run",
        extra=log_extra(
            action="worker.deferred" if result.status is DeferStatus.DEFERRED else "worker.duplicate",
            run_id=str(env.run_id),
            task=env.task,
            queue=flight.queue,
            message_id=flight.message_id,
            receipt=short_handle(flight.receipt_handle),
            receive_count=flight.receive_count,
            reason=reason,
            deferrals=result.deferrals,
            available_at=result.available_at.isoformat() if result.available_at else None,
        ),
    )
    runtime.acks.ack_soon(flight.queue, flight.receipt_handle)
    return result
