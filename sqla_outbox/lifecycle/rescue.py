"""The rescuer's statements: find unfinished runs without a live copy, and send them again.

The invariant (docs/lifecycle.md, "Every unfinished run has a live copy"): every run that is
``queued``, ``retrying`` or ``running`` has a pending outbox row, a live lease, or a
message SQS still holds within its visibility and retention. A run breaks it when its
message was lost to SQS's 12-hour ceiling, redriven to a DLQ while the run was not failed,
dropped after the queue's retention, or never received for another reason, and no worker
holds its lease. Such a run would stay unfinished forever (and a group it belongs to would
never complete).

:func:`candidates` finds, for each queue, the unfinished runs whose outbox row was sent and
that show no sign of life for longer than the queue's window: since the row was sent or the
run last changed (``queued``), since its next try was due (``retrying``), or since its lease
expired (``running``). :func:`rescue` sends them again through the outbox, in one statement
that re-checks each under a row lock: the outbox row pending and due now, a ``running`` run
with an expired lease back to ``queued`` (declared transition ``running → queued``, actor
relay), the trail row ``{"rescued": reason, "from": status}``. A copy that was only late,
not lost, then finds the run finished (or leased) and is acknowledged: the ledger makes the
duplicate harmless.

Which candidates are rescued (their queue's backlog, the live workers, the windows) is the
relay's decision (:mod:`sqla_outbox.relay.rescue`).
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import uuid
from collections.abc import Mapping, Sequence

from sqlalchemy import Float, Integer, Text, bindparam, text
from sqlalchemy.dialects.postgresql import ARRAY, UUID
from sqlalchemy.engine import Connection

from sqla_outbox.lifecycle import columns

_LAST_SEEN = """CASE r.status
        WHEN 'running' THEN COALESCE(r.lease_expires_at, r.updated_at)
        WHEN 'retrying' THEN GREATEST(r.available_at, r.updated_at, o.sent_at)
        ELSE GREATEST(o.sent_at, r.updated_at)
    END"""
"""When the run last showed a sign of life: its row sent or the run changed (queued), its
next try due (retrying), its lease ended (running)."""

_CANDIDATES = text(
    f"""
WITH windows AS (
    SELECT * FROM unnest(CAST(:queues AS text[]), CAST(:windows AS float8[])) AS w(queue, seconds)
)
SELECT r.run_id, r.task, r.queue, r.tenant_id, r.status, o.sent_at,
       EXTRACT(EPOCH FROM clock_timestamp() - {_LAST_SEEN})::float8 AS silent_seconds,
       o.sent_at < clock_timestamp() - make_interval(secs => :retention) AS past_retention
FROM task_runs AS r
JOIN windows AS w ON w.queue = r.queue
CROSS JOIN LATERAL (
    SELECT sent_at, parked_at FROM outbox_messages WHERE run_id = r.run_id
    UNION ALL
    SELECT sent_at, parked_at FROM platform_outbox_messages WHERE run_id = r.run_id
) AS o
WHERE r.status IN ('queued', 'retrying', 'running')
  AND o.sent_at IS NOT NULL AND o.parked_at IS NULL
  AND {_LAST_SEEN} < clock_timestamp() - make_interval(secs => w.seconds)
ORDER BY {_LAST_SEEN}
LIMIT :limit
"""
).bindparams(
    bindparam("queues", type_=ARRAY(Text)),
    bindparam("windows", type_=ARRAY(Float)),
    bindparam("retention", type_=Float),
    bindparam("limit", type_=Integer),
)

_RESCUE_TRAIL = columns.trail_insert(
    dict(
        run_id="t.run_id",
        status="CASE WHEN t.status = 'running' THEN 'queued' ELSE t.status END",
        attempt="t.attempts",
        worker_id=":by",
        detail="jsonb_build_object('rescued', i.reason, 'from', t.status)",
    ),
    source="target AS t JOIN input AS i USING (run_id) JOIN pended USING (run_id)",
)
_RESCUE = text(
    f"""
WITH input AS (
    SELECT * FROM unnest(CAST(:run_ids AS uuid[]), CAST(:reasons AS text[])) AS i(run_id, reason)
),
target AS (
    SELECT r.run_id, r.status, r.attempts FROM task_runs AS r JOIN input USING (run_id)
    WHERE r.status IN ('queued', 'retrying')
       OR (r.status = 'running' AND (r.lease_expires_at IS NULL OR r.lease_expires_at < clock_timestamp()))
    FOR UPDATE OF r
),
tenant_rows AS (
    UPDATE outbox_messages AS o SET sent_at = NULL, available_at = clock_timestamp()
    FROM target AS t WHERE o.run_id = t.run_id AND o.sent_at IS NOT NULL AND o.parked_at IS NULL
    RETURNING o.run_id
),
platform_rows AS (
    UPDATE platform_outbox_messages AS o SET sent_at = NULL, available_at = clock_timestamp()
    FROM target AS t WHERE o.run_id = t.run_id AND o.sent_at IS NOT NULL AND o.parked_at IS NULL
    RETURNING o.run_id
),
pended AS (SELECT run_id FROM tenant_rows UNION ALL SELECT run_id FROM platform_rows),
requeued AS (
    UPDATE task_runs AS r
    SET status = 'queued', lease_owner = NULL, lease_expires_at = NULL,
        available_at = clock_timestamp(), updated_at = clock_timestamp()
    FROM target AS t
    WHERE r.run_id = t.run_id AND t.status = 'running' AND r.run_id IN (SELECT run_id FROM pended)
    RETURNING r.run_id
),
touched AS (
    UPDATE task_runs AS r
    SET available_at = LEAST(r.available_at, clock_timestamp()), updated_at = clock_timestamp()
    FROM target AS t
    WHERE r.run_id = t.run_id AND t.status IN ('queued', 'retrying')
      AND r.run_id IN (SELECT run_id FROM pended)
    RETURNING r.run_id
),
trail AS (
    {_RESCUE_TRAIL}
)
SELECT run_id FROM pended
"""
).bindparams(
    bindparam("run_ids", type_=ARRAY(UUID(as_uuid=True))),
    bindparam("reasons", type_=ARRAY(Text)),
    bindparam("by", type_=Text),
)

_RESCUED_SINCE = text(
    """
SELECT count(*) FROM task_run_trail
WHERE detail ? 'rescued' AND at >= clock_timestamp() - make_interval(secs => :seconds)
"""
).bindparams(bindparam("seconds", type_=Float))


@dataclasses.dataclass(frozen=True)
class Candidate:
    """An unfinished run whose sent message shows no sign of life past its queue's window.

    Attributes:
        run_id / task / queue / tenant_id / status: The run.
        sent_at: When the relay last sent its row.
        silent_seconds: Since its last sign of life (see the module docstring).
        past_retention: Its message was sent longer ago than the queue's retention: SQS
            has dropped it, if nobody received it.
    """

    run_id: uuid.UUID
    task: str
    queue: str
    tenant_id: int | None
    status: str
    sent_at: dt.datetime
    silent_seconds: float
    past_retention: bool


def candidates(
    connection: Connection, *, windows: Mapping[str, float], retention_seconds: float, limit: int = 1000
) -> list[Candidate]:
    """Unfinished runs of ``windows``' queues silent for longer than their queue's window.

    Args:
        connection: Any connection (a read).
        windows: Queue → window, seconds (a queue not listed is not looked at).
        retention_seconds: The queues' message retention (``sqs_message_retention_seconds``).
        limit: Most candidates, the longest silent first.
    """
    if not windows:
        return []
    rows = connection.execute(
        _CANDIDATES,
        {
            "queues": list(windows),
            "windows": [float(seconds) for seconds in windows.values()],
            "retention": float(retention_seconds),
            "limit": limit,
        },
    )
    return [
        Candidate(
            run_id=r.run_id,
            task=r.task,
            queue=r.queue,
            tenant_id=r.tenant_id,
            status=r.status,
            sent_at=r.sent_at,
            silent_seconds=float(r.silent_seconds),
            past_retention=bool(r.past_retention),
        )
        for r in rows
    ]


def rescue(connection: Connection, runs: Sequence[tuple[uuid.UUID, str]], *, by: str) -> set[uuid.UUID]:
    """Send runs again through the outbox (see the module docstring), re-checking each.

    Args:
        connection: Inside the caller's transaction.
        runs: ``(run_id, reason)``; ``reason`` goes into the trail (``past-retention``,
            ``no-live-copy``, ``operator``, ``in-dlq``).
        by: Who rescues (the relay's name, or the operator), the trail's ``worker_id``.

    Returns:
        The runs whose outbox row is pending again (a run that finished, or whose lease a
        worker took, since it was found is left alone).
    """
    if not runs:
        return set()
    rows = connection.execute(
        _RESCUE, {"run_ids": [r for r, _ in runs], "reasons": [why for _, why in runs], "by": by}
    )
    return {row[0] for row in rows}


def rescued_since(connection: Connection, seconds: float) -> int:
    """Runs rescued in the last ``seconds`` (trail rows with ``detail.rescued``)."""
    return int(connection.execute(_RESCUED_SINCE, {"seconds": seconds}).scalar_one())
