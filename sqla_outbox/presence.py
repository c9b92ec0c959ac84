"""Worker presence: which running worker implements which tasks, with a heartbeat.

During a rolling deploy, workers running old code lack the handlers of tasks only the new
code has. Each worker records, in ``worker_presence``, the tasks it implements and the
queues it consumes: at start, every :data:`PRESENCE_INTERVAL_SECONDS`, and it removes its
row at a clean stop. A row whose heartbeat is older than :data:`PRESENCE_TTL_SECONDS` is
a worker that died (``kill -9``, lost host): it no longer counts, and it is deleted by the
next worker that starts once it is :data:`FORGET_AFTER_SECONDS` old.

Readers:

* the relay (:mod:`sqla_outbox.relay.hold`) keeps a due outbox row pending, instead of
  sending it, while no live worker implements its task on its queue: nothing cycles
  through SQS, no receive is spent, nothing reaches a DLQ;
* ``python -m sqla_outbox status`` lists the live workers and the tasks waiting for one,
  with how long they have waited.

While no worker has ever registered (no live row at all: a deployment whose workers
predate presence, or every worker stopped), nothing is held: the relay sends as before
and messages wait in SQS.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
from collections.abc import Iterable

from sqlalchemy import Float, Text, bindparam, text
from sqlalchemy.dialects.postgresql import ARRAY
from sqlalchemy.engine import Connection

PRESENCE_INTERVAL_SECONDS = 10.0
"""How often a worker renews its heartbeat."""

PRESENCE_TTL_SECONDS = 45.0
"""A worker whose heartbeat is older than this is not counted (four missed beats)."""

FORGET_AFTER_SECONDS = 3600.0
"""Rows of workers silent this long are deleted when a worker registers."""

_REGISTER = text(
    """
WITH gone AS (
    DELETE FROM worker_presence
    WHERE heartbeat_at < clock_timestamp() - make_interval(secs => :forget) AND worker_id <> :worker_id
)
INSERT INTO worker_presence (worker_id, tasks, queues)
VALUES (:worker_id, :tasks, :queues)
ON CONFLICT (worker_id) DO UPDATE
SET tasks = EXCLUDED.tasks, queues = EXCLUDED.queues, started_at = clock_timestamp(),
    heartbeat_at = clock_timestamp()
"""
).bindparams(
    bindparam("tasks", type_=ARRAY(Text)),
    bindparam("queues", type_=ARRAY(Text)),
    bindparam("forget", type_=Float),
)

_BEAT = text(
    """
INSERT INTO worker_presence (worker_id, tasks, queues)
VALUES (:worker_id, :tasks, :queues)
ON CONFLICT (worker_id) DO UPDATE SET heartbeat_at = clock_timestamp()
"""
).bindparams(bindparam("tasks", type_=ARRAY(Text)), bindparam("queues", type_=ARRAY(Text)))

_UNREGISTER = text("DELETE FROM worker_presence WHERE worker_id = :worker_id")

_LIVE = text(
    """
SELECT worker_id, tasks, queues, started_at,
       EXTRACT(EPOCH FROM clock_timestamp() - heartbeat_at)::float8 AS beat_age
FROM worker_presence
WHERE heartbeat_at >= clock_timestamp() - make_interval(secs => :ttl)
ORDER BY worker_id
"""
).bindparams(bindparam("ttl", type_=Float))

# Due pending rows per task and queue, with the time the oldest run became due (its
# task_runs.available_at, which holds and deferrals never move).
_PENDING_BY_TASK = text(
    """
SELECT pending.task, pending.queue, count(*) AS pending,
       EXTRACT(EPOCH FROM clock_timestamp() - min(r.available_at))::float8 AS waited
FROM (
    SELECT run_id, envelope->>'task' AS task, queue FROM outbox_messages WHERE sent_at IS NULL
    UNION ALL
    SELECT run_id, envelope->>'task', queue FROM platform_outbox_messages WHERE sent_at IS NULL
) AS pending
JOIN task_runs AS r ON r.run_id = pending.run_id
WHERE r.available_at <= clock_timestamp()
GROUP BY pending.task, pending.queue
ORDER BY pending.task, pending.queue
"""
)


def register(connection: Connection, *, worker_id: str, tasks: Iterable[str], queues: Iterable[str]) -> None:
    """Record a starting worker (replacing an earlier row with the same id) and delete rows
    silent for :data:`FORGET_AFTER_SECONDS`. The caller commits."""
    connection.execute(
        _REGISTER,
        {
            "worker_id": worker_id,
            "tasks": sorted(set(tasks)),
            "queues": sorted(set(queues)),
            "forget": FORGET_AFTER_SECONDS,
        },
    )


def beat(connection: Connection, *, worker_id: str, tasks: Iterable[str], queues: Iterable[str]) -> None:
    """Renew the heartbeat (re-creating the row if someone deleted it). The caller commits."""
    connection.execute(
        _BEAT, {"worker_id": worker_id, "tasks": sorted(set(tasks)), "queues": sorted(set(queues))}
    )


def unregister(connection: Connection, *, worker_id: str) -> None:
    """Remove a stopping worker's row. The caller commits."""
    connection.execute(_UNREGISTER, {"worker_id": worker_id})


@dataclasses.dataclass(frozen=True)
class LiveWorker:
    """A worker whose heartbeat is recent.

    Attributes:
        worker_id: Its id. tasks / queues: What it implements and consumes.
        started_at: When it registered. heartbeat_age_seconds: Since its last heartbeat.
    """

    worker_id: str
    tasks: tuple[str, ...]
    queues: tuple[str, ...]
    started_at: dt.datetime
    heartbeat_age_seconds: float


def live_workers(connection: Connection, *, ttl_seconds: float = PRESENCE_TTL_SECONDS) -> list[LiveWorker]:
    """Workers whose heartbeat is at most ``ttl_seconds`` old (database clock), by id."""
    return [
        LiveWorker(r.worker_id, tuple(r.tasks), tuple(r.queues), r.started_at, float(r.beat_age))
        for r in connection.execute(_LIVE, {"ttl": ttl_seconds})
    ]


@dataclasses.dataclass(frozen=True)
class Coverage:
    """Which (task, queue) pairs live workers can run.

    Attributes:
        pairs: ``(task, queue)`` for every task a live worker implements on every queue
            it consumes.
        workers: How many live workers there are (0: nothing is known; see :meth:`serves`).
    """

    pairs: frozenset[tuple[str, str]]
    workers: int

    @classmethod
    def of(cls, workers: Iterable[LiveWorker]) -> Coverage:
        listed = list(workers)
        pairs = frozenset((task, queue) for w in listed for task in w.tasks for queue in w.queues)
        return cls(pairs, len(listed))

    def serves(self, task: str, queue: str) -> bool:
        """Whether a live worker implements ``task`` and consumes ``queue``; True when no
        worker is registered at all (presence unknown: hold nothing)."""
        return self.workers == 0 or (task, queue) in self.pairs


@dataclasses.dataclass(frozen=True)
class WaitingTask:
    """Due pending runs of a task that no live worker implements on their queue.

    Attributes:
        task / queue: The task and the queue its runs go to.
        pending: Due outbox rows waiting.
        waited_seconds: Since the oldest of them became due.
    """

    task: str
    queue: str
    pending: int
    waited_seconds: float


def waiting_for_a_worker(connection: Connection, coverage: Coverage) -> list[WaitingTask]:
    """Due pending runs, per task and queue, that no live worker can run (empty while no
    worker is registered: then nothing is known)."""
    if coverage.workers == 0:
        return []
    return [
        WaitingTask(str(r.task), str(r.queue), int(r.pending), float(r.waited or 0.0))
        for r in connection.execute(_PENDING_BY_TASK)
        if not coverage.serves(str(r.task), str(r.queue))
    ]
