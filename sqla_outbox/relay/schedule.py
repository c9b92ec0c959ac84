"""Recurring platform runs, dispatched by the active relay.

A task declares its schedule in the catalog (``"schedule": {"cron": "17 3 * * *"}`` or
``{"every_seconds": 3600}``; with ``@task(..., schedule=...)`` the catalog is generated).
The active relay checks the schedules on the database clock and, for each task, turns its
latest due *slot* into a platform dispatch whose ``run_id`` is derived from the task name
and the slot time (UUID v5). So:

* two relays, or a relay restarting, never dispatch the same slot twice, whatever was
  purged since: the latest slot dispatched for each task is stored in ``schedule_slots``
  (never purged), in the transaction that writes the slot's run, and a slot is dispatched
  only when it is later than the stored one. The deterministic run_id is a second guard
  while the run exists (a repeated insert resolves quietly to it, ``ON CONFLICT``);
* **catch-up policy — latest slot only**: after downtime only the most recent missed slot
  is dispatched, once, not one run per missed interval. A task that must process every
  interval should read its own watermark from the payload's ``slot`` and catch up inside
  one run;
* a freshly deployed schedule runs its latest past slot at once (for a daily job started
  at 10:00, today's 03:17 slot).

**Tenant fan-out.** A schedule with ``"tenants": {"table": "tenants", "column": "id"}`` or
``"tenants": {"query": "SELECT id FROM tenants WHERE active"}`` dispatches one run per
listed tenant per slot, each with that ``tenant_id`` (the task's scope must be ``tenant``
or ``any``). The tenants are read in the transaction that writes the slot's runs; the
latest slot dispatched is stored per task *and tenant* in ``schedule_tenant_slots`` with
the same ``INSERT ... ON CONFLICT ... WHERE last_slot < EXCLUDED.last_slot`` guard, and
each run id is derived from task, tenant and slot, so every tenant gets each slot at most
once, across restarts, failovers and purges, and the same latest-slot-only catch-up. A
tenant added in the middle of a slot is picked up at the next slot (the relay reads the
list once per slot). The query is the application's own SQL, from its catalog: it must
return one bigint column.

Cron expressions have five fields and are evaluated in UTC (croniter). Interval slots are
multiples of ``every_seconds`` since the Unix epoch. The payload is
``{"slot": "<ISO 8601 UTC>"}``.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import logging
import uuid
from collections.abc import Mapping
from typing import Any

import sqlalchemy as sa
from croniter import croniter  # type: ignore[import-untyped]
from sqlalchemy import BigInteger, DateTime, Text, bindparam, text
from sqlalchemy.dialects.postgresql import ARRAY, UUID
from sqlalchemy.engine import Connection
from sqlalchemy.exc import DBAPIError

from sqla_outbox.catalog import Catalog, TaskSpec
from sqla_outbox.dispatch import Dispatch
from sqla_outbox.logging import describe_error, log_extra
from sqla_outbox.types import TRIGGER_PRIORITIES
from sqla_outbox.write import write_runs

logger = logging.getLogger(__name__)

SLOT_NAMESPACE = uuid.UUID("5d6f1c1e-3a0b-4c35-9a57-8f1f0b6e2d41")
"""UUID v5 namespace of scheduled run ids."""


def slot_run_id(task: str, slot: dt.datetime) -> uuid.UUID:
    """The run id of ``task``'s run for ``slot`` (deterministic: same inputs, same id)."""
    return uuid.uuid5(SLOT_NAMESPACE, f"{task}@{slot.astimezone(dt.UTC).isoformat()}")


def tenant_slot_run_id(task: str, tenant_id: int, slot: dt.datetime) -> uuid.UUID:
    """The run id of ``task``'s run for ``tenant_id`` and ``slot`` (deterministic)."""
    return uuid.uuid5(SLOT_NAMESPACE, f"{task}@{tenant_id}@{slot.astimezone(dt.UTC).isoformat()}")


def tenants_query(spec: Mapping[str, Any]) -> str:
    """SQL listing the tenant ids of a fan-out schedule's ``tenants`` entry.

    ``{"query": sql}`` is used as written; ``{"table": t, "column": c}`` becomes
    ``SELECT c FROM t`` (names validated by the catalog schema: unquoted identifiers).
    """
    if "query" in spec:
        return str(spec["query"])
    return f"SELECT {spec.get('column', 'id')} FROM {spec['table']}"  # schema-checked names


def latest_slot(schedule: Mapping[str, Any], now: dt.datetime) -> dt.datetime:
    """The most recent slot at or before ``now`` (UTC)."""
    now = now.astimezone(dt.UTC)
    if "every_seconds" in schedule:
        every = float(schedule["every_seconds"])
        epoch = now.timestamp()
        return dt.datetime.fromtimestamp(epoch - (epoch % every), dt.UTC)
    itr = croniter(str(schedule["cron"]), now + dt.timedelta(microseconds=1))
    slot: dt.datetime = itr.get_prev(dt.datetime)
    return slot.astimezone(dt.UTC)


def next_slot(schedule: Mapping[str, Any], now: dt.datetime) -> dt.datetime:
    """The first slot strictly after ``now`` (UTC)."""
    now = now.astimezone(dt.UTC)
    if "every_seconds" in schedule:
        return latest_slot(schedule, now) + dt.timedelta(seconds=float(schedule["every_seconds"]))
    slot: dt.datetime = croniter(str(schedule["cron"]), now).get_next(dt.datetime)
    return slot.astimezone(dt.UTC)


_ADVANCE = text(
    """
INSERT INTO schedule_slots AS s (task, last_slot, run_id)
SELECT * FROM unnest(CAST(:tasks AS text[]), CAST(:slots AS timestamptz[]), CAST(:run_ids AS uuid[]))
ON CONFLICT (task) DO UPDATE
SET last_slot = EXCLUDED.last_slot, run_id = EXCLUDED.run_id, updated_at = clock_timestamp()
WHERE s.last_slot < EXCLUDED.last_slot
RETURNING task
"""
).bindparams(
    bindparam("tasks", type_=ARRAY(Text)),
    bindparam("slots", type_=ARRAY(DateTime(timezone=True))),
    bindparam("run_ids", type_=ARRAY(UUID(as_uuid=True))),
)


_ADVANCE_TENANTS = text(
    """
INSERT INTO schedule_tenant_slots AS s (task, tenant_id, last_slot, run_id)
SELECT :task, t.tenant_id, :slot, t.run_id
FROM unnest(CAST(:tenant_ids AS bigint[]), CAST(:run_ids AS uuid[])) AS t(tenant_id, run_id)
ON CONFLICT (task, tenant_id) DO UPDATE
SET last_slot = EXCLUDED.last_slot, run_id = EXCLUDED.run_id, updated_at = clock_timestamp()
WHERE s.last_slot < EXCLUDED.last_slot
RETURNING tenant_id
"""
).bindparams(
    bindparam("slot", type_=DateTime(timezone=True)),
    bindparam("tenant_ids", type_=ARRAY(BigInteger)),
    bindparam("run_ids", type_=ARRAY(UUID(as_uuid=True))),
)


@dataclasses.dataclass
class Scheduler:
    """Dispatches the latest due slot of each scheduled task (run by the active relay).

    Args:
        catalog: Tasks with a ``schedule``.
        max_message_bytes: Envelope size limit (as for any dispatch).
        tenant_foreign_key: ``[schema.]table.column`` that ``tenant_id`` references (the
            ``tenant_foreign_key`` setting), or None: a fan-out schedule dispatches only to
            listed tenants that exist there, so a stale id cannot fail the slot for all.
    """

    catalog: Catalog
    max_message_bytes: int = 262_144
    tenant_foreign_key: str | None = None
    _done: dict[str, dt.datetime] = dataclasses.field(default_factory=dict)
    dispatched: int = 0

    @property
    def tasks(self) -> list[TaskSpec]:
        return [t for t in self.catalog.tasks.values() if t.schedule]

    def _fan_out(self, connection: Connection, spec: TaskSpec, slot: dt.datetime) -> list[Dispatch]:
        """Advance the slot of each tenant the schedule lists; the dispatches of those that advanced."""
        assert spec.schedule is not None
        try:
            with connection.begin_nested():  # a broken query must not abort the other schedules
                listed = connection.execute(text(tenants_query(spec.schedule["tenants"]))).scalars().all()
                tenant_ids = sorted({int(t) for t in listed if t is not None})
        except (DBAPIError, TypeError, ValueError) as exc:
            logger.error(
                "schedule tenants not listed",
                extra=log_extra(
                    action="relay.schedule_tenants_failed",
                    task=spec.name,
                    error_type=type(exc).__name__,
                    error=describe_error(exc) if isinstance(exc, DBAPIError) else str(exc)[:200],
                ),
            )
            return []
        tenant_ids = self._existing(connection, spec, tenant_ids)
        if not tenant_ids:
            return []
        run_ids = [tenant_slot_run_id(spec.name, t, slot) for t in tenant_ids]
        advanced = set(
            connection.execute(
                _ADVANCE_TENANTS,
                {"task": spec.name, "slot": slot, "tenant_ids": tenant_ids, "run_ids": run_ids},
            ).scalars()
        )
        return [
            Dispatch(
                spec.name,
                {"slot": slot.isoformat()},
                tenant_id=t,
                run_id=run_id,
                priority=spec.priority or TRIGGER_PRIORITIES["schedule"],
            )
            for t, run_id in zip(tenant_ids, run_ids, strict=True)
            if t in advanced
        ]

    def _existing(self, connection: Connection, spec: TaskSpec, tenant_ids: list[int]) -> list[int]:
        """``tenant_ids`` less those the tenant foreign key's table does not hold (logged by
        id: a deleted tenant still listed by the query would otherwise fail the whole slot,
        every tenant's, on the foreign key, at every tick)."""
        if self.tenant_foreign_key is None or not tenant_ids:
            return tenant_ids
        *path, column = self.tenant_foreign_key.split(".")
        table = sa.table(path[-1], sa.column(column), schema=path[0] if len(path) == 2 else None)
        present = set(
            connection.execute(sa.select(table.c[column]).where(table.c[column].in_(tenant_ids))).scalars()
        )
        missing = [t for t in tenant_ids if t not in present]
        if missing:
            logger.warning(
                "schedule tenants skipped: not in the tenants table",
                extra=log_extra(
                    action="relay.schedule_tenants_missing",
                    task=spec.name,
                    tenants=",".join(str(t) for t in missing[:20]),
                    count=len(missing),
                ),
            )
        return [t for t in tenant_ids if t in present]

    def tick(self, connection: Connection) -> int:
        """Dispatch every task's latest slot not handled yet. Commits. Returns new runs.

        In one transaction: advance each task's row of ``schedule_slots`` to its latest
        slot where that slot is later than the one stored (``INSERT ... ON CONFLICT DO
        UPDATE ... WHERE last_slot < EXCLUDED.last_slot``), and write the runs of exactly
        the tasks that advanced. A slot at or before the stored one is never dispatched,
        so neither a restart, a failover nor a purge of the slot's run repeats it. A
        fan-out schedule does the same per tenant in ``schedule_tenant_slots``, for the
        tenants its table or query lists now (a failing query is logged,
        ``relay.schedule_tenants_failed``, and retried at the next tick).
        """
        tasks = self.tasks
        if not tasks:
            return 0
        now: dt.datetime = connection.execute(text("SELECT clock_timestamp()")).scalar_one()
        slots: dict[str, dt.datetime] = {}
        for spec in tasks:
            assert spec.schedule is not None
            slot = latest_slot(spec.schedule, now)
            if self._done.get(spec.name) != slot:
                slots[spec.name] = slot
        if not slots:
            connection.commit()
            return 0
        platform = {task: slot for task, slot in slots.items() if "tenants" not in self._schedule(task)}
        advanced = (
            {
                row[0]
                for row in connection.execute(
                    _ADVANCE,
                    {
                        "tasks": list(platform),
                        "slots": list(platform.values()),
                        "run_ids": [slot_run_id(task, slot) for task, slot in platform.items()],
                    },
                )
            }
            if platform
            else set()
        )
        items = [
            Dispatch(
                task,
                {"slot": slots[task].isoformat()},
                run_id=slot_run_id(task, slots[task]),
                # the catalog's priority, else the "schedule" trigger's (5: tolerates latency)
                priority=self.catalog.task(task).priority or TRIGGER_PRIORITIES["schedule"],
            )
            for task in advanced
        ]
        for task, slot in slots.items():
            if task not in platform:
                items.extend(self._fan_out(connection, self.catalog.tasks[task], slot))
        prepared = []
        for item in items:
            prepared.extend(item.prepare(self.catalog, max_message_bytes=self.max_message_bytes))
        written = write_runs(connection, prepared) if prepared else 0
        connection.commit()
        self._done.update(slots)
        self.dispatched += written
        for run in prepared:
            if not run.deduplicated:
                logger.info(
                    "scheduled run dispatched",
                    extra=log_extra(
                        action="relay.scheduled",
                        task=run.task,
                        run_id=str(run.run_id),
                        tenant_id=run.tenant_id,
                        slot=slots[run.task].isoformat(),
                    ),
                )
        return written

    def _schedule(self, task: str) -> Mapping[str, Any]:
        return self.catalog.tasks[task].schedule or {}

    def seconds_until_next(self, now: dt.datetime) -> float | None:
        """Seconds until the next slot of any task (None without schedules)."""
        upcoming = [next_slot(t.schedule, now) for t in self.tasks if t.schedule]
        if not upcoming:
            return None
        return max(0.0, (min(upcoming) - now).total_seconds())
