"""Deferring a run: its outbox row pending again, due after a delay, at no cost to the run.

The statement behind every "hold back" path of the worker (no handler here during a rolling
deploy, a pause, a rate limit, a full concurrency cap, an open breaker):
:func:`defer_run`, in one transaction. The run row is locked and checked (ours: same task
and tenant; the outbox envelope equals the received one); its outbox row becomes pending
again (``sent_at`` NULL) with ``available_at`` = now + delay (database clock), never
earlier than it was due already (a copy of a delayed run received early cannot make it due
now), or is written again from the run (:func:`sqla_outbox.lifecycle.columns.outbox_from_run`:
the received envelope, the run's queue and priority) when ``maintenance.purge`` removed it;
the run keeps its status (``queued`` or ``retrying``; a lease this attempt took is given
back: ``running → queued`` with ``attempts - 1``); the trail records the deferral
(``detail.deferred`` = reason, ``delay_seconds``, ``deferrals`` = how many with this reason
so far). The worker then deletes the message (:mod:`sqla_outbox.worker.deferral`).

An attempt that ran and failed may be deferred too (a failure during a breaker outage,
:func:`sqla_outbox.lifecycle.verdict.ride_out`): its error is recorded on the run
(``last_error_type``, ``last_error``) and in the trail row, as a retry would record it;
when a ``Cancel`` was committed meanwhile nothing is deferred (the attempt's run ends
``cancelled`` instead, :func:`sqla_outbox.lifecycle.attempts.mark_cancelled`).
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import enum
import json
import uuid
from collections.abc import Callable
from typing import Any

from sqlalchemy import Float, Integer, Text, bindparam, text
from sqlalchemy.dialects.postgresql import UUID
from sqlalchemy.engine import Connection

from sqla_outbox import charsets
from sqla_outbox.lifecycle import attempts, columns
from sqla_outbox.types import SQS_MAX_VISIBILITY_SECONDS

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
        claim: For NOT_DEFERRABLE, what the run is, as :func:`~sqla_outbox.worker.attempts.
            take_lease` would report it (NOT_FOUND, MISMATCH, SUCCEEDED, FAILED, LEASED).
    """

    status: DeferStatus
    available_at: dt.datetime | None = None
    deferrals: int = 0
    claim: attempts.Claim | None = None


_RUN = text(
    """
SELECT task, tenant_id, queue, status, attempts, lease_owner, dead_lettered_at,
       cancel_requested_at IS NOT NULL AS cancel_requested,
       EXTRACT(EPOCH FROM (lease_expires_at - clock_timestamp()))::float8 AS lease_left,
       (SELECT count(*) FROM task_run_trail t
        WHERE t.run_id = r.run_id AND t.detail->>'deferred' = :reason) AS deferrals
FROM task_runs AS r WHERE run_id = :run_id FOR UPDATE
"""
).bindparams(bindparam("run_id", type_=UUID(as_uuid=True)), bindparam("reason", type_=Text))

_DUE_AFTER_DELAY = "clock_timestamp() + make_interval(secs => :delay)"


def _row_sql(table: str) -> Any:
    return text(
        f"SELECT id, sent_at, envelope = CAST(:document AS jsonb) AS same FROM {table} "
        "WHERE run_id = :run_id FOR UPDATE"
    ).bindparams(bindparam("run_id", type_=UUID(as_uuid=True)), bindparam("document", type_=Text))


def _repend_sql(table: str) -> Any:
    return text(
        f"UPDATE {table} SET sent_at = NULL, "
        # never earlier than the row was due: a copy of a delayed run must not make it due now
        f"available_at = GREATEST(available_at, {_DUE_AFTER_DELAY}) "
        "WHERE id = :id RETURNING available_at"
    ).bindparams(bindparam("delay", type_=Float))


def _reinsert_sql(table: str) -> Any:
    insert = columns.outbox_from_run(
        table,
        where="r.run_id = :run_id",
        envelope="CAST(:document AS jsonb)",
        available_at=f"GREATEST(r.available_at, {_DUE_AFTER_DELAY})",
    )
    return text(f"{insert}\nRETURNING available_at").bindparams(
        bindparam("run_id", type_=UUID(as_uuid=True)), bindparam("delay", type_=Float)
    )


_ROW = {table: _row_sql(table) for table in columns.OUTBOX_TABLES}
_REPEND = {table: _repend_sql(table) for table in columns.OUTBOX_TABLES}
_REINSERT = {table: _reinsert_sql(table) for table in columns.OUTBOX_TABLES}
_GIVE_BACK_LEASE = text(
    """
UPDATE task_runs
SET status = 'queued', attempts = GREATEST(attempts - :uncounted, 0), lease_owner = NULL,
    lease_expires_at = NULL, updated_at = clock_timestamp(),
    last_error_type = COALESCE(:error_type, last_error_type),
    last_error = COALESCE(:error_message, last_error)
WHERE run_id = :run_id AND status = 'running'
RETURNING status, attempts
"""
).bindparams(
    bindparam("run_id", type_=UUID(as_uuid=True)),
    bindparam("uncounted", type_=Integer),
    bindparam("error_type", type_=Text),
    bindparam("error_message", type_=Text),
)
_TRAIL = text(
    columns.trail_insert(
        dict(
            run_id=":run_id",
            status=":status",
            attempt=":attempt",
            receive_count=":receive_count",
            worker_id=":worker_id",
            error_type=":error_type",
            error_message=":error_message",
            traceback=":traceback",
            detail="CAST(:detail AS jsonb)",
        )
    )
).bindparams(
    bindparam("run_id", type_=UUID(as_uuid=True)),
    bindparam("detail", type_=Text),
    bindparam("error_type", type_=Text),
    bindparam("error_message", type_=Text),
    bindparam("traceback", type_=Text),
)


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
    failure: attempts.Failure | None = None,
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
        failure: The error of the attempt being deferred (with ``attempt``: an attempt
            that ran and failed): recorded on the run and in the trail row.

    Returns:
        A :class:`DeferResult`; NOT_DEFERRABLE with a CANCELLED claim when ``attempt``
        holds the run but a ``Cancel`` was committed meanwhile (nothing changed: the
        caller ends the attempt ``cancelled``).
    """
    run = connection.execute(_RUN, {"run_id": run_id, "reason": reason}).one_or_none()
    if run is None:
        return DeferResult(DeferStatus.NOT_DEFERRABLE, claim=attempts.Claim(attempts.ClaimStatus.NOT_FOUND))
    if run.task != task or run.tenant_id != tenant_id or run.queue != queue:
        return _not(attempts.ClaimStatus.MISMATCH, run)
    if run.status == "succeeded":
        return _not(attempts.ClaimStatus.SUCCEEDED, run)
    if run.status == "cancelled":
        return _not(attempts.ClaimStatus.CANCELLED, run)
    if run.status == "failed":
        return DeferResult(
            DeferStatus.NOT_DEFERRABLE,
            claim=attempts.Claim(
                attempts.ClaimStatus.FAILED,
                dead_lettered=run.dead_lettered_at is not None,
                previous_status="failed",
            ),
        )
    ours = attempt is not None and run.status == "running" and run.attempts == attempt
    if ours and run.cancel_requested:
        return _not(attempts.ClaimStatus.CANCELLED, run)
    if run.status == "running" and not ours and run.lease_left is not None and run.lease_left > 0:
        return DeferResult(
            DeferStatus.NOT_DEFERRABLE,
            claim=attempts.Claim(
                attempts.ClaimStatus.LEASED,
                lease_remaining_seconds=float(run.lease_left),
                previous_status="running",
            ),
        )
    table = "platform_outbox_messages" if tenant_id is None else "outbox_messages"
    row = connection.execute(_ROW[table], {"run_id": run_id, "document": document}).one_or_none()
    if row is not None and not row.same:
        return _not(attempts.ClaimStatus.MISMATCH, run)
    if row is not None and row.sent_at is None and not ours:
        return DeferResult(DeferStatus.ALREADY_PENDING)  # a copy of a run deferred already
    deferrals = int(run.deferrals)
    seconds = delay_seconds(deferrals) if callable(delay_seconds) else delay_seconds
    seconds = min(max(float(seconds), 0.0), float(SQS_MAX_VISIBILITY_SECONDS))
    if row is not None:
        available_at = connection.execute(_REPEND[table], {"id": row.id, "delay": seconds}).scalar_one()
    else:  # purged after it was sent: the received envelope (checked to be the run's) goes back
        available_at = connection.execute(
            _REINSERT[table], {"run_id": run_id, "document": document, "delay": seconds}
        ).scalar_one()
    status, attempt_count = run.status, int(run.attempts)
    if run.status == "running":  # our own lease, or an expired one: give it back
        recorded = failure if ours else None
        given = connection.execute(
            _GIVE_BACK_LEASE,
            {
                "run_id": run_id,
                "uncounted": 1 if ours else 0,
                "error_type": recorded.error_type if recorded else None,
                "error_message": recorded.message if recorded else None,
            },
        ).one()
        status, attempt_count = given.status, int(given.attempts)
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
            "attempt": attempt_count,
            "receive_count": receive_count,
            "worker_id": worker_id,
            "detail": json.dumps(charsets.jsonb_safe(trail)),
            "error_type": failure.error_type if failure else None,
            "error_message": failure.message if failure else None,
            "traceback": failure.traceback if failure else None,
        },
    )
    return DeferResult(DeferStatus.DEFERRED, available_at=available_at, deferrals=deferrals + 1)


def _not(status: attempts.ClaimStatus, run: Any) -> DeferResult:
    return DeferResult(DeferStatus.NOT_DEFERRABLE, claim=attempts.Claim(status, previous_status=run.status))
