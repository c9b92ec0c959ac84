"""Groups and chains with real relay and worker processes, moto SQS and PostgreSQL."""

from __future__ import annotations

import json
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.orm import Session, sessionmaker

from sqla_outbox import Dispatch, Group
from sqla_outbox.config import OutboxSettings
from tests.support import effects, run_row, set_visibility, start_relay, start_worker, status_of, wait_for

pytestmark = pytest.mark.e2e


def finished(engine: sa.Engine, run_id: uuid.UUID) -> bool:
    return status_of(engine, run_id) in ("succeeded", "failed")


def completion_exists(engine: sa.Engine, group: Group) -> bool:
    with engine.connect() as conn:
        return bool(
            conn.execute(
                sa.text("SELECT count(*) FROM task_runs WHERE run_id = :r"), {"r": group.completion_run_id}
            ).scalar_one()
        )


def completion_effects(engine: sa.Engine, group: Group) -> list[Any]:
    wait_for(lambda: completion_exists(engine, group), timeout=30)
    wait_for(lambda: finished(engine, group.completion_run_id), timeout=30)
    time.sleep(1.5)  # a second completion, if one were written, would have run by now
    return effects(engine, group.completion_run_id)


def test_two_members_finishing_together_on_two_workers_complete_the_group_once(
    app: sessionmaker[Session],
    engine: sa.Engine,
    settings: OutboxSettings,
    sqs_endpoint: str,
    queues: dict[str, str],
    tmp_path: Path,
) -> None:
    relay = start_relay(settings, sqs_endpoint)
    workers = [
        start_worker(settings, sqs_endpoint, name=f"w{i}", SQLA_OUTBOX_WORKER_CONCURRENCY="1")
        for i in range(2)
    ]
    try:
        for w in workers:
            w.wait_for_action("worker.started")
        with app() as session, session.begin():
            group = Group(
                [Dispatch("audit", {"mode": "barrier", "dir": str(tmp_path), "n": 2}) for _ in range(2)],
                on_complete=Dispatch("send_welcome", {"mode": "group_done"}),
            )
            session.add(group)
        done = completion_effects(engine, group)
        members = [m.run_id for m in group.members]
        assert len(done) == 1
        assert json.loads(done[0].note) == {str(m): "succeeded" for m in members}
        # the two members really ran on the two workers, at the same time
        ran_on = {e.worker for m in members for e in effects(engine, m)}
        assert len(ran_on) == 2
    finally:
        for w in workers:
            w.kill()
        relay.kill()


def test_worker_killed_while_finishing_the_last_member_completes_once_after_redelivery(
    app: sessionmaker[Session],
    engine: sa.Engine,
    settings: OutboxSettings,
    sqs_endpoint: str,
    sqs: Any,
    queues: dict[str, str],
) -> None:
    """The last member's finishing transaction is caught mid-way: its status update ran (the
    trigger waits on the group row, which this test holds locked) when the worker is killed
    with SIGKILL. That transaction never commits; the message comes back, a second worker
    runs the member again and its finish writes the completion, once."""
    set_visibility(sqs, queues["default"], 3)
    relay = start_relay(settings, sqs_endpoint)
    first = start_worker(settings, sqs_endpoint, name="first")
    second = None
    try:
        with app() as session, session.begin():
            group = Group(
                [Dispatch("audit", {"mode": "ok"})],
                on_complete=Dispatch("send_welcome", {"mode": "group_done"}),
            )
            session.add(group)
        member = group.members[0].run_id
        with engine.connect() as holder:
            holder.execute(
                sa.text("SELECT 1 FROM task_groups WHERE id = :g FOR UPDATE"), {"g": group.group_id}
            )

            def finishing_blocked() -> bool:
                with engine.connect() as probe:  # its own transaction: a fresh statistics snapshot
                    return bool(
                        probe.execute(
                            sa.text(
                                "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
                                "AND cardinality(pg_blocking_pids(pid)) > 0"
                            )
                        ).scalar_one()
                    )

            wait_for(finishing_blocked, timeout=30)
            first.kill()  # SIGKILL while its finishing transaction waits on the group row
            holder.rollback()
        assert not completion_exists(engine, group)
        second = start_worker(settings, sqs_endpoint, name="second")
        done = completion_effects(engine, group)
        assert len(done) == 1
        assert json.loads(done[0].note) == {str(member): "succeeded"}
        run = run_row(engine, member)
        assert (run.status, run.attempts) == ("succeeded", 2)
        assert len(effects(engine, member)) == 1
    finally:
        first.kill()
        if second is not None:
            second.kill()
        relay.kill()


# --- chains: a handler's dispatches commit with its success ----------------------------
def dispatch(app: sessionmaker[Session], task: str, payload: dict[str, Any]) -> uuid.UUID:
    with app() as session, session.begin():
        item = Dispatch(task, payload)
        session.add(item)
    return item.run_id


def follow_ups(engine: sa.Engine, parent: uuid.UUID) -> list[Any]:
    with engine.connect() as conn:
        return list(
            conn.execute(
                sa.text(
                    "SELECT r.run_id, r.status FROM task_runs r JOIN platform_outbox_messages o "
                    "USING (run_id) WHERE r.task = 'send_welcome' AND o.envelope->>'payload' LIKE :p"
                ),
                {"p": f"%{parent}%"},
            )
        )


def test_chain_the_follow_up_runs_after_the_parent_succeeded(
    app: sessionmaker[Session], engine: sa.Engine, worker_with_relay: Any
) -> None:
    worker_with_relay()
    parent = dispatch(app, "audit", {"mode": "followup_then"})
    wait_for(lambda: finished(engine, parent), timeout=20)
    (child,) = wait_for(lambda: follow_ups(engine, parent), timeout=10)
    wait_for(lambda: finished(engine, child.run_id), timeout=20)
    assert status_of(engine, child.run_id) == "succeeded"


def test_chain_a_failed_parent_never_writes_its_follow_up(
    app: sessionmaker[Session], engine: sa.Engine, worker_with_relay: Any
) -> None:
    worker_with_relay()
    parent = dispatch(app, "audit", {"mode": "followup_then", "then": "permanent"})
    wait_for(lambda: finished(engine, parent), timeout=20)
    assert status_of(engine, parent) == "failed"
    time.sleep(1)
    assert follow_ups(engine, parent) == []


def test_chain_a_retried_parent_writes_its_follow_up_once_by_the_attempt_that_succeeds(
    app: sessionmaker[Session], engine: sa.Engine, worker_with_relay: Any
) -> None:
    worker_with_relay()
    parent = dispatch(app, "audit", {"mode": "followup_then", "then": "fail_times", "times": 2})
    wait_for(lambda: finished(engine, parent), timeout=30)
    assert (status_of(engine, parent), run_row(engine, parent).attempts) == ("succeeded", 3)
    (child,) = follow_ups(engine, parent)
    with engine.connect() as conn:
        created = conn.execute(
            sa.text("SELECT created_at FROM task_runs WHERE run_id = :r"), {"r": child.run_id}
        ).scalar_one()
        third_started = conn.execute(
            sa.text("SELECT at FROM task_run_trail WHERE run_id = :r AND status = 'running' AND attempt = 3"),
            {"r": parent},
        ).scalar_one()
    assert created > third_started  # written by the third attempt, the one that succeeded
    wait_for(lambda: finished(engine, child.run_id), timeout=20)
