"""Built-in maintenance: the ``maintenance.purge`` task and the purge it runs.

What is deleted (``docs/operations.md``, "Purge"):

* **sent outbox rows** of ``outbox_messages`` and ``platform_outbox_messages`` whose
  ``sent_at`` is older than ``purge_sent_after_days`` (default 7 days) **and whose run is
  finished**: a sent row of a ``queued``, ``running`` or ``retrying`` run is kept however
  old (the worker checks received envelopes against it, and it is the only copy of the
  payload if SQS loses or expires the message). Rows with ``sent_at IS NULL`` are pending
  and are never deleted, however old.
* **succeeded runs** whose ``finished_at`` is older than ``purge_succeeded_after_days``
  (default 7 days), and **failed runs** older than ``purge_failed_after_days`` (default
  30 days), each with its ``task_run_trail`` rows (foreign key ``ON DELETE CASCADE``).
  Runs that are ``queued``, ``running`` or ``retrying`` are never deleted, and neither is
  a finished run whose outbox row is pending again (a requeue in progress).
* **completed groups** (``task_groups``) whose last member finished longer ago than
  ``purge_succeeded_after_days`` and whose completion run is no longer unfinished (its
  handler reads the group). Groups still waiting for members are never deleted.

How (so it never blocks the relay or the worker):

* Cutoffs are computed once, on the database clock, when the purge starts; every batch
  uses the same ones, so a long purge has stable boundaries.
* Each batch is one statement in its own short transaction:
  ``DELETE ... WHERE id IN (SELECT ... ORDER BY <time> LIMIT :n FOR UPDATE SKIP LOCKED)``
  (PostgreSQL "The Locking Clause": SKIP LOCKED skips rows another transaction has
  locked instead of waiting). A row the relay is claiming, or a run a worker is
  updating, is simply left for the next purge.
* Batches of ``purge_batch_size`` rows repeat until a batch comes back short. A short
  batch can also mean rows were skipped because they were locked: they are deleted by
  the next run (the task is scheduled daily).
* ``SET LOCAL lock_timeout`` bounds any other lock wait (index pages, foreign keys) to a
  few seconds; past it the batch fails and the task's retry runs the purge again.

Settings: the task reads ``purge_*`` from :meth:`OutboxSettings.from_env
<sqla_outbox.config.OutboxSettings.from_env>` in the worker process (the worker has no
command-line options for them, so the environment is where they come from) and deletes
through the worker's own engine (``ctx.session.get_bind()``), one transaction per batch
rather than the handler's transaction, which commits only with the run's verdict.
``python -m sqla_outbox purge`` runs the same code from the command line, with ``--dry-run``.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import logging
import time
from collections.abc import Callable
from typing import Any, Protocol

from sqlalchemy import DateTime, Integer, bindparam, text
from sqlalchemy.engine import Connection, Engine

from sqla_outbox.catalog import Catalog, TaskSpec
from sqla_outbox.config import OutboxSettings
from sqla_outbox.lifecycle import retention
from sqla_outbox.logging import log_extra
from sqla_outbox.types import UNFINISHED_STATUSES

logger = logging.getLogger(__name__)

PURGE_TASK = "maintenance.purge"
"""Name of the built-in purge task (queue ``maintenance``, platform scope)."""

PURGE_SCHEDULE = {"cron": "17 3 * * *"}
"""Daily at 03:17 UTC: off the hour, when nothing else tends to be scheduled."""

BUILTIN_TASKS = (PURGE_TASK,)
"""Tasks sqla_outbox registers itself; workers always have them."""

_UNFINISHED = ", ".join(f"'{s}'" for s in UNFINISHED_STATUSES)

LOCK_TIMEOUT_MS = 5000
"""``lock_timeout`` of each purge batch (SKIP LOCKED already avoids row-lock waits)."""

_TIMESTAMPTZ = DateTime(timezone=True)

_CUTOFFS = text(
    """
SELECT clock_timestamp() AS now,
       clock_timestamp() - make_interval(secs => :sent) AS sent,
       clock_timestamp() - make_interval(secs => :succeeded) AS succeeded,
       clock_timestamp() - make_interval(secs => :failed) AS failed
"""
)


@dataclasses.dataclass(frozen=True)
class _Category:
    name: str
    table: str
    delete_sql: Any
    count_sql: Any


def _outbox_category(table: str) -> _Category:
    delete, count = retention.sent_rows(table)
    return _Category(name=table, table=table, delete_sql=delete, count_sql=count)


def _run_category(status: str) -> _Category:
    delete, count = retention.finished_runs(status)
    return _Category(name=f"{status}_runs", table="task_runs", delete_sql=delete, count_sql=count)


# A completed group is kept while its completion run is unfinished: the completion
# handler reads the members' statuses from it (sqla_outbox.groups.outcome).
_GROUP_FILTER = f"""
    g.completed_at < :cutoff
    AND NOT EXISTS (SELECT 1 FROM task_runs r
                    WHERE r.run_id = g.completion_run_id AND r.status IN ({_UNFINISHED}))
"""


def _group_category() -> _Category:
    delete = text(
        f"""
WITH doomed AS (
    SELECT g.id FROM task_groups AS g WHERE {_GROUP_FILTER}
    ORDER BY g.completed_at LIMIT :limit FOR UPDATE SKIP LOCKED
),
gone AS (DELETE FROM task_groups AS t USING doomed WHERE t.id = doomed.id RETURNING 1)
SELECT (SELECT count(*) FROM gone) AS deleted, 0 AS trail_rows
"""
    ).bindparams(bindparam("cutoff", type_=_TIMESTAMPTZ), bindparam("limit", type_=Integer))
    count = text(
        f"SELECT count(*) AS deleted, 0 AS trail_rows FROM task_groups AS g WHERE {_GROUP_FILTER}"
    ).bindparams(bindparam("cutoff", type_=_TIMESTAMPTZ))
    return _Category(name="completed_groups", table="task_groups", delete_sql=delete, count_sql=count)


_CATEGORIES = (
    (_outbox_category("outbox_messages"), "sent"),
    (_outbox_category("platform_outbox_messages"), "sent"),
    (_run_category("succeeded"), "succeeded"),
    (_run_category("failed"), "failed"),
    # cancelled runs go on the succeeded runs' schedule: nothing is left to look into
    (_run_category("cancelled"), "succeeded"),
    (_group_category(), "succeeded"),
)


@dataclasses.dataclass
class PurgeCount:
    """What the purge deleted (or, with ``dry_run``, would delete) in one category.

    Attributes:
        category: ``outbox_messages``, ``platform_outbox_messages``, ``succeeded_runs``,
            ``failed_runs``, ``cancelled_runs`` (purged after ``purge_succeeded_after_days``) or
            ``completed_groups``.
        table: The table rows are deleted from.
        cutoff: Rows older than this (``sent_at`` for outbox rows, ``finished_at`` for
            runs; database clock, UTC) are deleted.
        deleted: Rows deleted (or that would be).
        trail_rows: ``task_run_trail`` rows deleted with the runs (cascade); 0 for outbox
            rows.
        batches: Statements run (0 with ``dry_run``).
    """

    category: str
    table: str
    cutoff: dt.datetime
    deleted: int = 0
    trail_rows: int = 0
    batches: int = 0


@dataclasses.dataclass
class PurgeReport:
    """Result of :func:`purge`.

    Attributes:
        dry_run: Nothing was deleted; the counts are what would be.
        started_at: Database clock when the cutoffs were computed.
        batch_size: Rows per batch (``purge_batch_size``).
        counts: One :class:`PurgeCount` per category, in purge order.
        stopped: The purge was asked to stop (``should_stop``) before it finished.
        duration_ms: Wall time.
    """

    dry_run: bool
    started_at: dt.datetime
    batch_size: int
    counts: list[PurgeCount]
    stopped: bool = False
    duration_ms: float = 0.0

    @property
    def deleted(self) -> int:
        """Rows deleted over all categories (trail rows not included)."""
        return sum(c.deleted for c in self.counts)

    def by_category(self) -> dict[str, PurgeCount]:
        return {c.category: c for c in self.counts}


def purge(
    engine: Engine,
    settings: OutboxSettings,
    *,
    dry_run: bool = False,
    should_stop: Callable[[], bool] | None = None,
) -> PurgeReport:
    """Delete sent outbox rows and finished runs past their retention, in batches.

    Args:
        engine: Engine of the outbox database; each batch runs in its own transaction.
        settings: Uses ``purge_sent_after_days``, ``purge_succeeded_after_days``,
            ``purge_failed_after_days`` (days, may be fractional) and
            ``purge_batch_size`` (rows per statement).
        dry_run: Count what would be deleted (same cutoffs) and delete nothing.
        should_stop: Checked between batches; True stops the purge (the task passes
            "the attempt was cancelled").

    Returns:
        A :class:`PurgeReport`.

    Raises:
        sqlalchemy.exc.DBAPIError: The database failed, or a batch waited longer than
            :data:`LOCK_TIMEOUT_MS` for a lock; batches committed before stay deleted.
    """
    started = time.perf_counter()
    day = 86_400.0
    with engine.connect() as connection:
        cutoffs = connection.execute(
            _CUTOFFS,
            {
                "sent": settings.purge_sent_after_days * day,
                "succeeded": settings.purge_succeeded_after_days * day,
                "failed": settings.purge_failed_after_days * day,
            },
        ).one()
    report = PurgeReport(
        dry_run=dry_run,
        started_at=cutoffs.now,
        batch_size=settings.purge_batch_size,
        counts=[PurgeCount(c.name, c.table, getattr(cutoffs, which)) for c, which in _CATEGORIES],
    )
    for (category, _), count in zip(_CATEGORIES, report.counts, strict=True):
        if dry_run:
            with engine.connect() as connection:
                row = connection.execute(category.count_sql, {"cutoff": count.cutoff}).one()
            count.deleted, count.trail_rows = int(row.deleted), int(row.trail_rows)
            continue
        while True:
            if should_stop is not None and should_stop():
                report.stopped = True
                break
            with engine.begin() as connection:
                deleted, trail_rows = _delete_batch(connection, category, count.cutoff, report.batch_size)
            count.batches += 1
            count.deleted += deleted
            count.trail_rows += trail_rows
            if deleted < report.batch_size:
                break
        if report.stopped:
            break
    report.duration_ms = round((time.perf_counter() - started) * 1000, 2)
    logger.info(
        "purge finished" if not dry_run else "purge dry run finished",
        extra=log_extra(
            action="maintenance.purged" if not dry_run else "maintenance.purge_dry_run",
            stopped=report.stopped,
            duration_ms=report.duration_ms,
            **{c.category: c.deleted for c in report.counts},
            trail_rows=sum(c.trail_rows for c in report.counts),
        ),
    )
    return report


def _delete_batch(
    connection: Connection, category: _Category, cutoff: dt.datetime, limit: int
) -> tuple[int, int]:
    connection.execute(text(f"SET LOCAL lock_timeout = {LOCK_TIMEOUT_MS}"))
    row = connection.execute(category.delete_sql, {"cutoff": cutoff, "limit": limit}).one()
    return int(row.deleted), int(row.trail_rows)


class PurgeContext(Protocol):
    """What :func:`purge_task` uses of the handler's context (a worker ``TaskContext``)."""

    session: Any

    @property
    def cancelled(self) -> bool: ...


def purge_task(payload: Any, ctx: PurgeContext) -> None:
    """Delete sent outbox rows and finished runs past their retention (daily).

    The handler of :data:`PURGE_TASK`; every worker registry built with
    ``Registry.with_builtins()`` (the default registry is) registers it as
    :data:`PURGE_SPEC` says. The payload is ignored (the relay's scheduler sends
    ``{"slot": "<ISO 8601>"}``; a manual dispatch may send ``{}``). Settings come from the
    worker process's environment (``SQLA_OUTBOX_PURGE_*``), the database from the
    worker's own engine; see the module docstring. A cancelled attempt (timeout,
    shutdown) stops between batches; what was deleted stays deleted and the next run
    continues.
    """
    settings = OutboxSettings.from_env()
    bind = ctx.session.get_bind()
    engine: Engine = bind.engine if isinstance(bind, Connection) else bind
    purge(engine, settings, should_stop=lambda: ctx.cancelled)


PURGE_SPEC = TaskSpec(
    name=PURGE_TASK,
    queue="maintenance",
    scope="platform",
    schedule=PURGE_SCHEDULE,
    description="Delete sent outbox rows and finished runs past their retention (daily).",
)
"""How the built-in purge task is registered and cataloged."""

BUILTIN_HANDLERS: dict[str, tuple[TaskSpec, Callable[..., None]]] = {PURGE_TASK: (PURGE_SPEC, purge_task)}
"""Built-in task name → (its catalog entry, its handler), for registries to register."""


def builtin_catalog() -> Catalog:
    """A catalog of sqla_outbox's own tasks (``maintenance.purge`` and its daily schedule),
    for a relay that has no application catalog."""
    return Catalog.build([spec for spec, _ in BUILTIN_HANDLERS.values()], {})
