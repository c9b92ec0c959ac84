"""A queue of the application's own, end to end: declare it in the catalog, widen the
queue CHECK with the migration operation, provision it (and its DLQ) with ``provision``,
dispatch to it, and consume it with a worker that names it."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import pytest
import sqlalchemy as sa
from alembic.migration import MigrationContext
from alembic.operations import Operations
from sqlalchemy.orm import Session, sessionmaker

from sqla_outbox import Dispatch, errors
from sqla_outbox.catalog import Catalog
from sqla_outbox.config import OutboxSettings
from sqla_outbox.migrations import queues as outbox_queues
from tests import support
from tests.support import effects, run_row, start_relay, start_worker, status_of, wait_for

pytestmark = pytest.mark.e2e

CATALOG = {
    **support.CATALOG,
    "queues": {"reminders": {"visibility_timeout_seconds": 1800, "max_receive_count": 9, "weight": 3}},
    "tasks": {**support.CATALOG["tasks"], "remind": {"queue": "reminders", "scope": "tenant"}},
}


@pytest.fixture
def catalog() -> Catalog:
    return Catalog.from_dict(CATALOG)


def migrate_queue_check(engine: sa.Engine, queues: list[str], previous: list[str]) -> None:
    """What the application's generated revision does: ``op.set_outbox_queues(...)``."""
    with engine.begin() as conn:
        Operations(MigrationContext.configure(conn)).set_outbox_queues(queues, previous=previous)  # type: ignore[attr-defined]


def provision_cli(settings: OutboxSettings, endpoint: str, *args: str) -> tuple[int, list[dict[str, Any]]]:
    result = subprocess.run(
        [sys.executable, "-m", "sqla_outbox", "provision", "--json", *args],
        env=support.service_env(settings, endpoint),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode in (0, 1), result.stderr
    return result.returncode, json.loads(result.stdout)


def attributes(sqs: Any, name: str) -> dict[str, str]:
    url = sqs.get_queue_url(QueueName=name)["QueueUrl"]
    return dict(sqs.get_queue_attributes(QueueUrl=url, AttributeNames=["All"])["Attributes"])


def test_a_declared_queue_end_to_end(
    app: sessionmaker[Session],
    engine: sa.Engine,
    settings: OutboxSettings,
    sqs_endpoint: str,
    sqs: Any,
) -> None:
    # before the migration the database refuses the queue: the dispatch fails at flush
    with app() as session, pytest.raises(sa.exc.IntegrityError, match="queue_check"), session.begin():
        session.add(Dispatch("remind", {"mode": "ok"}, tenant_id=1))
    migrate_queue_check(engine, ["reminders"], [])
    with engine.connect() as conn:
        assert outbox_queues.current_queues(conn) == ("reminders",)

    # provision: the four, plus reminders and its DLQ; the setting overrides the catalog's 1800 s
    code, report = provision_cli(settings, sqs_endpoint, "--visibility", "reminders=900")
    assert code == 0
    made = {(r["queue"], r["dead_letter"]): r["action"] for r in report}
    assert made[("reminders", False)] == made[("reminders", True)] == "created"
    source = attributes(sqs, f"{settings.queue_prefix}reminders")
    assert source["VisibilityTimeout"] == "900"
    assert json.loads(source["RedrivePolicy"])["maxReceiveCount"] == 9
    assert json.loads(source["RedrivePolicy"])["deadLetterTargetArn"].endswith(
        f"{settings.queue_prefix}reminders-dlq"
    )
    assert attributes(sqs, f"{settings.queue_prefix}critical")["VisibilityTimeout"] == "60"

    # a visibility setting for one of the four: drift reported, then fixed
    code, report = provision_cli(settings, sqs_endpoint, "--visibility", "reminders=900,critical=90")
    assert code == 1
    assert [r["queue"] for r in report if r["action"] == "drift"] == ["critical", "critical"]
    code, _ = provision_cli(settings, sqs_endpoint, "--visibility", "reminders=900,critical=90", "--fix")
    assert attributes(sqs, f"{settings.queue_prefix}critical")["VisibilityTimeout"] == "90"

    status = subprocess.run(  # status reads the declared queue's depth too
        [sys.executable, "-m", "sqla_outbox", "status", "--json"],
        env=support.service_env(settings, sqs_endpoint),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert f"{settings.queue_prefix}reminders-dlq" in status.stdout, status.stderr

    with app() as session, session.begin():
        item = Dispatch("remind", {"mode": "ok"}, tenant_id=1)
        session.add(item)
    assert run_row(engine, item.run_id).queue == "reminders"
    relay = start_relay(settings, sqs_endpoint)
    worker = start_worker(
        settings,
        sqs_endpoint,
        imports="tests.e2e.queue_tasks",
        SQLA_OUTBOX_WORKER_QUEUES="reminders",
    )
    try:
        started = worker.wait_for_action("worker.started")
        assert "reminders" in str(started.get("queues"))
        wait_for(lambda: status_of(engine, item.run_id) == "succeeded", timeout=30)
        assert len(effects(engine, item.run_id)) == 1
        assert worker.terminate() == 0
    finally:
        worker.kill()
        relay.kill()


def test_a_worker_naming_an_undeclared_queue_refuses_to_start(
    settings: OutboxSettings, sqs_endpoint: str
) -> None:
    worker = start_worker(settings, sqs_endpoint, SQLA_OUTBOX_WORKER_QUEUES="default,nightly")
    assert worker.process.wait(timeout=60) == 2
    assert "unknown queue(s) 'nightly'" in "".join(worker.raw)


def test_an_undeclared_queue_is_refused_at_add(app: sessionmaker[Session]) -> None:
    with app() as session, pytest.raises(errors.UnknownQueue, match="unknown queue 'nightly'"):
        session.add(Dispatch("audit", {}, queue="nightly"))


def test_a_declared_queues_pending_gauge_reads_zero_once_it_drains(
    app: sessionmaker[Session],
    engine: sa.Engine,
    settings: OutboxSettings,
    sqs_endpoint: str,
) -> None:
    """The relay resets the pending gauges of every queue of its registry, declared ones
    included: a drained declared queue must not keep its last backlog (the "relay lagging"
    alert would fire until the relay restarted)."""
    import urllib.request

    from sqla_outbox import flow

    migrate_queue_check(engine, ["reminders"], [])
    code, _ = provision_cli(settings, sqs_endpoint)
    assert code == 0
    with engine.begin() as conn:  # held pending by the relay while paused
        flow.pause(conn, queue="reminders", by="test")
    with app() as session, session.begin():
        session.add_all([Dispatch("remind", {"mode": "ok", "n": n}, tenant_id=1) for n in range(2)])
    port = support.free_port()
    relay = start_relay(settings, sqs_endpoint, SQLA_OUTBOX_HEALTH_PORT=str(port))

    def gauge() -> str | None:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
            for line in response.read().decode().splitlines():
                if line.startswith(
                    'sqla_outbox_relay_pending_rows{queue="reminders",table="outbox_messages"}'
                ):
                    return line.rsplit(" ", 1)[1]
        return None

    try:
        relay.wait_for_action("relay.leader")
        wait_for(lambda: gauge() == "2.0", timeout=20)
        with engine.begin() as conn:
            flow.resume(conn, queue="reminders")
        wait_for(lambda: all(r.sent_at is not None for r in support.outbox_rows(engine)), timeout=20)
        wait_for(lambda: gauge() == "0.0", timeout=20)  # the next refresh (every 5 s) zeroes it
    finally:
        assert relay.terminate() == 0
