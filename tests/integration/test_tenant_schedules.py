"""Schedules fanned out to tenants: one run per listed tenant per slot, once, whatever
restarts, second schedulers or purges happen; latest-slot-only catch-up per tenant."""

from __future__ import annotations

import datetime as dt
import json
import logging

import pytest
import sqlalchemy as sa

from sqla_outbox import errors
from sqla_outbox.catalog import Catalog
from sqla_outbox.relay.schedule import Scheduler, latest_slot, tenant_slot_run_id
from tests.support import CATALOG, outbox_rows, runs


def fan_out_catalog(schedule: dict, *, task: str = "charge_card") -> Catalog:
    doc = json.loads(json.dumps(CATALOG))
    doc["tasks"][task]["schedule"] = schedule
    return Catalog.from_dict(doc)


def slots_by_tenant(engine: sa.Engine) -> dict[int, list[str]]:
    out: dict[int, list[str]] = {}
    for row in outbox_rows(engine):
        out.setdefault(row.tenant_id, []).append(json.loads(row.envelope["payload"])["slot"])
    return out


def test_each_listed_tenant_gets_one_run_per_slot(engine: sa.Engine) -> None:
    catalog = fan_out_catalog(
        {"cron": "*/5 * * * *", "tenants": {"query": "SELECT id FROM tenants WHERE id <= 3"}}
    )
    with engine.connect() as conn:
        assert Scheduler(catalog).tick(conn) == 3
        assert Scheduler(catalog).tick(conn) == 0  # a restart, or a second relay
    found = runs(engine)
    assert sorted(r.tenant_id for r in found) == [1, 2, 3]
    assert all(r.task == "charge_card" for r in found)
    (slot,) = {s for slots in slots_by_tenant(engine).values() for s in slots}
    assert {r.run_id for r in found} == {
        tenant_slot_run_id("charge_card", t, dt.datetime.fromisoformat(slot)) for t in (1, 2, 3)
    }
    assert all(row.kind == "tenant" for row in outbox_rows(engine))


def test_table_form_and_a_purged_run_is_never_dispatched_again(engine: sa.Engine) -> None:
    with engine.begin() as conn:
        conn.execute(sa.text("CREATE TABLE billing_accounts (tenant bigint)"))
        conn.execute(sa.text("INSERT INTO billing_accounts VALUES (4), (5), (5)"))
    catalog = fan_out_catalog(
        {"cron": "0 0 1 * *", "tenants": {"table": "billing_accounts", "column": "tenant"}}
    )
    with engine.connect() as conn:
        assert Scheduler(catalog).tick(conn) == 2  # duplicates in the list count once
    with engine.begin() as conn:  # purged: the runs and outbox rows are gone
        conn.execute(sa.text("DELETE FROM outbox_messages"))
        conn.execute(sa.text("DELETE FROM task_runs"))
    with engine.connect() as conn:
        assert Scheduler(catalog).tick(conn) == 0
        stored = (
            conn.execute(sa.text("SELECT tenant_id FROM schedule_tenant_slots ORDER BY 1")).scalars().all()
        )
    assert stored == [4, 5] and runs(engine) == []


def test_a_missed_slot_is_caught_up_once_per_tenant_latest_slot_only(engine: sa.Engine) -> None:
    """The relay last dispatched the slot three hours ago (it was down since): each tenant
    gets one run, for the latest slot; the two missed slots in between are not dispatched."""
    schedule = {"cron": "0 * * * *", "tenants": {"query": "SELECT id FROM tenants WHERE id IN (1, 2)"}}
    with engine.connect() as conn:
        now = conn.execute(sa.text("SELECT clock_timestamp()")).scalar_one()
    latest = latest_slot(schedule, now)
    with engine.begin() as conn:
        conn.execute(
            sa.text(
                "INSERT INTO schedule_tenant_slots (task, tenant_id, last_slot, run_id) "
                "SELECT 'charge_card', t, CAST(:slot AS timestamptz), gen_random_uuid() "
                "FROM unnest(ARRAY[1, 2]) t"
            ),
            {"slot": latest - dt.timedelta(hours=3)},
        )
    with engine.connect() as conn:
        assert Scheduler(fan_out_catalog(schedule)).tick(conn) == 2
    assert slots_by_tenant(engine) == {1: [latest.isoformat()], 2: [latest.isoformat()]}


def test_a_tenant_added_later_gets_the_next_slot(engine: sa.Engine) -> None:
    with engine.begin() as conn:
        conn.execute(sa.text("CREATE TABLE active (id bigint)"))
        conn.execute(sa.text("INSERT INTO active VALUES (1)"))
    catalog = fan_out_catalog({"every_seconds": 3600, "tenants": {"table": "active"}})
    with engine.connect() as conn:
        assert Scheduler(catalog).tick(conn) == 1
    with engine.begin() as conn:
        conn.execute(sa.text("INSERT INTO active VALUES (2)"))
    with engine.connect() as conn:  # a fresh scheduler (restart): tenant 2 gets the current slot
        assert Scheduler(catalog).tick(conn) == 1
    assert sorted(slots_by_tenant(engine)) == [1, 2]


def test_a_failing_tenant_query_is_logged_and_other_schedules_still_run(
    engine: sa.Engine, caplog: pytest.LogCaptureFixture
) -> None:
    doc = json.loads(json.dumps(CATALOG))
    doc["tasks"]["charge_card"]["schedule"] = {
        "every_seconds": 60,
        "tenants": {"query": "SELECT id FROM nowhere"},
    }
    doc["tasks"]["rebuild_cache"]["schedule"] = {"every_seconds": 60}
    with engine.connect() as conn, caplog.at_level(logging.ERROR):
        assert Scheduler(Catalog.from_dict(doc)).tick(conn) == 1
    assert [r.task for r in runs(engine)] == ["rebuild_cache"]
    assert any(
        getattr(r, "sqla_outbox", {}).get("action") == "relay.schedule_tenants_failed" for r in caplog.records
    )


def test_a_listed_tenant_missing_from_the_tenants_table_is_skipped_not_blocking_the_others(
    engine: sa.Engine, caplog: pytest.LogCaptureFixture
) -> None:
    """Trial finding: a stale id (999, no such tenant) failed the slot's insert on the
    tenant foreign key for every tenant, and the relay retried it every half second."""
    catalog = fan_out_catalog(
        {
            "cron": "*/5 * * * *",
            "tenants": {"query": "SELECT id FROM tenants WHERE id <= 2 UNION ALL SELECT 999"},
        }
    )
    with engine.connect() as conn, caplog.at_level(logging.WARNING):
        assert Scheduler(catalog, tenant_foreign_key="tenants.id").tick(conn) == 2
    assert sorted(r.tenant_id for r in runs(engine)) == [1, 2]
    [skipped] = [
        r.sqla_outbox
        for r in caplog.records
        if getattr(r, "sqla_outbox", {}).get("action") == "relay.schedule_tenants_missing"
    ]
    assert (skipped["tenants"], skipped["count"]) == ("999", 1)


@pytest.mark.parametrize(
    ("scope", "schedule", "message"),
    [
        ("platform", {"every_seconds": 60, "tenants": {"table": "tenants"}}, "forbids it"),
        ("tenant", {"every_seconds": 60}, "unless its schedule lists tenants"),
        ("tenant", {"every_seconds": 60, "tenants": {"table": "tenants; drop"}}, "does not match"),
    ],
)
def test_fan_out_declarations_are_checked(scope: str, schedule: dict, message: str) -> None:
    doc = json.loads(json.dumps(CATALOG))
    doc["tasks"]["audit"].update(scope=scope, schedule=schedule)
    with pytest.raises(errors.CatalogError, match=message):
        Catalog.from_dict(doc)
