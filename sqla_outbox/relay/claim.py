"""The relay's SQL: claim due rows with SKIP LOCKED, mark them sent or failed, find what is next.

Every statement names its table explicitly (``outbox_messages`` or
``platform_outbox_messages``); both have the same shape. Claims and marks run in one
transaction on the relay's connection: a row is marked sent only in the transaction that
claimed it, after SQS accepted its message, and row locks last until that transaction
ends (PostgreSQL "SELECT ... FOR UPDATE SKIP LOCKED" semantics).
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

from sqlalchemy import BigInteger, Float, Text, bindparam, text
from sqlalchemy.dialects.postgresql import ARRAY
from sqlalchemy.engine import Connection

from sqla_outbox import backoff
from sqla_outbox.relay.partitions import ALL, PLATFORM_FILTER, TENANT_FILTER, filter_for

TABLES = ("outbox_messages", "platform_outbox_messages")


@dataclasses.dataclass(frozen=True)
class ClaimedRow:
    """One claimed outbox row.

    Attributes:
        table: ``outbox_messages`` or ``platform_outbox_messages``.
        id: Row id. run_id / queue / tenant_id / envelope: Row values.
        attempts: Failed send attempts so far.
        available_at: When it became due.
        priority: 1..10, lower first (sqlaob_0007).
    """

    table: str
    id: int
    run_id: uuid.UUID
    queue: str
    tenant_id: int | None
    envelope: dict[str, Any]
    attempts: int
    available_at: dt.datetime
    priority: int = 3


def _claim_sql(table: str) -> Any:
    tenant = "tenant_id" if table == "outbox_messages" else "NULL::bigint AS tenant_id"
    return text(
        f"""
SELECT id, run_id, queue, {tenant}, envelope, attempts, available_at, priority
FROM {table}
WHERE sent_at IS NULL AND parked_at IS NULL AND available_at <= clock_timestamp()
  AND {filter_for(table)}
ORDER BY available_at, id
LIMIT :limit
FOR UPDATE SKIP LOCKED
"""
    )


_CLAIM = {table: _claim_sql(table) for table in TABLES}
_MARK_SENT = {
    table: text(f"UPDATE {table} SET sent_at = clock_timestamp() WHERE id = ANY(:ids)").bindparams(
        bindparam("ids", type_=ARRAY(BigInteger))
    )
    for table in TABLES
}
_MAX_ATTEMPTS_COUNT = 2**31 - 2
"""``attempts`` is an ``integer``: it stops counting here rather than overflow."""

_MARK_FAILED = {
    table: text(
        f"""
UPDATE {table} AS o
SET attempts = LEAST(o.attempts, {_MAX_ATTEMPTS_COUNT}) + 1,
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
_PARK = {
    table: text(
        f"""
WITH input AS (
    SELECT * FROM unnest(CAST(:ids AS bigint[]), CAST(:codes AS text[]), CAST(:messages AS text[]))
        AS f(id, code, message)
),
parked AS (
    UPDATE {table} AS o
    SET parked_at = clock_timestamp(), attempts = LEAST(o.attempts, {_MAX_ATTEMPTS_COUNT}) + 1,
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
    INSERT INTO task_run_trail (run_id, status, attempt, worker_id, error_type, error_message, detail)
    SELECT run_id, 'failed', attempts, :relay, code, message,
           jsonb_build_object('reason', 'send-refused', 'parked', true, 'send_attempts', send_attempts)
    FROM failed
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
_NEXT_DUE = text(
    f"""
SELECT EXTRACT(EPOCH FROM (min(available_at) - clock_timestamp()))::float8 FROM (
    (SELECT available_at FROM outbox_messages WHERE sent_at IS NULL AND parked_at IS NULL
       AND {TENANT_FILTER}
     ORDER BY available_at LIMIT 1)
    UNION ALL
    (SELECT available_at FROM platform_outbox_messages WHERE sent_at IS NULL AND parked_at IS NULL
       AND {PLATFORM_FILTER}
     ORDER BY available_at LIMIT 1)
) AS pending
"""
)
_PENDING_STATS = text(
    """
SELECT 'outbox_messages' AS tbl, queue, count(*) AS pending,
       COALESCE(EXTRACT(EPOCH FROM clock_timestamp()
           - min(available_at) FILTER (WHERE available_at <= clock_timestamp())), 0)::float8 AS lag
FROM outbox_messages WHERE sent_at IS NULL AND parked_at IS NULL GROUP BY queue
UNION ALL
SELECT 'platform_outbox_messages', queue, count(*),
       COALESCE(EXTRACT(EPOCH FROM clock_timestamp()
           - min(available_at) FILTER (WHERE available_at <= clock_timestamp())), 0)::float8
FROM platform_outbox_messages WHERE sent_at IS NULL AND parked_at IS NULL GROUP BY queue
"""
)


def claim(
    connection: Connection, table: str, *, limit: int, partitions: Mapping[str, Any] = ALL
) -> list[ClaimedRow]:
    """Lock up to ``limit`` due, unsent rows of ``table``, oldest ``available_at`` first.

    Args:
        connection: The relay's connection, inside the pass's transaction.
        table: One of :data:`TABLES`.
        limit: Most rows to claim (``relay_batch_size``).
        partitions: The owned partitions (:meth:`~sqla_outbox.relay.partitions.Ownership.params`);
            default every row.

    Returns:
        The claimed rows, in ``available_at, id`` order; rows locked by another
        transaction are skipped, never waited for.
    """
    rows = connection.execute(
        _CLAIM[table], {"limit": limit, **partitions}
    ).all()  # one fetchall, not fetchone per row
    return [
        ClaimedRow(
            table=table,
            id=r.id,
            run_id=r.run_id,
            queue=r.queue,
            tenant_id=r.tenant_id,
            envelope=r.envelope,
            attempts=r.attempts,
            available_at=r.available_at,
            priority=r.priority,
        )
        for r in rows
    ]


def mark_sent(connection: Connection, table: str, ids: Sequence[int]) -> None:
    """Set ``sent_at`` on rows SQS accepted (same transaction as the claim)."""
    if ids:
        connection.execute(_MARK_SENT[table], {"ids": list(ids)})


def mark_failed(
    connection: Connection,
    table: str,
    failures: Sequence[tuple[ClaimedRow, str]],
    *,
    base_seconds: float,
    max_seconds: float,
) -> None:
    """Count a failed send, record its error and push ``available_at`` forward.

    The delay is :func:`sqla_outbox.backoff.exponential_seconds` of the row's
    ``attempts`` before this failure (1 s, 2 s, 4 s, ... capped at 300 s by default),
    computed here with the exponent capped, so no failure streak can overflow it; one bad
    row never holds up the rows behind it.

    Args:
        connection: The relay's connection, in the pass's transaction.
        table: One of :data:`TABLES`.
        failures: ``(row, error)`` with ``error`` the text stored in ``last_error``
            (``<code>: <message>``, already safe for PostgreSQL).
        base_seconds / max_seconds: ``relay_backoff_base_seconds`` / ``_max_seconds``.
    """
    if failures:
        connection.execute(
            _MARK_FAILED[table],
            {
                "ids": [row.id for row, _ in failures],
                "delays": [
                    backoff.exponential_seconds(row.attempts, base=base_seconds, cap=max_seconds)
                    for row, _ in failures
                ],
                "errors": [error for _, error in failures],
            },
        )


def park(
    connection: Connection, table: str, refusals: Sequence[tuple[ClaimedRow, str, str]], *, relay: str
) -> set[uuid.UUID]:
    """Park rows SQS refused for good; fail their runs with the SQS error.

    A parked row keeps ``sent_at`` NULL and gets ``parked_at``: the relay never claims it
    again, and ``python -m sqla_outbox outbox unpark`` puts it back. Its run, if still
    ``queued``, becomes ``failed`` with ``last_error_type`` the SQS error code and
    ``last_error`` its message, and a trail row (detail ``{"reason": "send-refused",
    "parked": true, "send_attempts": n}``). All in the caller's transaction.

    Args:
        refusals: ``(row, code, message)``; code and message already safe for PostgreSQL.
        relay: Recorded as the trail row's ``worker_id``.

    Returns:
        The run ids of the rows parked.
    """
    if not refusals:
        return set()
    rows = connection.execute(
        _PARK[table],
        {
            "ids": [row.id for row, _, _ in refusals],
            "codes": [code for _, code, _ in refusals],
            "messages": [message for _, _, message in refusals],
            "relay": relay,
        },
    )
    return {row[0] for row in rows}


def seconds_until_next_due(connection: Connection, partitions: Mapping[str, Any] = ALL) -> float | None:
    """Seconds (database clock) until the earliest unsent row of the owned ``partitions``
    (default: any) is due; <= 0 if one is due now; None when nothing is pending."""
    value = connection.execute(_NEXT_DUE, dict(partitions)).scalar()
    return None if value is None else float(value)


@dataclasses.dataclass(frozen=True)
class PendingStat:
    """Unsent rows of one table and queue, and how late the oldest due one is (seconds)."""

    table: str
    queue: str
    pending: int
    oldest_due_age_seconds: float


def pending_stats(connection: Connection) -> list[PendingStat]:
    """Pending rows per table and queue (for gauges and ``python -m sqla_outbox status``)."""
    return [
        PendingStat(r.tbl, r.queue, int(r.pending), float(r.lag)) for r in connection.execute(_PENDING_STATS)
    ]


_OLDEST_DUE = text(
    """
SELECT tenant_id, EXTRACT(EPOCH FROM clock_timestamp() - min(available_at))::float8 AS wait
FROM outbox_messages
WHERE sent_at IS NULL AND parked_at IS NULL AND available_at <= clock_timestamp()
  AND tenant_id = ANY(CAST(:tenants AS bigint[]))
GROUP BY tenant_id
"""
).bindparams(bindparam("tenants", type_=ARRAY(BigInteger)))


def oldest_due_ages(connection: Connection, tenants: Sequence[int]) -> dict[int, float]:
    """Seconds the oldest due row of each of ``tenants`` has waited (tenants with none
    are absent)."""
    return {
        int(r.tenant_id): float(r.wait) for r in connection.execute(_OLDEST_DUE, {"tenants": list(tenants)})
    }
