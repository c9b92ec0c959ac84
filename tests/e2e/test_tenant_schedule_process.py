"""A schedule fanned out to tenants, run by a real relay process (killed and restarted)
and a real worker: each tenant gets each slot once; after downtime only the latest missed
slot is dispatched, for every tenant."""

from __future__ import annotations

import datetime as dt
import itertools
import json
import time

import pytest
import sqlalchemy as sa

from sqla_outbox.catalog import Catalog
from sqla_outbox.config import OutboxSettings
from tests import support
from tests.support import outbox_rows, start_relay, start_worker, wait_for

pytestmark = pytest.mark.e2e

EVERY = 2


@pytest.fixture
def catalog() -> Catalog:
    doc = json.loads(json.dumps(support.CATALOG))
    doc["tasks"]["charge_card"]["schedule"] = {
        "every_seconds": EVERY,
        "tenants": {"query": "SELECT id FROM tenants WHERE id IN (2, 5, 7)"},
    }
    return Catalog.from_dict(doc)


def slots(engine: sa.Engine) -> dict[int, list[dt.datetime]]:
    out: dict[int, list[dt.datetime]] = {}
    for row in outbox_rows(engine):
        if row.kind == "tenant":
            out.setdefault(row.tenant_id, []).append(
                dt.datetime.fromisoformat(json.loads(row.envelope["payload"])["slot"])
            )
    return {tenant: sorted(found) for tenant, found in out.items()}


def test_fan_out_fires_once_per_tenant_per_slot_and_catches_up_a_missed_slot(
    engine: sa.Engine, settings: OutboxSettings, sqs_endpoint: str, queues: dict[str, str]
) -> None:
    relay = start_relay(settings, sqs_endpoint)
    worker = start_worker(settings, sqs_endpoint, SQLA_OUTBOX_WORKER_QUEUES="critical")
    try:
        wait_for(lambda: len(slots(engine).get(2, [])) >= 2, timeout=30)
        relay.kill()  # SIGKILL: the relay is down for several slots
        down_at = time.time()
        time.sleep(3 * EVERY + 0.5)
        before = slots(engine)
        relay = start_relay(settings, sqs_endpoint, name="relay2")
        wait_for(lambda: len(slots(engine)[2]) > len(before[2]), timeout=30)
        time.sleep(EVERY + 0.5)
        relay.terminate()
        found = slots(engine)
        assert sorted(found) == [2, 5, 7]
        assert found[2] == found[5] == found[7]  # every slot went to every tenant, in one transaction
        per_tenant = found[2]
        assert len(per_tenant) == len(set(per_tenant))  # no slot twice for a tenant
        gaps = [(b - a).total_seconds() for a, b in itertools.pairwise(per_tenant)]
        assert all(g % EVERY == 0 for g in gaps)
        # the downtime: several slots passed, only the latest one was dispatched after restart
        caught_up = [b for a, b in itertools.pairwise(per_tenant) if (b - a).total_seconds() > EVERY]
        assert len(caught_up) == 1
        assert caught_up[0].timestamp() > down_at + 2 * EVERY

        def unfinished() -> int:
            with engine.connect() as conn:
                return int(
                    conn.execute(
                        sa.text(
                            "SELECT count(*) FROM task_runs "
                            "WHERE task = 'charge_card' AND status <> 'succeeded'"
                        )
                    ).scalar_one()
                )

        wait_for(lambda: unfinished() == 0, timeout=30)  # the worker ran every tenant's runs
        with engine.connect() as conn:
            stored = conn.execute(
                sa.text("SELECT tenant_id, last_slot FROM schedule_tenant_slots ORDER BY tenant_id")
            ).all()
        assert [t for t, _ in stored] == [2, 5, 7]
    finally:
        relay.kill()
        worker.kill()
