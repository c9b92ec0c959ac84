"""What the dashboard's pages read from PostgreSQL, beyond what :mod:`sqla_outbox.ops` offers.

Every query here is bounded by an index, so a page costs the same with a million runs as
with a hundred (``benchmarks/bench_dashboard.py`` measures it; ``docs/benchmarks.md``):

* **runs by status** (:func:`status_counts`): an exact count up to :data:`COUNT_CAP` per
  status (an index-only range of ``task_runs_status_idx``); above it, PostgreSQL's own
  estimate from the planner statistics (``pg_stats`` most-common-value frequency times
  ``pg_class.reltuples``), marked as estimated. Counting a million rows exactly would
  take longer than the whole page may;
* **the backlog** (:func:`backlog`): pending outbox rows by table and queue, and by
  tenant (the tenants whose oldest due row has waited longest first), from one pass over
  the pending rows of each outbox table (partial index ``*_pending_idx``);
* **the last hour per minute** (:func:`activity`): runs dispatched (``created_at``,
  ``task_runs_created_at_idx``), finished and failed (``finished_at``,
  ``task_runs_finished_idx``), and the commit → finish latency percentiles of the runs
  that succeeded in each minute (``finished_at - created_at``; ``created_at`` is set in
  the dispatching transaction, so this is commit → finish plus the time the application
  took to commit);
* **a run's outbox row** (:func:`outbox_row`): its envelope and send state, by the unique
  ``run_id``;
* **schedules** (:func:`schedules`): each scheduled task's latest and next slot (the
  relay's own rules, :mod:`sqla_outbox.relay.schedule`) and its last run
  (``task_runs_task_created_at_idx``).

Times are the database clock's (``clock_timestamp()``), in UTC.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import threading
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

from sqlalchemy import Float, Integer, Text, bindparam, text
from sqlalchemy.dialects.postgresql import ARRAY, UUID
from sqlalchemy.engine import Connection

from sqla_outbox import flow
from sqla_outbox.catalog import Catalog
from sqla_outbox.ops.status import PendingRows
from sqla_outbox.relay import schedule
from sqla_outbox.types import RUN_STATUSES

COUNT_CAP = 10_000
"""Runs counted exactly per status; above it the planner's estimate is shown."""

TENANTS_SHOWN = 20
"""Tenants listed in the pending-by-tenant table (the most behind first)."""

ACTIVITY_MINUTES = 60
"""Minutes of history in the overview's charts."""

LATENCY_PERCENTILES = (0.5, 0.95, 0.99)


def database_now(connection: Connection) -> dt.datetime:
    """The database clock (``clock_timestamp()``), timezone-aware."""
    now: dt.datetime = connection.execute(text("SELECT clock_timestamp()")).scalar_one()
    return now


# --- runs by status ----------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class StatusCount:
    """How many runs have one status.

    Attributes:
        status: The status. count: Exact when ``estimated`` is False; else the planner's
            estimate (at least :data:`COUNT_CAP`).
        estimated: True when the exact count stopped at the cap.
    """

    status: str
    count: int
    estimated: bool = False


_CAPPED_COUNTS = text(
    """
SELECT s.status,
       (SELECT count(*) FROM (SELECT 1 FROM task_runs r WHERE r.status = s.status LIMIT :cap) x) AS n
FROM unnest(CAST(:statuses AS text[])) AS s(status)
"""
).bindparams(bindparam("cap", type_=Integer), bindparam("statuses", type_=ARRAY(Text)))
_STATUS_ESTIMATES = text(
    """
SELECT CAST(s.most_common_vals AS text) AS vals, s.most_common_freqs AS freqs,
       greatest(c.reltuples, 0) AS total
FROM pg_class c
LEFT JOIN pg_stats s ON s.tablename = c.relname AND s.attname = 'status'
     AND s.schemaname = (SELECT nspname FROM pg_namespace WHERE oid = c.relnamespace)
WHERE c.oid = CAST('task_runs' AS regclass)
"""
)


def _parse_array_text(value: str) -> list[str]:
    """``{a,b,"c d"}`` (an anyarray cast to text) to ``["a", "b", "c d"]`` (statuses only:
    no escaped quotes in them)."""
    inner = value.strip()[1:-1]
    return [part.strip().strip('"') for part in inner.split(",") if part.strip()]


def status_counts(connection: Connection, *, cap: int = COUNT_CAP) -> list[StatusCount]:
    """Runs per status, in :data:`~sqla_outbox.types.RUN_STATUSES` order (see the module
    docstring for exact and estimated counts)."""
    exact = {
        str(row.status): int(row.n)
        for row in connection.execute(_CAPPED_COUNTS, {"cap": cap, "statuses": list(RUN_STATUSES)})
    }
    if all(n < cap for n in exact.values()):
        return [StatusCount(s, exact[s]) for s in RUN_STATUSES]
    estimates: dict[str, int] = {}
    row = connection.execute(_STATUS_ESTIMATES).one_or_none()
    if row is not None and row.vals is not None and row.freqs is not None:
        for value, freq in zip(_parse_array_text(row.vals), row.freqs, strict=False):
            estimates[value] = round(float(freq) * float(row.total))
    out = []
    for status in RUN_STATUSES:
        if exact[status] < cap:
            out.append(StatusCount(status, exact[status]))
        else:
            out.append(StatusCount(status, max(cap, estimates.get(status, cap)), estimated=True))
    return out


# --- pending rows by tenant ----------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class TenantBacklog:
    """Pending ``outbox_messages`` rows of one tenant.

    Attributes:
        tenant_id: The tenant. pending: Rows with ``sent_at IS NULL``. due: Of those,
            rows whose ``available_at`` has passed.
        oldest_pending_age_seconds: Now minus the oldest pending row's ``created_at``.
        oldest_due_age_seconds: Now minus the oldest due row's ``available_at`` (how late
            the relay is for this tenant); None when nothing is due.
    """

    tenant_id: int
    pending: int
    due: int
    oldest_pending_age_seconds: float
    oldest_due_age_seconds: float | None
    paused: bool = False


@dataclasses.dataclass(frozen=True)
class TenantBacklogReport:
    """:func:`backlog`'s by-tenant part: the ``limit`` most-behind tenants, then every paused
    tenant with pending rows that is not among them, and how many tenants have pending rows
    at all."""

    tenants: list[TenantBacklog]
    tenant_count: int


_BACKLOG = text(
    """
WITH now AS MATERIALIZED (SELECT clock_timestamp() AS t)
SELECT 'outbox_messages' AS tbl, queue, tenant_id, count(*) AS pending,
       count(*) FILTER (WHERE available_at <= (SELECT t FROM now)) AS due,
       EXTRACT(EPOCH FROM (SELECT t FROM now) - min(created_at))::float8 AS oldest_age,
       EXTRACT(EPOCH FROM (SELECT t FROM now)
           - min(available_at) FILTER (WHERE available_at <= (SELECT t FROM now)))::float8 AS due_age,
       max(attempts) AS max_attempts
FROM outbox_messages WHERE sent_at IS NULL GROUP BY queue, tenant_id
UNION ALL
SELECT 'platform_outbox_messages', queue, NULL, count(*),
       count(*) FILTER (WHERE available_at <= (SELECT t FROM now)),
       EXTRACT(EPOCH FROM (SELECT t FROM now) - min(created_at))::float8,
       EXTRACT(EPOCH FROM (SELECT t FROM now)
           - min(available_at) FILTER (WHERE available_at <= (SELECT t FROM now)))::float8,
       max(attempts)
FROM platform_outbox_messages WHERE sent_at IS NULL GROUP BY queue
"""
)


def _oldest(a: float | None, b: float | None) -> float | None:
    return b if a is None else a if b is None else max(a, b)


def backlog(
    connection: Connection, *, limit: int = TENANTS_SHOWN
) -> tuple[list[PendingRows], TenantBacklogReport]:
    """Pending outbox rows by table and queue (as :func:`sqla_outbox.ops.status.pending_rows`
    reports them) and by tenant, from one pass over each table's pending rows.

    Returns:
        ``(rows by table and queue, sorted; the most-behind tenants, at most limit, then
        the paused tenants not among them)``. A tenant is more behind when its oldest due
        row waited longer, then when its oldest pending row is older. A paused tenant's
        rows are held with ``available_at`` pushed forward, so none is due and it would
        rank below every tenant with due work: it is always listed, marked ``paused``.
    """
    by_queue: dict[tuple[str, str], PendingRows] = {}
    by_tenant: dict[int, TenantBacklog] = {}
    for r in connection.execute(_BACKLOG):
        key = (str(r.tbl), str(r.queue))
        age, due_age = float(r.oldest_age), None if r.due_age is None else float(r.due_age)
        seen = by_queue.get(key)
        by_queue[key] = PendingRows(
            table=key[0],
            queue=key[1],
            pending=int(r.pending) + (seen.pending if seen else 0),
            due=int(r.due) + (seen.due if seen else 0),
            oldest_pending_age_seconds=max(age, seen.oldest_pending_age_seconds if seen else age),
            oldest_due_age_seconds=_oldest(due_age, seen.oldest_due_age_seconds if seen else None),
            max_attempts=max(int(r.max_attempts), seen.max_attempts if seen else 0),
        )
        if r.tenant_id is None:
            continue
        tenant = by_tenant.get(int(r.tenant_id))
        by_tenant[int(r.tenant_id)] = TenantBacklog(
            tenant_id=int(r.tenant_id),
            pending=int(r.pending) + (tenant.pending if tenant else 0),
            due=int(r.due) + (tenant.due if tenant else 0),
            oldest_pending_age_seconds=max(age, tenant.oldest_pending_age_seconds if tenant else age),
            oldest_due_age_seconds=_oldest(due_age, tenant.oldest_due_age_seconds if tenant else None),
        )
    paused = flow.current(connection).tenants
    behind = sorted(
        (dataclasses.replace(t, paused=t.tenant_id in paused) for t in by_tenant.values()),
        key=lambda t: (-(t.oldest_due_age_seconds or -1.0), -t.oldest_pending_age_seconds, t.tenant_id),
    )
    shown = behind[:limit] + [t for t in behind[limit:] if t.paused]
    return [by_queue[k] for k in sorted(by_queue)], TenantBacklogReport(shown, len(by_tenant))


# --- the last hour, per minute -------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class MinuteActivity:
    """One minute of the overview's charts.

    Attributes:
        minute: Start of the minute (UTC).
        dispatched: Runs created in it. finished: Runs that reached ``succeeded`` or
            ``failed`` in it. failed: Of those, ``failed``.
        latency_seconds: Commit → finish percentiles (:data:`LATENCY_PERCENTILES`) of the
            runs that succeeded in it; empty when none did.
    """

    minute: dt.datetime
    dispatched: int
    finished: int
    failed: int
    latency_seconds: tuple[float, ...] = ()


@dataclasses.dataclass(frozen=True)
class Activity:
    """:func:`activity`'s result: ``minutes`` oldest first, ending with the current one."""

    now: dt.datetime
    minutes: list[MinuteActivity]


_DISPATCHED = text(
    """
SELECT date_trunc('minute', created_at) AS minute, count(*) AS n
FROM task_runs WHERE created_at >= :since GROUP BY 1
"""
)
_FINISHED = text(
    """
SELECT date_trunc('minute', finished_at) AS minute, count(*) AS finished,
       count(*) FILTER (WHERE status = 'failed') AS failed,
       percentile_cont(CAST(:percentiles AS float8[])) WITHIN GROUP
           (ORDER BY EXTRACT(EPOCH FROM finished_at - created_at))
           FILTER (WHERE status = 'succeeded') AS latency
FROM task_runs
WHERE status IN ('succeeded', 'failed') AND finished_at >= :since
GROUP BY 1
"""
).bindparams(bindparam("percentiles", type_=ARRAY(Float)))


SETTLE_SECONDS = 120
"""A minute's figures are final this long after it ends: ``created_at`` and ``finished_at``
are stamped before their transaction commits, so a minute can still gain rows while
transactions that began in it commit."""


class ActivityCache:
    """Per-minute figures of settled minutes (see :data:`SETTLE_SECONDS`), so a refresh of
    the overview reads only the last few minutes instead of the whole hour. Thread-safe;
    one per dashboard application.
    """

    def __init__(self) -> None:
        self._minutes: dict[dt.datetime, MinuteActivity] = {}
        self._lock = threading.Lock()

    def settled(self, since: dt.datetime, now: dt.datetime) -> dict[dt.datetime, MinuteActivity]:
        """The cached minutes from ``since`` on; forgets older ones."""
        with self._lock:
            for minute in [m for m in self._minutes if m < since]:
                del self._minutes[minute]
            return dict(self._minutes)

    def keep(self, minutes: Sequence[MinuteActivity], now: dt.datetime) -> None:
        settled_before = now - dt.timedelta(seconds=SETTLE_SECONDS)
        with self._lock:
            for minute in minutes:
                if minute.minute + dt.timedelta(minutes=1) <= settled_before:
                    self._minutes[minute.minute] = minute


def activity(
    connection: Connection, *, minutes: int = ACTIVITY_MINUTES, cache: ActivityCache | None = None
) -> Activity:
    """Runs dispatched, finished and failed per minute, and the latency percentiles, over
    the last ``minutes`` minutes (the current, partial minute last).

    Args:
        connection: Read-only use.
        minutes: Minutes of history.
        cache: Settled minutes already read; only the others are queried, then kept.
    """
    now = database_now(connection)
    current = now.replace(second=0, microsecond=0)
    since = current - dt.timedelta(minutes=minutes - 1)
    known = cache.settled(since, now) if cache is not None else {}
    wanted = [since + dt.timedelta(minutes=i) for i in range(minutes)]
    first_unknown = next((m for m in wanted if m not in known), None)
    fresh: dict[dt.datetime, MinuteActivity] = {}
    if first_unknown is not None:
        dispatched = {
            row.minute: int(row.n) for row in connection.execute(_DISPATCHED, {"since": first_unknown})
        }
        finished = {
            row.minute: row
            for row in connection.execute(
                _FINISHED, {"since": first_unknown, "percentiles": list(LATENCY_PERCENTILES)}
            )
        }
        for minute in wanted:
            if minute < first_unknown:
                continue
            done = finished.get(minute)
            fresh[minute] = MinuteActivity(
                minute=minute,
                dispatched=dispatched.get(minute, 0),
                finished=int(done.finished) if done is not None else 0,
                failed=int(done.failed) if done is not None else 0,
                latency_seconds=tuple(float(v) for v in done.latency)
                if done is not None and done.latency is not None
                else (),
            )
    out = [fresh.get(minute) or known[minute] for minute in wanted]
    if cache is not None:
        cache.keep(list(fresh.values()), now)
    return Activity(now=now, minutes=out)


# --- one run's outbox row ------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class OutboxState:
    """A run's outbox row: its envelope and whether it was sent.

    Attributes:
        table: ``outbox_messages`` or ``platform_outbox_messages``.
        envelope: The stored envelope document (``payload`` included: callers hide it
            unless payloads are shown). available_at / sent_at / created_at: The row's
            times (``sent_at`` None: pending). attempts: Failed send attempts.
    """

    table: str
    envelope: Mapping[str, Any]
    available_at: dt.datetime
    sent_at: dt.datetime | None
    created_at: dt.datetime
    attempts: int


_OUTBOX_ROW = text(
    """
SELECT 'outbox_messages' AS tbl, envelope, available_at, sent_at, created_at, attempts
FROM outbox_messages WHERE run_id = :run_id
UNION ALL
SELECT 'platform_outbox_messages', envelope, available_at, sent_at, created_at, attempts
FROM platform_outbox_messages WHERE run_id = :run_id
"""
).bindparams(bindparam("run_id", type_=UUID(as_uuid=True)))


def outbox_row(connection: Connection, run_id: uuid.UUID) -> OutboxState | None:
    """The outbox row of ``run_id``; None once ``maintenance.purge`` deleted it."""
    row = connection.execute(_OUTBOX_ROW, {"run_id": run_id}).first()
    if row is None:
        return None
    envelope = row.envelope if isinstance(row.envelope, Mapping) else {}
    return OutboxState(
        table=str(row.tbl),
        envelope=envelope,
        available_at=row.available_at,
        sent_at=row.sent_at,
        created_at=row.created_at,
        attempts=int(row.attempts),
    )


# --- runs named by DLQ messages ------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class RunError:
    """A run's status and last error, shown beside its DLQ message."""

    status: str
    error_type: str | None
    error: str | None


_ERRORS_OF = text(
    "SELECT run_id, status, last_error_type, last_error FROM task_runs WHERE run_id = ANY(:run_ids)"
).bindparams(bindparam("run_ids", type_=ARRAY(UUID(as_uuid=True))))


def errors_of(connection: Connection, run_ids: Sequence[uuid.UUID]) -> dict[uuid.UUID, RunError]:
    """``{run_id: RunError}`` for the runs that exist among ``run_ids``."""
    if not run_ids:
        return {}
    return {
        row.run_id: RunError(str(row.status), row.last_error_type, row.last_error)
        for row in connection.execute(_ERRORS_OF, {"run_ids": list(run_ids)})
    }


# --- schedules -----------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class ScheduleState:
    """One scheduled task.

    Attributes:
        task / queue: The task. schedule: Its catalog ``schedule`` (``cron`` or
            ``every_seconds``). latest_slot: The most recent slot at or before now (the
            relay dispatches it once). latest_slot_run_id: That slot's run id (derived:
            :func:`sqla_outbox.relay.schedule.slot_run_id`). latest_slot_status: That
            run's status; None when it was not dispatched (yet, or the relay is down).
        next_slot: The next slot. last_run_id / last_run_at / last_run_status: The
            task's most recently created run, whichever slot.
    """

    task: str
    queue: str
    schedule: Mapping[str, Any]
    latest_slot: dt.datetime
    latest_slot_run_id: uuid.UUID
    latest_slot_status: str | None
    next_slot: dt.datetime
    last_run_id: uuid.UUID | None
    last_run_at: dt.datetime | None
    last_run_status: str | None


_LAST_RUN = text(
    """
SELECT run_id, created_at, status FROM task_runs
WHERE task = :task AND tenant_id IS NULL ORDER BY created_at DESC LIMIT 1
"""
)
_STATUS_OF = text("SELECT status FROM task_runs WHERE run_id = :run_id").bindparams(
    bindparam("run_id", type_=UUID(as_uuid=True))
)


def schedules(connection: Connection, catalog: Catalog) -> tuple[dt.datetime, list[ScheduleState]]:
    """``(database now, the scheduled tasks of catalog by name)``."""
    now = database_now(connection)
    out = []
    for spec in sorted(catalog.tasks.values(), key=lambda t: t.name):
        if not spec.schedule:
            continue
        latest = schedule.latest_slot(spec.schedule, now)
        slot_run = schedule.slot_run_id(spec.name, latest)
        slot_status = connection.execute(_STATUS_OF, {"run_id": slot_run}).scalar()
        last = connection.execute(_LAST_RUN, {"task": spec.name}).first()
        out.append(
            ScheduleState(
                task=spec.name,
                queue=spec.queue,
                schedule=dict(spec.schedule),
                latest_slot=latest,
                latest_slot_run_id=slot_run,
                latest_slot_status=None if slot_status is None else str(slot_status),
                next_slot=schedule.next_slot(spec.schedule, now),
                last_run_id=None if last is None else last.run_id,
                last_run_at=None if last is None else last.created_at,
                last_run_status=None if last is None else str(last.status),
            )
        )
    return now, out
