"""Retention: the purge's statements that delete finished runs and sent outbox rows.

Batched and skip-locked (``DELETE ... USING (SELECT ... ORDER BY <time> LIMIT :limit FOR
UPDATE SKIP LOCKED)``; PostgreSQL "The Locking Clause"), so the purge never waits for a row
the relay is claiming or a run a worker is updating. :mod:`sqla_outbox.maintenance` runs
them batch after batch; what is kept and why is said beside each statement.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import DateTime, Integer, bindparam, text

from sqla_outbox.types import UNFINISHED_STATUSES

_UNFINISHED = ", ".join(f"'{s}'" for s in UNFINISHED_STATUSES)
_TIMESTAMPTZ = DateTime(timezone=True)


# A sent row whose run is unfinished is still needed: the worker compares each received
# envelope with it (``envelope-mismatch``), and it is the only copy of the payload for a
# re-send (`outbox resend`) if SQS lost or expired the message.
_SENT_FILTER = f"""
    o.sent_at < :cutoff
    AND NOT EXISTS (SELECT 1 FROM task_runs r WHERE r.run_id = o.run_id AND r.status IN ({_UNFINISHED}))
"""


def sent_rows(table: str) -> tuple[Any, Any]:
    """``(delete, count)`` statements for sent rows of ``table`` (an outbox table) older than
    ``:cutoff`` whose run is finished; the delete takes ``:limit`` rows per call."""
    delete = text(
        f"""
WITH doomed AS (
    SELECT o.id FROM {table} AS o
    WHERE {_SENT_FILTER}
    ORDER BY o.sent_at
    LIMIT :limit
    FOR UPDATE OF o SKIP LOCKED
),
gone AS (
    DELETE FROM {table} AS t USING doomed WHERE t.id = doomed.id RETURNING 1
)
SELECT (SELECT count(*) FROM gone) AS deleted, 0 AS trail_rows
"""
    ).bindparams(bindparam("cutoff", type_=_TIMESTAMPTZ), bindparam("limit", type_=Integer))
    count = text(
        f"SELECT count(*) AS deleted, 0 AS trail_rows FROM {table} AS o WHERE {_SENT_FILTER}"
    ).bindparams(bindparam("cutoff", type_=_TIMESTAMPTZ))
    return delete, count


# A finished run whose outbox row is pending again (requeued) is not finished any more
# by the time anyone reads it; the NOT EXISTS guards keep the purge from racing that. A
# parked row (sent_at NULL, parked_at set) is not pending: its failed run is purged with
# it (the row cannot be put back without its run).
_RUN_FILTER = """
    r.status = '{status}' AND r.finished_at < :cutoff
    AND NOT EXISTS (SELECT 1 FROM outbox_messages o
                    WHERE o.run_id = r.run_id AND o.sent_at IS NULL AND o.parked_at IS NULL)
    AND NOT EXISTS (SELECT 1 FROM platform_outbox_messages p
                    WHERE p.run_id = r.run_id AND p.sent_at IS NULL AND p.parked_at IS NULL)
"""


def finished_runs(status: str) -> tuple[Any, Any]:
    """``(delete, count)`` statements for runs in the finished ``status`` whose
    ``finished_at`` is older than ``:cutoff`` (their trail rows go by cascade, their parked
    rows with them); the delete takes ``:limit`` runs per call."""
    # the status is a literal so the planner can use task_runs_finished_idx (partial
    # index WHERE status IN ('succeeded', 'failed', 'cancelled'))
    where = _RUN_FILTER.format(status=status)
    delete = text(
        f"""
WITH doomed AS (
    SELECT r.run_id FROM task_runs AS r
    WHERE {where}
    ORDER BY r.finished_at
    LIMIT :limit
    FOR UPDATE SKIP LOCKED
),
gone AS (
    DELETE FROM task_runs AS t USING doomed WHERE t.run_id = doomed.run_id RETURNING t.run_id
),
parked AS (
    DELETE FROM outbox_messages AS o USING gone WHERE o.run_id = gone.run_id AND o.parked_at IS NOT NULL
),
parked_platform AS (
    DELETE FROM platform_outbox_messages AS p USING gone
    WHERE p.run_id = gone.run_id AND p.parked_at IS NOT NULL
)
SELECT (SELECT count(*) FROM gone) AS deleted,
       (SELECT count(*) FROM task_run_trail WHERE run_id IN (SELECT run_id FROM gone)) AS trail_rows
"""
    ).bindparams(bindparam("cutoff", type_=_TIMESTAMPTZ), bindparam("limit", type_=Integer))
    count = text(
        f"""
SELECT count(*) AS deleted,
       COALESCE(sum((SELECT count(*) FROM task_run_trail tr WHERE tr.run_id = r.run_id)), 0) AS trail_rows
FROM task_runs AS r WHERE {where}
"""
    ).bindparams(bindparam("cutoff", type_=_TIMESTAMPTZ))
    return delete, count
