"""Recurring platform runs, dispatched by the active relay.

A task declares its schedule in the catalog (``"schedule": {"cron": "17 3 * * *"}`` or
``{"every_seconds": 3600}``; with ``@task(..., schedule=...)`` the catalog is generated).
The active relay checks the schedules on the database clock and, for each task, turns its
latest due *slot* into a platform dispatch whose ``run_id`` is derived from the task name
and the slot time (UUID v5). So:

* two relays, or a relay restarting, never dispatch the same slot twice: the second
  insert of that run_id resolves quietly to the existing run (``ON CONFLICT``);
* **catch-up policy — latest slot only**: after downtime only the most recent missed slot
  is dispatched, once, not one run per missed interval. A task that must process every
  interval should read its own watermark from the payload's ``slot`` and catch up inside
  one run;
* a freshly deployed schedule runs its latest past slot at once (for a daily job started
  at 10:00, today's 03:17 slot).

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

from croniter import croniter  # type: ignore[import-untyped]
from sqlalchemy import text
from sqlalchemy.engine import Connection

from sqla_outbox.catalog import Catalog, TaskSpec
from sqla_outbox.dispatch import Dispatch
from sqla_outbox.logging import log_extra
from sqla_outbox.write import write_runs

logger = logging.getLogger(__name__)

SLOT_NAMESPACE = uuid.UUID("5d6f1c1e-3a0b-4c35-9a57-8f1f0b6e2d41")
"""UUID v5 namespace of scheduled run ids."""


def slot_run_id(task: str, slot: dt.datetime) -> uuid.UUID:
    """The run id of ``task``'s run for ``slot`` (deterministic: same inputs, same id)."""
    return uuid.uuid5(SLOT_NAMESPACE, f"{task}@{slot.astimezone(dt.UTC).isoformat()}")


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


@dataclasses.dataclass
class Scheduler:
    """Dispatches the latest due slot of each scheduled task (run by the active relay).

    Args:
        catalog: Tasks with a ``schedule``.
        max_message_bytes: Envelope size limit (as for any dispatch).
    """

    catalog: Catalog
    max_message_bytes: int = 262_144
    _done: dict[str, dt.datetime] = dataclasses.field(default_factory=dict)
    dispatched: int = 0

    @property
    def tasks(self) -> list[TaskSpec]:
        return [t for t in self.catalog.tasks.values() if t.schedule]

    def tick(self, connection: Connection) -> int:
        """Dispatch every task's latest slot not handled yet. Commits. Returns new runs."""
        tasks = self.tasks
        if not tasks:
            return 0
        now: dt.datetime = connection.execute(text("SELECT clock_timestamp()")).scalar_one()
        prepared = []
        slots: dict[str, dt.datetime] = {}
        for spec in tasks:
            assert spec.schedule is not None
            slot = latest_slot(spec.schedule, now)
            if self._done.get(spec.name) == slot:
                continue
            slots[spec.name] = slot
            item = Dispatch(spec.name, {"slot": slot.isoformat()}, run_id=slot_run_id(spec.name, slot))
            prepared.extend(item.prepare(self.catalog, max_message_bytes=self.max_message_bytes))
        if not prepared:
            connection.commit()
            return 0
        written = write_runs(connection, prepared)
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
                        slot=slots[run.task].isoformat(),
                    ),
                )
        return written

    def seconds_until_next(self, now: dt.datetime) -> float | None:
        """Seconds until the next slot of any task (None without schedules)."""
        upcoming = [next_slot(t.schedule, now) for t in self.tasks if t.schedule]
        if not upcoming:
            return None
        return max(0.0, (min(upcoming) - now).total_seconds())
