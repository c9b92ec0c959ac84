"""The worker's statements on a run: take the lease, finish, retry, fail, give back; each with its trail row.

Every transition is one statement (a data-modifying CTE that updates ``task_runs`` and
inserts the ``task_run_trail`` row) guarded by ``status = 'running' AND attempts =
:attempt``: only the attempt that holds the lease can change the run. A guard that
matches nothing means the attempt lost the run (its lease expired and another worker
took over, or a timeout/shutdown already recorded a verdict); the caller then reads the
current status and reconciles instead of overwriting it.

Lease: taking a run sets ``lease_owner`` and ``lease_expires_at = now + lease``; the
heartbeat renews it. Another worker may take a ``running`` run only once the lease has
expired, so two copies of one message never run the handler at the same time.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import enum
import json
import math
import uuid
from collections.abc import Sequence
from typing import Any

from sqlalchemy import BindParameter, Float, Integer, Text, bindparam, text
from sqlalchemy.dialects.postgresql import ARRAY, UUID
from sqlalchemy.engine import Connection

from sqla_outbox import charsets
from sqla_outbox.lifecycle import columns

TRACEBACK_CHARS = 4000
RETRY_DUE_TOLERANCE_SECONDS = 1.0
"""A retrying run is due this much before its message's visibility ends (see
:func:`mark_retrying`): the message must find the run due, or its receive is spent."""
MESSAGE_CHARS = 2000


class ClaimStatus(enum.Enum):
    """Result of trying to take a run's lease."""

    CLAIMED = "claimed"
    NOT_FOUND = "not_found"  # no such run: a foreign or forged message
    MISMATCH = "mismatch"  # the run exists but the envelope is not the one the relay sent
    SUCCEEDED = "succeeded"  # finished: acknowledge the copy
    FAILED = "failed"  # finished: complete the DLQ path if it was not completed
    CANCELLED = "cancelled"  # cancelled (now or before): acknowledge, never run the handler
    LEASED = "leased"  # another worker holds a live lease
    NOT_DUE = "not_due"  # queued, but its available_at is still ahead: not ours to run yet


@dataclasses.dataclass(frozen=True)
class Claim:
    """Outcome of :func:`take_lease`.

    Attributes:
        status: See :class:`ClaimStatus`.
        attempt: The attempt number taken (CLAIMED only).
        lease_remaining_seconds: For LEASED: seconds until the other lease expires.
        dead_lettered: For FAILED: whether the DLQ send was already recorded.
        previous_status: Status before the claim (for the log).
        due_in_seconds: For NOT_DUE: seconds until the run's ``available_at`` (database clock).
    """

    status: ClaimStatus
    attempt: int = 0
    lease_remaining_seconds: float = 0.0
    dead_lettered: bool = False
    previous_status: str | None = None
    due_in_seconds: float = 0.0


_TAKE = text(
    f"""
WITH prev AS (
    SELECT run_id, task, tenant_id, queue, status, attempts, dead_lettered_at, cancel_requested_at,
           EXTRACT(EPOCH FROM (lease_expires_at - clock_timestamp()))::float8 AS lease_left,
           EXTRACT(EPOCH FROM (available_at - clock_timestamp()))::float8 AS due_in
    FROM task_runs WHERE run_id = :run_id FOR UPDATE
),
sent AS (
    SELECT envelope FROM outbox_messages WHERE run_id = :run_id
    UNION ALL
    SELECT envelope FROM platform_outbox_messages WHERE run_id = :run_id
),
checked AS (
    SELECT NOT EXISTS (
        SELECT 1 FROM sent WHERE sent.envelope <> CAST(:document AS jsonb)
    ) AS envelope_matches
),
claimed AS (
    UPDATE task_runs AS t
    SET status = 'running', attempts = t.attempts + 1, lease_owner = :worker,
        lease_expires_at = clock_timestamp() + make_interval(secs => :lease_seconds),
        started_at = clock_timestamp(), updated_at = clock_timestamp()
    FROM prev, checked
    WHERE t.run_id = prev.run_id AND prev.task = :task
      AND prev.tenant_id IS NOT DISTINCT FROM :tenant_id AND checked.envelope_matches
      AND (CAST(:queue AS text) IS NULL OR prev.queue = :queue)
      AND (prev.due_in <= 0 OR NOT CAST(:honour_due_time AS boolean))
      AND prev.cancel_requested_at IS NULL
      AND (prev.status IN ('queued', 'retrying')
           OR (prev.status = 'running' AND (prev.lease_left IS NULL OR prev.lease_left <= 0)))
    RETURNING t.attempts
),
abandoned AS (
    -- a cancel asked a running run to stop and its worker vanished: the run ends here
    UPDATE task_runs AS t
    SET status = 'cancelled', finished_at = clock_timestamp(), updated_at = clock_timestamp(),
        lease_owner = NULL, lease_expires_at = NULL
    FROM prev, checked
    WHERE t.run_id = prev.run_id AND prev.task = :task
      AND prev.tenant_id IS NOT DISTINCT FROM :tenant_id AND checked.envelope_matches
      AND prev.status = 'running' AND prev.cancel_requested_at IS NOT NULL
      AND (prev.lease_left IS NULL OR prev.lease_left <= 0)
    RETURNING t.attempts
),
abandoned_trail AS (
    {
        columns.trail_insert(
            dict(
                run_id=":run_id",
                status="'cancelled'",
                attempt="abandoned.attempts",
                receive_count=":receive_count",
                worker_id=":worker",
                detail="jsonb_build_object('reason', 'cancel-requested', 'lease', 'expired')",
            ),
            source="abandoned",
        )
    }
),
trail AS (
    {
        columns.trail_insert(
            dict(
                run_id=":run_id",
                status="'running'",
                attempt="claimed.attempts",
                receive_count=":receive_count",
                worker_id=":worker",
                detail="jsonb_build_object('from', prev.status)",
            ),
            source="claimed, prev",
        )
    }
)
SELECT prev.task, prev.tenant_id, prev.queue, prev.status, prev.lease_left, prev.due_in,
       prev.dead_lettered_at, checked.envelope_matches, claimed.attempts AS claimed_attempt,
       abandoned.attempts AS abandoned_attempt
FROM prev CROSS JOIN checked LEFT JOIN claimed ON true LEFT JOIN abandoned ON true
"""
).bindparams(
    bindparam("run_id", type_=UUID(as_uuid=True)),
    bindparam("lease_seconds", type_=Float),
    bindparam("document", type_=Text),
)


def take_lease(
    connection: Connection,
    *,
    run_id: uuid.UUID,
    task: str,
    tenant_id: int | None,
    worker_id: str,
    lease_seconds: float,
    receive_count: int,
    document: str | None = None,
    queue: str | None = None,
    honour_due_time: bool = True,
) -> Claim:
    """Take the run's lease for a new attempt if nobody holds a live one and the run is due.

    The envelope's task, tenant and queue must match the run (a forged message naming a
    real run_id with another task is refused as MISMATCH), and so must its content
    (below). A ``queued``/``retrying`` run whose ``available_at`` (database clock) is still
    ahead is not taken: NOT_DUE, with the seconds left; the relay only sends a run once it
    is due, so such a message is an early copy. Commits nothing: the caller does.

    Args:
        document: The received envelope as JSON text (``Envelope.encode()``). While the
            run's outbox row exists (until ``maintenance.purge`` removes sent rows), the
            envelope must equal the one the relay sent, field for field (compared as
            PostgreSQL ``jsonb``); a copy that names a real run but carries another payload,
            queue, event, key or trace is refused as MISMATCH, whatever the run's status.
            None skips the comparison (test helpers that build their own messages).
        queue: The envelope's queue; None skips the comparison.
        honour_due_time: False takes a run that is not due yet (the inline test runner's
            ``include_delayed``); the worker always passes True.
    """
    row = connection.execute(
        _TAKE,
        {
            "run_id": run_id,
            "task": task,
            "tenant_id": tenant_id,
            "worker": worker_id,
            "lease_seconds": lease_seconds,
            "receive_count": receive_count,
            "document": document,
            "queue": queue,
            "honour_due_time": honour_due_time,
        },
    ).one_or_none()
    if row is None:
        return Claim(ClaimStatus.NOT_FOUND)
    if row.claimed_attempt is not None:
        return Claim(ClaimStatus.CLAIMED, attempt=row.claimed_attempt, previous_status=row.status)
    if (
        row.task != task
        or row.tenant_id != tenant_id
        or not row.envelope_matches
        or (queue is not None and row.queue != queue)
    ):
        return Claim(ClaimStatus.MISMATCH, previous_status=row.status)
    if (
        honour_due_time
        and row.status in ("queued", "retrying")
        and row.due_in > 0
        and row.abandoned_attempt is None
    ):
        return Claim(ClaimStatus.NOT_DUE, previous_status=row.status, due_in_seconds=float(row.due_in))
    if row.status == "cancelled" or row.abandoned_attempt is not None:
        return Claim(ClaimStatus.CANCELLED, previous_status=row.status)
    if row.status == "succeeded":
        return Claim(ClaimStatus.SUCCEEDED, previous_status=row.status)
    if row.status == "failed":
        return Claim(
            ClaimStatus.FAILED, dead_lettered=row.dead_lettered_at is not None, previous_status=row.status
        )
    return Claim(
        ClaimStatus.LEASED,
        lease_remaining_seconds=max(float(row.lease_left or 0), 0.0),
        previous_status=row.status,
    )


def _transition(new_status: str, extra_set: str, *, cancel_requested: bool = False) -> Any:
    # A committed cancel request wins over the attempt's own verdict: only
    # mark_cancelled moves a run whose cancel_requested_at is set (control_write).
    guard = "IS NOT NULL" if cancel_requested else "IS NULL"
    sql = f"""
WITH moved AS (
    UPDATE task_runs
    SET status = '{new_status}', updated_at = clock_timestamp(), lease_owner = NULL,
        lease_expires_at = NULL{extra_set}
    WHERE run_id = :run_id AND status = 'running' AND attempts = :attempt
      AND cancel_requested_at {guard}
    RETURNING run_id
)
{
        columns.trail_insert(
            dict(
                run_id="run_id",
                status=f"'{new_status}'",
                attempt=":attempt",
                receive_count=":receive_count",
                worker_id=":worker",
                error_type=":error_type",
                error_message=":error_message",
                traceback=":traceback",
                detail="CAST(:detail AS jsonb)",
            ),
            source="moved",
        )
    }
RETURNING 1
"""
    binds: list[BindParameter[Any]] = [
        bindparam("run_id", type_=UUID(as_uuid=True)),
        bindparam("attempt", type_=Integer),
        bindparam("error_type", type_=Text),
        bindparam("error_message", type_=Text),
        bindparam("traceback", type_=Text),
        bindparam("detail", type_=Text),
        bindparam("result", type_=Text),
        bindparam("backoff", type_=Float),
    ]
    return text(sql).bindparams(*(b for b in binds if f":{b.key}" in sql))


_ERROR_SET = ", last_error_type = :error_type, last_error = :error_message"
_SUCCEED = _transition("succeeded", ", finished_at = clock_timestamp(), result = CAST(:result AS jsonb)")
_CANCEL = _transition("cancelled", ", finished_at = clock_timestamp()", cancel_requested=True)
# the next try's time: a copy of the run that arrives before it is an early copy (take_lease
# answers NOT_DUE), whoever sent it; the run's own message comes back after the same delay
_RETRY = _transition(
    "retrying",
    _ERROR_SET + ", available_at = clock_timestamp() + make_interval(secs => CAST(:backoff AS float8))",
)
_FAIL = _transition("failed", ", finished_at = clock_timestamp()" + _ERROR_SET)
_REQUEUE = _transition("queued", "")


@dataclasses.dataclass(frozen=True)
class Attempt:
    """Identifies the attempt making a transition (and what the trail records about it)."""

    run_id: uuid.UUID
    attempt: int
    receive_count: int
    worker_id: str


@dataclasses.dataclass(frozen=True)
class Failure:
    """An error as the trail stores it."""

    error_type: str
    message: str
    traceback: str | None = None

    @classmethod
    def from_exception(cls, exc: BaseException, traceback: str | None = None) -> Failure:
        """The failure as PostgreSQL can store it: type name, message and traceback
        excerpt pass :func:`sqla_outbox.charsets.for_postgres` (a handler's ``"upstream
        said \x00"`` is stored as ``upstream said \\x00``), then are cut to
        :data:`MESSAGE_CHARS` / the last :data:`TRACEBACK_CHARS` characters."""
        return cls(
            error_type=charsets.for_postgres(
                f"{type(exc).__module__}.{type(exc).__qualname__}".removeprefix("builtins.")
            )[:MESSAGE_CHARS],
            message=charsets.for_postgres(_message_of(exc))[:MESSAGE_CHARS],
            traceback=charsets.for_postgres(traceback)[-TRACEBACK_CHARS:] if traceback else None,
        )


def _message_of(exc: BaseException) -> str:
    """``str(exc)``, or a note when the exception's own ``__str__`` fails."""
    try:
        return str(exc)
    except Exception as failure:  # a handler's exception class with a broken __str__
        return f"<{type(exc).__name__}.__str__ failed: {type(failure).__name__}>"


def _params(attempt: Attempt, failure: Failure | None, detail: dict[str, Any] | None) -> dict[str, Any]:
    return {
        "run_id": attempt.run_id,
        "attempt": attempt.attempt,
        "receive_count": attempt.receive_count,
        "worker": attempt.worker_id,
        "error_type": failure.error_type if failure else None,
        "error_message": failure.message if failure else None,
        "traceback": failure.traceback if failure else None,
        "detail": json.dumps(charsets.jsonb_safe(detail)) if detail else None,
        "result": None,
    }


def mark_succeeded(
    connection: Connection,
    attempt: Attempt,
    *,
    detail: dict[str, Any] | None = None,
    result: str | None = None,
) -> bool:
    """``running → succeeded``. Run it in the handler's transaction; False = lease lost
    (or a cancel was requested: see :func:`mark_cancelled`).

    Args:
        detail: The handler's ``ctx.trail_detail`` (bounded by the caller), stored in the
            trail row.
        result: The handler's result as JSON text (checked and bounded by
            :func:`sqla_outbox.results.encode_result`), stored in ``task_runs.result``;
            None stores SQL NULL.
    """
    params = _params(attempt, None, detail or None)
    params["result"] = result
    return connection.execute(_SUCCEED, params).first() is not None


def mark_cancelled(connection: Connection, attempt: Attempt, *, detail: dict[str, Any] | None = None) -> bool:
    """``running → cancelled`` for an attempt whose run has a committed cancel request;
    False when there is none (or the attempt lost the run)."""
    merged = {**(detail or {}), "reason": "cancel-requested"}
    return connection.execute(_CANCEL, _params(attempt, None, merged)).first() is not None


_CANCEL_REQUESTS = text(
    "SELECT run_id FROM task_runs WHERE run_id = ANY(:run_ids) AND status = 'running' "
    "AND cancel_requested_at IS NOT NULL"
).bindparams(bindparam("run_ids", type_=ARRAY(UUID(as_uuid=True))))


def cancel_requests(connection: Connection, run_ids: Sequence[uuid.UUID]) -> set[uuid.UUID]:
    """Of ``run_ids``, the running runs a committed ``Cancel`` asked to stop (one
    primary-key lookup per run; the heartbeat calls it every ``worker_cancel_check_seconds``)."""
    if not run_ids:
        return set()
    return {row[0] for row in connection.execute(_CANCEL_REQUESTS, {"run_ids": list(run_ids)})}


_RETRY_ROW = {
    table: text(
        f"UPDATE {table} SET sent_at = NULL, "
        "available_at = clock_timestamp() + make_interval(secs => :delay) "
        "WHERE run_id = :run_id AND parked_at IS NULL RETURNING id"
    ).bindparams(bindparam("run_id", type_=UUID(as_uuid=True)), bindparam("delay", type_=Float))
    for table in columns.OUTBOX_TABLES
}
_RETRY_REINSERT = {
    table: text(
        columns.outbox_from_run(
            table,
            where="r.run_id = :run_id AND r.tenant_id IS "
            + ("NOT NULL" if table == "outbox_messages" else "NULL"),
            envelope="CAST(:document AS jsonb)",
            available_at="clock_timestamp() + make_interval(secs => :delay)",
        )
    ).bindparams(
        bindparam("run_id", type_=UUID(as_uuid=True)),
        bindparam("delay", type_=Float),
        bindparam("document", type_=Text),
    )
    for table in columns.OUTBOX_TABLES
}


def mark_retrying(
    connection: Connection,
    attempt: Attempt,
    failure: Failure,
    *,
    backoff_seconds: float,
    detail: dict[str, Any] | None = None,
    via_outbox: bool = False,
    document: str | None = None,
) -> bool:
    """``running → retrying`` with the error, due again after ``backoff_seconds``
    (``available_at``: a copy received before then is an early copy and waits); False when
    the attempt no longer holds the run.

    The run's ``available_at`` becomes when it may run next (database clock): now plus the
    backoff in whole seconds (SQS ChangeMessageVisibility takes whole seconds; the worker
    rounds, and asks only after this commits), less :data:`RETRY_DUE_TOLERANCE_SECONDS`, so
    the run's own message, hidden for that long, never comes back before it. Any copy
    received earlier is an early copy (:func:`take_lease` answers NOT_DUE), whoever sent
    it: a replayed, validly signed copy of a retrying run waits for the backoff too.

    Args:
        backoff_seconds: Seconds until the next try, 0..43,200 (the verdict's delay: the
            backoff, a ``Retry(delay_seconds)``, a receiver's ``Retry-After``).
        detail: The handler's ``ctx.trail_detail``; ``backoff_seconds`` wins over its key.
        via_outbox: The next try comes as a fresh message: the run's outbox row is pending
            again, due after the delay (written again from the run and ``document`` if it
            was purged), in the same transaction; the caller then deletes the received
            message. For a delay the received message cannot stay hidden for (SQS's
            12-hour ceiling, a stale receipt handle).
        document: The received envelope as JSON text; required with ``via_outbox``.
    """
    merged = {**(detail or {}), "backoff_seconds": round(backoff_seconds, 3)}
    if via_outbox:
        merged["via"] = "outbox"
    params = _params(attempt, failure, merged)
    params["backoff"] = max(math.floor(backoff_seconds) - RETRY_DUE_TOLERANCE_SECONDS, 0.0)
    if connection.execute(_RETRY, params).first() is None:
        return False
    if via_outbox:
        assert document is not None, "a retry through the outbox needs the received envelope"
        pend_for_retry(connection, attempt.run_id, delay_seconds=backoff_seconds, document=document)
    return True


def pend_for_retry(connection: Connection, run_id: uuid.UUID, *, delay_seconds: float, document: str) -> None:
    """The run's outbox row pending again, due after ``delay_seconds`` (the next try comes as a
    fresh message); written again from the run and ``document`` (the received envelope, JSON
    text) when ``maintenance.purge`` removed it. Part of ``running → retrying`` through the
    outbox (:func:`mark_retrying`), or right after it when hiding the received message was
    refused (a stale receipt handle)."""
    params = {"run_id": run_id, "delay": delay_seconds, "document": document}
    if not any(connection.execute(_RETRY_ROW[table], params).first() for table in columns.OUTBOX_TABLES):
        for table in columns.OUTBOX_TABLES:  # purged (sent long ago): from the run and the envelope
            connection.execute(_RETRY_REINSERT[table], params)


def mark_failed(
    connection: Connection,
    attempt: Attempt,
    failure: Failure,
    *,
    reason: str,
    detail: dict[str, Any] | None = None,
) -> bool:
    """``running → failed`` (the permanent path); False when the attempt lost the run.

    Args:
        detail: The handler's ``ctx.trail_detail``; ``reason`` wins over its key.
    """
    merged = {**(detail or {}), "reason": reason}
    return connection.execute(_FAIL, _params(attempt, failure, merged)).first() is not None


def mark_requeued(connection: Connection, attempt: Attempt, *, reason: str) -> bool:
    """``running → queued`` (message returned on shutdown)."""
    return connection.execute(_REQUEUE, _params(attempt, None, {"reason": reason})).first() is not None


_DEAD_LETTERED = text(
    f"""
WITH marked AS (
    UPDATE task_runs SET dead_lettered_at = clock_timestamp(), updated_at = clock_timestamp()
    WHERE run_id = :run_id AND status = 'failed' AND dead_lettered_at IS NULL RETURNING run_id
)
{
        columns.trail_insert(
            dict(
                run_id="run_id",
                status="'failed'",
                receive_count=":receive_count",
                worker_id=":worker",
                detail="jsonb_build_object('dead_lettered', true, 'dlq', CAST(:dlq AS text))",
            ),
            source="marked",
        )
    }
"""
).bindparams(bindparam("run_id", type_=UUID(as_uuid=True)))


def mark_dead_lettered(
    connection: Connection, run_id: uuid.UUID, *, receive_count: int, worker_id: str, dlq: str
) -> None:
    """Record that the run's message is in the DLQ (completes the permanent path)."""
    connection.execute(
        _DEAD_LETTERED, {"run_id": run_id, "receive_count": receive_count, "worker": worker_id, "dlq": dlq}
    )


_OUTBOX_PENDING = text(
    """
SELECT EXISTS (SELECT 1 FROM outbox_messages WHERE run_id = :run_id AND sent_at IS NULL)
    OR EXISTS (SELECT 1 FROM platform_outbox_messages WHERE run_id = :run_id AND sent_at IS NULL)
"""
).bindparams(bindparam("run_id", type_=UUID(as_uuid=True)))


def outbox_pending(connection: Connection, run_id: uuid.UUID) -> bool:
    """Whether the run's outbox row is still pending (the relay has not sent it yet, as far
    as committed data says: a relay sending it right now has not committed ``sent_at``)."""
    return bool(connection.execute(_OUTBOX_PENDING, {"run_id": run_id}).scalar())


_STATUS = text("SELECT status FROM task_runs WHERE run_id = :run_id").bindparams(
    bindparam("run_id", type_=UUID(as_uuid=True))
)


def current_status(connection: Connection, run_id: uuid.UUID) -> str | None:
    """The run's status now, or None if it does not exist."""
    value = connection.execute(_STATUS, {"run_id": run_id}).scalar()
    return None if value is None else str(value)


_RENEW = text(
    """
UPDATE task_runs AS t
SET lease_expires_at = clock_timestamp() + make_interval(secs => :lease_seconds)
FROM unnest(CAST(:run_ids AS uuid[]), CAST(:attempts AS integer[])) AS held(run_id, attempt)
WHERE t.run_id = held.run_id AND t.attempts = held.attempt AND t.status = 'running'
RETURNING t.run_id
"""
).bindparams(
    bindparam("run_ids", type_=ARRAY(UUID(as_uuid=True))),
    bindparam("attempts", type_=ARRAY(Integer)),
    bindparam("lease_seconds", type_=Float),
)


def renew_leases(
    connection: Connection, held: Sequence[tuple[uuid.UUID, int]], *, lease_seconds: float
) -> set[uuid.UUID]:
    """Extend the leases of ``(run_id, attempt)`` pairs; return the runs still held."""
    if not held:
        return set()
    rows = connection.execute(
        _RENEW,
        {"run_ids": [r for r, _ in held], "attempts": [a for _, a in held], "lease_seconds": lease_seconds},
    )
    return {row[0] for row in rows}


def now(connection: Connection) -> dt.datetime:
    """The database clock."""
    value: dt.datetime = connection.execute(text("SELECT clock_timestamp()")).scalar_one()
    return value
