"""Rolling deploys with real relay and worker processes running different code.

"Old" workers import ``tests.e2e.rolling_old_tasks`` (``audit``); "new" workers import
``tests.e2e.rolling_new_tasks`` (``audit`` and ``send_welcome``). A run of
``send_welcome`` must wait for a new worker without spending an attempt, a receive of
its final message, or reaching a DLQ; ``status`` must say it waits, and for how long.
"""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.orm import Session, sessionmaker

from sqla_outbox import Dispatch
from sqla_outbox.config import OutboxSettings
from tests.support import (
    ServiceProcess,
    effects,
    outbox_rows,
    receive_all,
    run_row,
    service_env,
    start_relay,
    start_worker,
    trail,
    wait_for,
)

pytestmark = pytest.mark.e2e

OLD, NEW = "tests.e2e.rolling_old_tasks", "tests.e2e.rolling_new_tasks"


@pytest.fixture
def services(settings: OutboxSettings, sqs_endpoint: str, queues: dict[str, str]) -> Iterator[Any]:
    started: list[ServiceProcess] = []

    def start(kind: str, imports: str = "", **extra: str) -> ServiceProcess:
        name = f"{kind}{len(started)}"
        if kind == "relay":
            process = start_relay(settings, sqs_endpoint, name=name, **extra)
            process.wait_for_action("relay.leader")
        else:
            process = start_worker(
                settings,
                sqs_endpoint,
                name=name,
                imports=imports,
                SQLA_OUTBOX_WORKER_QUEUES="default",
                **extra,
            )
            process.wait_for_action("worker.started")
        started.append(process)
        return process

    yield start
    for process in started:
        process.kill()
        print(f"--- {process.name} log (tail) ---\n" + "".join(process.raw[-40:]))  # shown on failure


def dispatch(app: sessionmaker[Session], task: str) -> uuid.UUID:
    with app() as session, session.begin():
        item = Dispatch(task, {"mode": "ok"}, tenant_id=1)
        session.add(item)
    return item.run_id


def no_dead_letters(sqs: Any, queues: dict[str, str]) -> bool:
    return receive_all(sqs, queues["default-dlq"], visibility=0) == []


def test_an_old_worker_leaves_a_new_task_to_a_new_worker_without_spending_anything(
    app: sessionmaker[Session], engine: sa.Engine, services: Any, sqs: Any, queues: dict[str, str]
) -> None:
    """The relay sends regardless (holding off): the old worker receives the run, has no
    handler, and defers it to the outbox again and again; a new worker starts, the old one
    is stopped (a rolling deploy), and the new worker runs it once, from a fresh message."""
    services("relay", SQLA_OUTBOX_RELAY_HOLD_UNSERVED="false")
    old = services("worker", OLD)
    run_id = dispatch(app, "send_welcome")
    old.wait_for_action("worker.deferred", count=2, timeout=30)
    run = run_row(engine, run_id)
    assert (run.status, run.attempts) == ("queued", 0)
    deferrals = [t for t in trail(engine, run_id) if t.detail and "deferred" in t.detail]
    assert [t.detail["deferrals"] for t in deferrals][:2] == [1, 2]
    assert all(t.detail["deferred"] == "no-handler" and t.status == "queued" for t in deferrals)
    assert all(t.receive_count == 1 for t in deferrals)  # each time a fresh message, received once

    services("worker", NEW)
    assert old.terminate() == 0  # (while both run, either may receive it: the old one defers again)
    wait_for(lambda: run_row(engine, run_id).status == "succeeded", timeout=90)
    run = run_row(engine, run_id)
    assert run.attempts == 1
    [running] = [t for t in trail(engine, run_id) if t.status == "running"]
    assert running.receive_count == 1
    assert len(effects(engine, run_id)) == 1
    assert no_dead_letters(sqs, queues)
    assert old.actions("worker.foreign") == []


def test_the_relay_keeps_a_task_no_running_worker_implements_pending_and_status_says_so(
    app: sessionmaker[Session],
    engine: sa.Engine,
    services: Any,
    sqs: Any,
    queues: dict[str, str],
    settings: OutboxSettings,
    sqs_endpoint: str,
) -> None:
    relay = services("relay")
    old = services("worker", OLD)
    relay.wait_for_action("relay.workers", timeout=20)  # the relay knows the old worker
    held = dispatch(app, "send_welcome")
    served = dispatch(app, "audit")
    wait_for(lambda: run_row(engine, served).status == "succeeded", timeout=30)
    row = next(r for r in outbox_rows(engine) if r.run_id == held)
    assert (row.sent_at, row.attempts) == (None, 0)  # never sent: nothing cycles through SQS
    assert old.actions("worker.deferred") == []

    env = service_env(settings, sqs_endpoint)
    report = wait_for(lambda: _status(env)["waiting_for_a_worker"], timeout=20)
    assert [(w["task"], w["queue"], w["pending"]) for w in report] == [("send_welcome", "default", 1)]
    assert report[0]["waited_seconds"] > 0
    human = subprocess.run(
        [sys.executable, "-m", "sqla_outbox", "status", "--no-sqs"], capture_output=True, text=True, env=env
    )
    assert "Waiting for a worker" in human.stdout and "send_welcome" in human.stdout

    services("worker", NEW)
    wait_for(lambda: run_row(engine, held).status == "succeeded", timeout=60)
    assert run_row(engine, held).attempts == 1
    assert len(effects(engine, held)) == 1
    assert no_dead_letters(sqs, queues)
    assert _status(env)["waiting_for_a_worker"] == []


def _status(env: dict[str, str]) -> Any:
    result = subprocess.run(
        [sys.executable, "-m", "sqla_outbox", "status", "--no-sqs", "--json"],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return json.loads(result.stdout)
