"""Deferring a run: hand it back to the outbox instead of running it, at no cost to the run.

The worker-side primitive for every "hold back" path (a rolling deploy today; rate
limits, concurrency caps, open breakers and pauses reuse it). The rule (ADR 0010): holding
work back never spends a run's attempts or SQS receive budget and never sends it to the DLQ.

Returning the message to its queue (ChangeMessageVisibility) would spend budget: SQS
counts every receive toward the redrive ``maxReceiveCount``, and a message that waits
long enough ends in the DLQ. So a deferral takes the message *out* of SQS and lets the
outbox send it again later, as a fresh message (new message id, receive count 1):

1. **Database first**, one transaction (:func:`defer_run`): the run row is locked and
   checked (ours: same task and tenant; the outbox envelope equals the received one); its
   outbox row becomes pending again (``sent_at`` NULL) with ``available_at`` = now +
   delay (database clock), never earlier than it was due already (a copy of a delayed
   run received early cannot make it due now), or is re-inserted from the received envelope when
   ``maintenance.purge`` removed it; the run keeps its status (``queued`` or
   ``retrying``; a lease this attempt took is given back: ``running → queued`` with
   ``attempts - 1``); the trail records the deferral (``detail.deferred`` = reason,
   ``delay_seconds``, ``deferrals`` = how many with this reason so far).
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

import dataclasses
import datetime as dt
import enum
import json
import logging
import uuid
from collections.abc import Callable
from typing import Any

from sqlalchemy import Float, Integer, Text, bindparam, text
from sqlalchemy.dialects.postgresql import UUID
from sqlalchemy.engine import Connection

from sqla_outbox import envelope, metrics
from sqla_outbox.logging import log_extra, short_handle
from sqla_outbox.types import WAKE_CHANNEL
from sqla_outbox.worker import runs
from sqla_outbox.worker.flight import InFlight
from sqla_outbox.worker.runtime import Runtime

logger = logging.getLogger("sqla_outbox.worker")

Delay = float | Callable[[int], float]
"""Seconds, or a function of the number of earlier deferrals with the same reason."""


class DeferStatus(enum.Enum):
    DEFERRED = "deferred"  # the outbox row is pending again; delete the message
    ALREADY_PENDING = "already-pending"  # another copy deferred it already; delete this copy
    NOT_DEFERRABLE = "not-deferrable"  # see ``claim``: finished, leased elsewhere, not ours


@dataclasses.dataclass(frozen=True)
class DeferResult:
    """Outcome of :func:`defer_run`.

    Attributes:
        status: See :class:`DeferStatus`.
        available_at: When the outbox sends it again (DEFERRED only; database clock).
        deferrals: Deferrals with this reason so far, this one included (DEFERRED only).
        claim: For NOT_DEFERRABLE, what the run is, as :func:`~sqla_outbox.worker.runs.
            take_lease` would report it (NOT_FOUND, MISMATCH, SUCCEEDED, FAILED, LEASED).
    """

    status: DeferStatus
    available_at: dt.datetime | None = None
    deferrals: int = 0
    claim: runs.Claim | None = None


_RUN = text(
    """
SELECT task, tenant_id, status, attempts, lease_owner, dead_lettered_at,
       EXTRACT(EPOCH FROM (lease_expires_at - clock_timestamp()))::float8 AS lease_left,
       (SELECT count(*) FROM task_run_trail t
        WHERE t.run_id = r.run_id AND t.detail->>'deferred' = :reason) AS deferrals
FROM task_runs AS r WHERE run_id = :run_id FOR UPDATE
"""
).bindparams(bindparam("run_id", type_=UUID(as_uuid=True)), bindparam("reason", type_=Text))


def _row_sql(table: str) -> Any:
    return text(
        f"SELECT id, sent_at, envelope = CAST(:document AS jsonb) AS same FROM {table} "
        "WHERE run_id = :run_id FOR UPDATE"
    ).bindparams(bindparam("run_id", type_=UUID(as_uuid=True)), bindparam("document", type_=Text))


def _repend_sql(table: str) -> Any:
    return text(
        f"UPDATE {table} SET sent_at = NULL, "
        # never earlier than the row was due: a copy of a delayed run must not make it due now
        "available_at = GREATEST(available_at, clock_timestamp() + make_interval(secs => :delay)) "
        "WHERE id = :id RETURNING available_at"
    ).bindparams(bindparam("delay", type_=Float))


_ROW = {table: _row_sql(table) for table in ("outbox_messages", "platform_outbox_messages")}
_REPEND = {table: _repend_sql(table) for table in ("outbox_messages", "platform_outbox_messages")}
_REINSERT = {
    "outbox_messages": text(
        """
INSERT INTO outbox_messages (tenant_id, run_id, queue, envelope, available_at)
VALUES (:tenant_id, :run_id, :queue, CAST(:document AS jsonb),
        GREATEST((SELECT available_at FROM task_runs WHERE run_id = :run_id),
                 clock_timestamp() + make_interval(secs => :delay)))
RETURNING available_at
"""
    ).bindparams(bindparam("run_id", type_=UUID(as_uuid=True)), bindparam("delay", type_=Float)),
    "platform_outbox_messages": text(
        """
INSERT INTO platform_outbox_messages (run_id, queue, envelope, available_at)
VALUES (:run_id, :queue, CAST(:document AS jsonb),
        GREATEST((SELECT available_at FROM task_runs WHERE run_id = :run_id),
                 clock_timestamp() + make_interval(secs => :delay)))
RETURNING available_at
"""
    ).bindparams(bindparam("run_id", type_=UUID(as_uuid=True)), bindparam("delay", type_=Float)),
}
_GIVE_BACK_LEASE = text(
    """
UPDATE task_runs
SET status = 'queued', attempts = GREATEST(attempts - :uncounted, 0), lease_owner = NULL,
    lease_expires_at = NULL, updated_at = clock_timestamp()
WHERE run_id = :run_id
RETURNING status, attempts
"""
).bindparams(bindparam("run_id", type_=UUID(as_uuid=True)), bindparam("uncounted", type_=Integer))
_NOTIFY = text(f"SELECT pg_notify('{WAKE_CHANNEL}', '')")
_TRAIL = text(
    """
INSERT INTO task_run_trail (run_id, status, attempt, receive_count, worker_id, detail)
VALUES (:run_id, :status, :attempt, :receive_count, :worker_id, CAST(:detail AS jsonb))
"""
).bindparams(bindparam("run_id", type_=UUID(as_uuid=True)), bindparam("detail", type_=Text))


def defer_run(
    connection: Connection,
    *,
    run_id: uuid.UUID,
    task: str,
    tenant_id: int | None,
    queue: str,
    document: str,
    reason: str,
    delay_seconds: Delay,
    worker_id: str,
    receive_count: int,
    attempt: int | None = None,
    detail: dict[str, Any] | None = None,
) -> DeferResult:
    """Put a received run back in the outbox, due after a delay (see the module docstring).

    Commits nothing: the caller's transaction does (``runtime.in_transaction``).

    Args:
        connection: A connection inside a transaction.
        run_id / task / tenant_id / queue: From the received envelope.
        document: The received envelope as JSON text (``Envelope.encode()``); it must equal
            the run's outbox envelope, compared as ``jsonb`` (as ``take_lease`` does).
        reason: Short machine-readable reason (``no-handler``, ``rate-limit``, ...).
        delay_seconds: Seconds until the outbox sends it again, 0..43,200, or a function of
            the earlier deferrals with this reason (to grow the delay).
        worker_id / receive_count: Recorded in the trail.
        attempt: The attempt number when this delivery took the run's lease
            (``take_lease``): the lease is given back and the attempt not counted. None
            when the run was not leased (the usual case: defer before taking it).
        detail: Extra JSON context for the trail row.

    Returns:
        A :class:`DeferResult`.
    """
    run = connection.execute(_RUN, {"run_id": run_id, "reason": reason}).one_or_none()
    if run is None:
        return DeferResult(DeferStatus.NOT_DEFERRABLE, claim=runs.Claim(runs.ClaimStatus.NOT_FOUND))
    if run.task != task or run.tenant_id != tenant_id:
        return _not(runs.ClaimStatus.MISMATCH, run)
    if run.status == "succeeded":
        return _not(runs.ClaimStatus.SUCCEEDED, run)
    if run.status == "cancelled":
        return _not(runs.ClaimStatus.CANCELLED, run)
    if run.status == "failed":
        return DeferResult(
            DeferStatus.NOT_DEFERRABLE,
            claim=runs.Claim(
                runs.ClaimStatus.FAILED,
                dead_lettered=run.dead_lettered_at is not None,
                previous_status="failed",
            ),
        )
    ours = attempt is not None and run.status == "running" and run.attempts == attempt
    if run.status == "running" and not ours and run.lease_left is not None and run.lease_left > 0:
        return DeferResult(
            DeferStatus.NOT_DEFERRABLE,
            claim=runs.Claim(
                runs.ClaimStatus.LEASED,
                lease_remaining_seconds=float(run.lease_left),
                previous_status="running",
            ),
        )
    table = "platform_outbox_messages" if tenant_id is None else "outbox_messages"
    row = connection.execute(_ROW[table], {"run_id": run_id, "document": document}).one_or_none()
    if row is not None and not row.same:
        return _not(runs.ClaimStatus.MISMATCH, run)
    if row is not None and row.sent_at is None and not ours:
        return DeferResult(DeferStatus.ALREADY_PENDING)  # a copy of a run deferred already
    deferrals = int(run.deferrals)
    seconds = delay_seconds(deferrals) if callable(delay_seconds) else delay_seconds
    seconds = min(max(float(seconds), 0.0), 43_200.0)
    if row is not None:
        available_at = connection.execute(_REPEND[table], {"id": row.id, "delay": seconds}).scalar_one()
    else:  # purged after it was sent: the received envelope (checked to be the run's) goes back
        available_at = connection.execute(
            _REINSERT[table],
            {
                "run_id": run_id,
                "tenant_id": tenant_id,
                "queue": queue,
                "document": document,
                "delay": seconds,
            },
        ).scalar_one()
    status, attempts = run.status, int(run.attempts)
    if run.status == "running":  # our own lease, or an expired one: give it back
        given = connection.execute(_GIVE_BACK_LEASE, {"run_id": run_id, "uncounted": 1 if ours else 0}).one()
        status, attempts = given.status, int(given.attempts)
    trail = {
        **(detail or {}),
        "deferred": reason,
        "delay_seconds": round(seconds, 3),
        "deferrals": deferrals + 1,
    }
    connection.execute(
        _TRAIL,
        {
            "run_id": run_id,
            "status": status,
            "attempt": attempts,
            "receive_count": receive_count,
            "worker_id": worker_id,
            "detail": json.dumps(trail),
        },
    )
    return DeferResult(DeferStatus.DEFERRED, available_at=available_at, deferrals=deferrals + 1)


def _not(status: runs.ClaimStatus, run: Any) -> DeferResult:
    return DeferResult(DeferStatus.NOT_DEFERRABLE, claim=runs.Claim(status, previous_status=run.status))


async def defer_message(
    runtime: Runtime,
    flight: InFlight,
    env: envelope.Envelope,
    *,
    reason: str,
    delay_seconds: Delay,
    detail: dict[str, Any] | None = None,
) -> DeferResult:
    """Defer the run of a received message: :func:`defer_run`, then delete the message.

    Args:
        runtime: The worker's runtime.
        flight: The received message (``flight.leased``/``flight.attempt`` when this
            delivery holds the run's lease: the attempt is then not counted).
        env: Its decoded envelope.
        reason / delay_seconds / detail: As for :func:`defer_run`.

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
