"""The relay's statements on outbox rows: sent, failed to send, parked, held, released.

Each runs in the relay's claiming transaction, on rows it locked with ``FOR UPDATE SKIP
LOCKED`` (:mod:`sqla_outbox.relay.claim`), so a row is marked sent only in the
transaction that claimed it, after SQS accepted its message (PostgreSQL "SELECT ... FOR
UPDATE SKIP LOCKED" semantics). Every statement names its table (``outbox_messages`` or
``platform_outbox_messages``; the same shape).

* :func:`mark_sent`: SQS accepted the message; ``sent_at`` is set.
* :func:`mark_send_failed`: SQS failed the entry (throttling, a transient error):
  ``attempts + 1``, the error in ``last_error``, ``available_at`` pushed by
  :func:`sqla_outbox.lifecycle.retry.send_delay`, so one bad row never holds up the rows
  behind it.
* :func:`park`: SQS refused the message for good; the row is parked (``parked_at``) and
  its ``queued`` run becomes ``failed`` with the SQS error (declared transition
  ``queued → failed``).
* :func:`hold`: a claimed row is not sent now (no live worker implements its task, or a
  pause covers it): ``available_at`` moves forward, nothing else changes (``attempts``
  counts failed sends; this is not one; the run stays ``queued``).
* :func:`release_statement`: rows held back become due now (a worker that implements
  their task registered; a pause ended).
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from typing import Any

from sqlalchemy import BigInteger, Float, Text, bindparam, text
from sqlalchemy.dialects.postgresql import ARRAY
from sqlalchemy.engine import Connection

from sqla_outbox.lifecycle import columns, retry

TABLES = columns.OUTBOX_TABLES

MAX_ATTEMPTS_COUNT = 2**31 - 2
"""``outbox.attempts`` is an ``integer``: it stops counting here rather than overflow."""

_MARK_SENT = {
    table: text(f"UPDATE {table} SET sent_at = clock_timestamp() WHERE id = ANY(:ids)").bindparams(
        bindparam("ids", type_=ARRAY(BigInteger))
    )
    for table in TABLES
}
_MARK_SENT_BY_RUN = {
    table: text(f"UPDATE {table} SET sent_at = clock_timestamp() WHERE run_id = :run_id AND sent_at IS NULL")
    for table in TABLES
}
_MARK_FAILED = {
    table: text(
        f"""
UPDATE {table} AS o
SET attempts = LEAST(o.attempts, {MAX_ATTEMPTS_COUNT}) + 1,
    available_at = clock_timestamp() + make_interval(secs => f.delay),
    last_error = f.error
FROM unnest(CAST(:ids AS bigint[]), CAST(:delays AS float8[]), CAST(:errors AS text[]))
     AS f(id, delay, error)
WHERE o.id = f.id AND o.sent_at IS NULL
"""
    ).bindparams(
        bindparam("ids", type_=ARRAY(BigInteger)),
        bindparam("delays", type_=ARRAY(Float)),
        bindparam("errors", type_=ARRAY(Text)),
    )
    for table in TABLES
}
_PARK_TRAIL = columns.trail_insert(
    dict(
        run_id="run_id",
        status="'failed'",
        attempt="attempts",
        worker_id=":relay",
        error_type="code",
        error_message="message",
        detail="jsonb_build_object('reason', 'send-refused', 'parked', true, 'send_attempts', send_attempts)",
    ),
    source="failed",
)
_PARK = {
    table: text(
        f"""
WITH input AS (
    SELECT * FROM unnest(CAST(:ids AS bigint[]), CAST(:codes AS text[]), CAST(:messages AS text[]))
        AS f(id, code, message)
),
parked AS (
    UPDATE {table} AS o
    SET parked_at = clock_timestamp(), attempts = LEAST(o.attempts, {MAX_ATTEMPTS_COUNT}) + 1,
        last_error = i.code || ': ' || i.message
    FROM input AS i
    WHERE o.id = i.id AND o.sent_at IS NULL AND o.parked_at IS NULL
    RETURNING o.run_id, o.attempts, i.code, i.message
),
failed AS (
    UPDATE task_runs AS r
    SET status = 'failed', finished_at = clock_timestamp(), updated_at = clock_timestamp(),
        last_error_type = p.code, last_error = p.message, lease_owner = NULL, lease_expires_at = NULL
    FROM parked AS p
    WHERE r.run_id = p.run_id AND r.status = 'queued'
    RETURNING r.run_id, r.attempts, p.code, p.message, p.attempts AS send_attempts
),
trail AS (
    {_PARK_TRAIL}
)
SELECT run_id FROM parked
"""
    ).bindparams(
        bindparam("ids", type_=ARRAY(BigInteger)),
        bindparam("codes", type_=ARRAY(Text)),
        bindparam("messages", type_=ARRAY(Text)),
    )
    for table in TABLES
}


def mark_sent(connection: Connection, table: str, ids: Sequence[int]) -> None:
    """Set ``sent_at`` on rows SQS accepted (same transaction as the claim).

    Args:
        ids: Outbox row ids of ``table``.
    """
    if ids:
        connection.execute(_MARK_SENT[table], {"ids": list(ids)})


def mark_sent_by_run(connection: Connection, table: str, run_id: uuid.UUID) -> None:
    """Set ``sent_at`` on the run's pending row (the inline test runner: no SQS in between)."""
    connection.execute(_MARK_SENT_BY_RUN[table], {"run_id": run_id})


def mark_send_failed(
    connection: Connection,
    table: str,
    failures: Sequence[tuple[int, int, str]],
    *,
    base_seconds: float,
    max_seconds: float,
) -> None:
    """Count a failed send per row, record its error and push ``available_at`` forward.

    Args:
        connection: The relay's connection, in the pass's transaction.
        table: One of :data:`TABLES`.
        failures: ``(row id, failed sends before this one, error)``; ``error`` is the text
            stored in ``last_error`` (``<code>: <message>``, already safe for PostgreSQL).
        base_seconds / max_seconds: ``relay_backoff_base_seconds`` / ``_max_seconds``
            (:func:`~sqla_outbox.lifecycle.retry.send_delay`).
    """
    if failures:
        connection.execute(
            _MARK_FAILED[table],
            {
                "ids": [row_id for row_id, _, _ in failures],
                "delays": [
                    retry.send_delay(sent, base_seconds=base_seconds, max_seconds=max_seconds)
                    for _, sent, _ in failures
                ],
                "errors": [error for _, _, error in failures],
            },
        )


def park(
    connection: Connection, table: str, refusals: Sequence[tuple[int, str, str]], *, relay: str
) -> set[uuid.UUID]:
    """Park rows SQS refused for good; fail their runs with the SQS error.

    A parked row keeps ``sent_at`` NULL and gets ``parked_at``: the relay never claims it
    again, and ``python -m sqla_outbox outbox unpark`` puts it back. Its run, if still
    ``queued``, becomes ``failed`` with ``last_error_type`` the SQS error code and
    ``last_error`` its message, and a trail row (detail ``{"reason": "send-refused",
    "parked": true, "send_attempts": n}``). All in the caller's transaction.

    Args:
        refusals: ``(row id, code, message)``; code and message already safe for PostgreSQL.
        relay: Recorded as the trail row's ``worker_id``.

    Returns:
        The run ids of the rows parked.
    """
    if not refusals:
        return set()
    rows = connection.execute(
        _PARK[table],
        {
            "ids": [row_id for row_id, _, _ in refusals],
            "codes": [code for _, code, _ in refusals],
            "messages": [message for _, _, message in refusals],
            "relay": relay,
        },
    )
    return {row[0] for row in rows}


def hold_statement(table: str, *, until: str, unless: str = "true") -> Any:
    """``UPDATE`` moving the due time of the claimed rows ``:ids`` of ``table`` forward.

    Args:
        table: One of :data:`TABLES`.
        until: SQL for the new ``available_at`` (columns of the row ``o``; the caller's
            parameters, e.g. ``clock_timestamp() + make_interval(secs => :seconds)``).
        unless: A predicate on ``o`` the row must still meet to be held (the pause is
            re-checked in SQL: a row whose pause ended since the relay read the pauses is
            sent instead).

    Returns:
        A ``text()`` statement taking ``ids`` (``bigint[]``) and the caller's parameters,
        returning the ids it held.
    """
    sql = f"UPDATE {table} AS o SET available_at = {until}\nWHERE o.id = ANY(:ids) AND ({unless})"
    sql += " RETURNING o.id"
    return text(sql).bindparams(bindparam("ids", type_=ARRAY(BigInteger)))


def release_statement(table: str, *, which: str) -> Any:
    """``UPDATE`` making held rows of ``table`` due now: pending rows whose ``available_at``
    is ahead although their run is due (held for want of a worker, by a pause, deferred by
    a worker, or backing off after a failed send).

    Args:
        table: One of :data:`TABLES`.
        which: A predicate on the row ``o`` choosing them (the task/queue pairs a worker now
            serves, the task/tenant/queue a resume ended), with the caller's parameters.
    """
    return text(
        f"""
UPDATE {table} AS o SET available_at = clock_timestamp()
FROM task_runs AS r
WHERE r.run_id = o.run_id AND o.sent_at IS NULL AND o.parked_at IS NULL
  AND o.available_at > clock_timestamp() AND r.available_at <= clock_timestamp()
  AND ({which})
"""
    )
