"""The relay's SQL: claim due rows with SKIP LOCKED, find what is next.

Marking rows sent, failed or parked is a change of the row after its creation, so its
statements live in :mod:`sqla_outbox.lifecycle.sending`; the functions here adapt the
claimed rows to them.

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

from sqlalchemy import BigInteger, bindparam, text
from sqlalchemy.dialects.postgresql import ARRAY
from sqlalchemy.engine import Connection

from sqla_outbox.lifecycle import sending
from sqla_outbox.relay.partitions import ALL, PLATFORM_FILTER, TENANT_FILTER, filter_for

TABLES = sending.TABLES


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
    """Set ``sent_at`` on rows SQS accepted (:func:`sqla_outbox.lifecycle.sending.mark_sent`)."""
    sending.mark_sent(connection, table, ids)


def mark_failed(
    connection: Connection,
    table: str,
    failures: Sequence[tuple[ClaimedRow, str]],
    *,
    base_seconds: float,
    max_seconds: float,
) -> None:
    """Count a failed send of each ``(row, error)``, record its error and push the row's
    ``available_at`` forward (:func:`sqla_outbox.lifecycle.sending.mark_send_failed`)."""
    sending.mark_send_failed(
        connection,
        table,
        [(row.id, row.attempts, error) for row, error in failures],
        base_seconds=base_seconds,
        max_seconds=max_seconds,
    )


def park(
    connection: Connection, table: str, refusals: Sequence[tuple[ClaimedRow, str, str]], *, relay: str
) -> set[uuid.UUID]:
    """Park rows SQS refused for good and fail their runs
    (:func:`sqla_outbox.lifecycle.sending.park`); returns the run ids parked."""
    return sending.park(
        connection, table, [(row.id, code, message) for row, code, message in refusals], relay=relay
    )


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
