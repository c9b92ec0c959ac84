"""Pause and resume with real relay and worker subprocesses, the CLI, moto and PostgreSQL:
a pause during a backlog, a pause that survives a relay ``kill -9``, and a run deferred
50 times by a pause that still succeeds on its first real attempt."""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.orm import Session, sessionmaker

from sqla_outbox import Dispatch, flow
from sqla_outbox.config import OutboxSettings
from sqla_outbox.relay import claim
from sqla_outbox.relay.send import SqsSender
from sqla_outbox.sqs.client import QueueDirectory
from tests import support
from tests.support import (
    effects,
    receive_all,
    run_row,
    service_env,
    start_relay,
    start_worker,
    trail,
    wait_for,
)

pytestmark = pytest.mark.e2e


def cli_json(env: dict[str, str], *args: str) -> Any:
    result = support.run_cli(env, *args, "--json")
    assert result.returncode == 0, result.stdout + result.stderr
    return json.loads(result.stdout)


def dispatch_many(app: sessionmaker[Session], count: int, tenant: int = 1, **payload: Any) -> list[uuid.UUID]:
    with app() as session, session.begin():
        items = [Dispatch("audit", {"mode": "ok", **payload}, tenant_id=tenant) for _ in range(count)]
        session.add_all(items)
    return [item.run_id for item in items]


def statuses(engine: sa.Engine, run_ids: list[uuid.UUID]) -> dict[str, int]:
    with engine.connect() as conn:
        rows = conn.execute(
            sa.text("SELECT status, count(*) FROM task_runs WHERE run_id = ANY(:ids) GROUP BY status"),
            {"ids": run_ids},
        )
        return {str(s): int(n) for s, n in rows}


def test_pause_during_a_backlog_then_resume(
    app: sessionmaker[Session],
    engine: sa.Engine,
    settings: OutboxSettings,
    sqs_endpoint: str,
    queues: dict[str, str],
    sqs: Any,
) -> None:
    env = service_env(settings, sqs_endpoint)
    worker = start_worker(settings, sqs_endpoint, SQLA_OUTBOX_WORKER_RUN_RELAY="true")
    worker.wait_for_action("worker.started")
    try:
        runs = dispatch_many(app, 300, mode="sleep", seconds=0.05)
        wait_for(lambda: statuses(engine, runs).get("succeeded", 0) >= 20, timeout=60)
        paused = cli_json(env, "pause", "--task", "audit", "--reason", "provider incident", "--by", "oncall")
        assert paused == {"scope": "task", "target": "audit", "paused": True, "already_paused": False}
        time.sleep(3)  # the worker re-reads pauses every second; handlers in flight finish
        settled = statuses(engine, runs).get("succeeded", 0)
        time.sleep(3)
        assert statuses(engine, runs).get("succeeded", 0) == settled  # nothing more ran
        assert settled < 300
        waiting = statuses(engine, runs)
        assert set(waiting) == {"succeeded", "queued"}, waiting
        listed = cli_json(env, "flow", "list")
        assert [(p["scope"], p["target"], p["paused_by"]) for p in listed["pauses"]] == [
            ("task", "audit", "oncall")
        ]
        with engine.connect() as conn:  # the rest waits in the outbox, nothing spent
            queued = conn.execute(
                sa.text(
                    "SELECT count(*), max(r.attempts) FROM task_runs r JOIN outbox_messages o USING (run_id) "
                    "WHERE r.status = 'queued' AND o.sent_at IS NULL"
                )
            ).one()
        assert queued[0] == waiting["queued"] and queued[1] == 0
        resumed_at = time.monotonic()
        answer = cli_json(env, "resume", "--task", "audit")
        assert answer["was_paused"] is True
        wait_for(lambda: statuses(engine, runs) == {"succeeded": 300}, timeout=120)
        assert time.monotonic() - resumed_at < 60
        with engine.connect() as conn:
            attempts = conn.execute(
                sa.text("SELECT max(attempts), min(attempts) FROM task_runs WHERE run_id = ANY(:ids)"),
                {"ids": runs},
            ).one()
        assert tuple(attempts) == (1, 1)
        assert len(effects(engine)) == 300
        assert receive_all(sqs, queues["default-dlq"]) == []
    finally:
        worker.kill()


def test_a_pause_survives_a_relay_kill_and_resume_releases_at_once(
    app: sessionmaker[Session],
    engine: sa.Engine,
    settings: OutboxSettings,
    sqs_endpoint: str,
    queues: dict[str, str],
) -> None:
    env = service_env(settings, sqs_endpoint)
    cli_json(env, "pause", "--tenant", "3")
    runs = dispatch_many(app, 5, tenant=3)
    other = dispatch_many(app, 1, tenant=4)
    relay = start_relay(settings, sqs_endpoint)
    second = None
    try:
        relay.wait_for_action("relay.leader")

        def sent(ids: list[uuid.UUID]) -> int:
            with engine.connect() as conn:
                return int(
                    conn.execute(
                        sa.text(
                            "SELECT count(*) FROM outbox_messages "
                            "WHERE run_id = ANY(:ids) AND sent_at IS NOT NULL"
                        ),
                        {"ids": ids},
                    ).scalar_one()
                )

        wait_for(lambda: sent(other) == 1, timeout=20)
        time.sleep(1.5)
        assert sent(runs) == 0
        relay.process.kill()  # kill -9
        relay.process.wait(10)
        second = start_relay(settings, sqs_endpoint, name="relay2")
        second.wait_for_action("relay.leader")
        time.sleep(2)
        assert sent(runs) == 0  # the pause is in PostgreSQL: the new relay keeps them pending
        assert [p["target"] for p in cli_json(env, "flow", "list")["pauses"]] == ["3"]
        shown = cli_json(env, "status", "--no-sqs")
        assert [(p["scope"], p["target"]) for p in shown["pauses"]] == [("tenant", "3")]
        assert shown["throttled"] == []
        started = time.monotonic()
        answer = cli_json(env, "resume", "--tenant", "3")
        assert answer["released"] == 5
        wait_for(lambda: sent(runs) == 5, timeout=10)
        assert time.monotonic() - started < 5  # at once: released rows and a woken relay
    finally:
        relay.kill()
        if second is not None:
            second.kill()


def test_a_run_deferred_50_times_by_a_pause_succeeds_on_its_first_attempt(
    app: sessionmaker[Session],
    engine: sa.Engine,
    settings: OutboxSettings,
    sqs_endpoint: str,
    queues: dict[str, str],
    sqs: Any,
) -> None:
    """Messages already in SQS when a task is paused go back to the outbox without the
    handler and without spending the run's receive budget, however often it happens."""
    worker = start_worker(settings, sqs_endpoint, SQLA_OUTBOX_FLOW_REFRESH_SECONDS="0.1")
    worker.wait_for_action("worker.started")
    sender = SqsSender(sqs, QueueDirectory(sqs, settings), settings)
    try:
        with engine.begin() as conn:
            flow.pause(conn, task="audit", by="test")
        [run_id] = dispatch_many(app, 1)

        def deferrals() -> int:
            return sum(1 for t in trail(engine, run_id) if (t.detail or {}).get("deferred") == "paused")

        for n in range(1, 51):
            # a relay that has not seen the pause yet sends the run (the race a pause can meet)
            with engine.connect() as conn, conn.begin():
                conn.execute(sa.text("UPDATE outbox_messages SET available_at = clock_timestamp()"))
                rows = claim.claim(conn, "outbox_messages", limit=10)
                assert len(rows) == 1
                outcome = sender.send(rows)
                assert len(outcome.sent) == 1
                claim.mark_sent(conn, "outbox_messages", [rows[0].id])
            wait_for(lambda n=n: deferrals() == n, timeout=20)
        run = run_row(engine, run_id)
        assert (run.status, run.attempts) == ("queued", 0)
        assert effects(engine, run_id) == []  # the handler never ran
        with engine.begin() as conn:
            assert flow.resume(conn, task="audit") == (True, 1)
        relay = start_relay(settings, sqs_endpoint)
        try:
            wait_for(lambda: run_row(engine, run_id).status == "succeeded", timeout=30)
        finally:
            relay.kill()
        run = run_row(engine, run_id)
        assert run.attempts == 1
        [running] = [t for t in trail(engine, run_id) if t.status == "running"]
        assert (running.attempt, running.receive_count) == (1, 1)  # receive budget untouched
        assert deferrals() == 50
        assert len(effects(engine, run_id)) == 1
        assert receive_all(sqs, queues["default-dlq"]) == []
        assert receive_all(sqs, queues["default"]) == []
    finally:
        sender.close()
        worker.kill()


def test_a_noisy_tenant_does_not_delay_a_quiet_one(
    app: sessionmaker[Session],
    engine: sa.Engine,
    settings: OutboxSettings,
    sqs_endpoint: str,
    queues: dict[str, str],
    sqs: Any,
) -> None:
    """Small scale, real processes: tenant 1 commits 2,000 runs in one transaction, tenant
    2 then commits one; the quiet run starts within 2 s while the backlog stays in the
    outbox (SQS holds at most about ``relay_queue_depth`` messages)."""
    relay = start_relay(settings, sqs_endpoint)
    worker = start_worker(settings, sqs_endpoint)
    try:
        worker.wait_for_action("worker.started")
        relay.wait_for_action("relay.workers")  # the relay has seen the worker: the depth bound applies
        noisy = dispatch_many(app, 2000, tenant=1)
        wait_for(lambda: statuses(engine, noisy).get("succeeded", 0) >= 30, timeout=60)
        [quiet] = dispatch_many(app, 1, tenant=2)
        wait_for(lambda: run_row(engine, quiet).started_at is not None, timeout=20, interval=0.02)
        run = run_row(engine, quiet)
        assert (run.started_at - run.created_at).total_seconds() < 2.0
        assert statuses(engine, noisy).get("succeeded", 0) < 2000  # the backlog was still there
        depth = sqs.get_queue_attributes(
            QueueUrl=queues["default"], AttributeNames=["ApproximateNumberOfMessages"]
        )["Attributes"]["ApproximateNumberOfMessages"]
        assert int(depth) <= 40  # the bound (20 for one worker) plus a pass in flight
        wait_for(lambda: run_row(engine, quiet).status == "succeeded", timeout=20)
    finally:
        worker.kill()
        relay.kill()
