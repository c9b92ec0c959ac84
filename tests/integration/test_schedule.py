"""Recurring runs: one dispatch per slot, deterministic run ids, latest-slot-only catch-up."""

from __future__ import annotations

import datetime as dt
import json
import logging
import time

import pytest
import sqlalchemy as sa

from sqla_outbox import errors, maintenance
from sqla_outbox.catalog import Catalog
from sqla_outbox.config import OutboxSettings
from sqla_outbox.relay import Relay
from sqla_outbox.relay.schedule import Scheduler, latest_slot, next_slot, slot_run_id
from tests.support import CATALOG, outbox_rows, runs

UTC = dt.UTC


def scheduled_catalog(schedule: dict) -> Catalog:
    doc = json.loads(json.dumps(CATALOG))
    doc["tasks"]["rebuild_cache"]["schedule"] = schedule
    return Catalog.from_dict(doc)


def test_cron_slots_are_evaluated_in_utc() -> None:
    now = dt.datetime(2026, 11, 29, 10, 0, tzinfo=UTC)
    assert latest_slot({"cron": "17 3 * * *"}, now) == dt.datetime(2026, 11, 29, 3, 17, tzinfo=UTC)
    assert next_slot({"cron": "17 3 * * *"}, now) == dt.datetime(2026, 11, 30, 3, 17, tzinfo=UTC)
    exact = dt.datetime(2026, 11, 29, 3, 17, tzinfo=UTC)
    assert latest_slot({"cron": "17 3 * * *"}, exact) == exact
    sao_paulo = now.astimezone(dt.timezone(dt.timedelta(hours=-3)))
    assert latest_slot({"cron": "17 3 * * *"}, sao_paulo) == dt.datetime(2026, 11, 29, 3, 17, tzinfo=UTC)


def test_interval_slots_are_epoch_multiples() -> None:
    now = dt.datetime(2026, 11, 29, 10, 7, 31, tzinfo=UTC)
    assert latest_slot({"every_seconds": 300}, now) == dt.datetime(2026, 11, 29, 10, 5, tzinfo=UTC)
    assert next_slot({"every_seconds": 300}, now) == dt.datetime(2026, 11, 29, 10, 10, tzinfo=UTC)


def test_after_downtime_only_the_latest_missed_slot_counts() -> None:
    """Hourly task, relay down from 01:30 to 05:10: one run, for the 05:00 slot."""
    back = dt.datetime(2026, 11, 29, 5, 10, tzinfo=UTC)
    assert latest_slot({"cron": "0 * * * *"}, back) == dt.datetime(2026, 11, 29, 5, 0, tzinfo=UTC)


def test_run_ids_are_derived_from_task_and_slot() -> None:
    slot = dt.datetime(2026, 11, 29, 3, 17, tzinfo=UTC)
    assert slot_run_id("nightly", slot) == slot_run_id("nightly", slot.astimezone(dt.timezone.max))
    assert slot_run_id("nightly", slot) != slot_run_id("nightly", slot + dt.timedelta(days=1))
    assert slot_run_id("nightly", slot) != slot_run_id("weekly", slot)


def test_bad_cron_expression_is_a_catalog_error() -> None:
    with pytest.raises(errors.CatalogError) as caught:
        scheduled_catalog({"cron": "61 3 * * *"})
    assert caught.value.pointer == "tasks.rebuild_cache.schedule.cron"


def test_two_schedulers_and_restarts_dispatch_each_slot_once(engine: sa.Engine) -> None:
    catalog = scheduled_catalog({"cron": "*/5 * * * *"})
    first, second = Scheduler(catalog), Scheduler(catalog)
    with engine.connect() as conn:
        assert first.tick(conn) == 1
        assert first.tick(conn) == 0  # same slot: nothing to do
        assert second.tick(conn) == 0  # another scheduler (or a restart): resolves to the same run
        assert Scheduler(catalog).tick(conn) == 0
    [run] = runs(engine)
    [row] = outbox_rows(engine)
    assert run.task == "rebuild_cache" and run.tenant_id is None and row.kind == "platform"
    slot = json.loads(row.envelope["payload"])["slot"]
    assert run.run_id == slot_run_id("rebuild_cache", dt.datetime.fromisoformat(slot))


def test_a_slot_is_never_dispatched_again_after_its_run_was_purged(
    engine: sa.Engine, settings: OutboxSettings
) -> None:
    """Monthly task: its 1st-of-the-month run succeeded, was purged 8 days later, then the
    relay restarted. The slot must not run again (issue 11, item 5)."""
    catalog = scheduled_catalog({"cron": "0 0 1 * *"})
    with engine.connect() as conn:
        assert Scheduler(catalog).tick(conn) == 1
    [run] = runs(engine)
    with engine.begin() as conn:  # it ran, and all of that was 8 days ago
        conn.execute(
            sa.text(
                "UPDATE task_runs SET status = 'succeeded', "
                "finished_at = clock_timestamp() - interval '8 days'"
            )
        )
        conn.execute(
            sa.text("UPDATE platform_outbox_messages SET sent_at = clock_timestamp() - interval '8 days'")
        )
    purged = maintenance.purge(engine, settings).by_category()
    assert purged["succeeded_runs"].deleted == 1 and purged["platform_outbox_messages"].deleted == 1
    assert runs(engine) == [] and outbox_rows(engine) == []
    with engine.connect() as conn:
        assert Scheduler(catalog).tick(conn) == 0  # a restarted (or another) relay
        stored = conn.execute(sa.text("SELECT task, last_slot, run_id FROM schedule_slots")).all()
    assert runs(engine) == [] and outbox_rows(engine) == []
    assert [(task, run_id) for task, _, run_id in stored] == [("rebuild_cache", run.run_id)]


def test_each_new_slot_is_dispatched_once(engine: sa.Engine) -> None:
    scheduler = Scheduler(scheduled_catalog({"every_seconds": 1}))
    deadline = time.monotonic() + 3.2
    with engine.connect() as conn:
        while time.monotonic() < deadline:
            scheduler.tick(conn)
            time.sleep(0.05)
    slots = [json.loads(r.envelope["payload"])["slot"] for r in outbox_rows(engine)]
    assert 3 <= len(slots) <= 5
    assert len(set(slots)) == len(slots)


def test_the_active_relay_runs_the_schedule(
    engine: sa.Engine, settings: OutboxSettings, sqs_endpoint: str, queues: dict[str, str]
) -> None:
    relay = Relay(
        settings.replace(sqs_endpoint_url=sqs_endpoint),
        engine=engine,
        catalog=scheduled_catalog({"every_seconds": 1}),
    )
    relay.start_in_thread()
    try:
        time.sleep(2.6)
    finally:
        relay.stop()
        relay.join(10)
    rows = outbox_rows(engine)
    assert 2 <= len(rows) <= 4
    assert all(r.sent_at is not None for r in rows[:-1])  # sent by the same relay
    assert len({r.run_id for r in rows}) == len(rows)


def test_without_a_catalog_file_the_relay_still_schedules_the_purge_and_says_so(
    engine: sa.Engine, settings: OutboxSettings, tmp_path, caplog: pytest.LogCaptureFixture
) -> None:
    missing = tmp_path / "not-written" / "tasks.json"
    with caplog.at_level(logging.WARNING, logger="sqla_outbox"):
        relay = Relay(settings.replace(catalog_path=str(missing)), engine=engine)
    assert relay.scheduler is not None
    assert [t.name for t in relay.scheduler.tasks] == ["maintenance.purge"]
    actions = [(r, getattr(r, "sqla_outbox", {}).get("action")) for r in caplog.records]
    [warning] = [r for r, action in actions if action == "relay.no_catalog"]
    assert str(missing) in warning.getMessage() and "catalog write" in warning.getMessage()

    relay = Relay(settings, engine=engine)  # the test catalog file: its own schedules only
    assert relay.scheduler is None


def test_relay_check_lists_the_schedules_it_will_run(settings: OutboxSettings, tmp_path) -> None:
    from sqla_outbox import health

    present = health.check_schedules(settings)
    assert present.ok and present.detail.startswith(settings.catalog_path)
    absent = health.check_schedules(settings.replace(catalog_path=str(tmp_path / "none" / "tasks.json")))
    assert absent.ok and "built-in schedules only (maintenance.purge)" in absent.detail
    broken = tmp_path / "broken.json"
    broken.write_text("{not json")
    invalid = health.check_schedules(settings.replace(catalog_path=str(broken)))
    assert not invalid.ok and str(broken) in invalid.detail
    assert health.check_schedules(settings.replace(relay_scheduler=False)).detail.startswith("scheduler off")
