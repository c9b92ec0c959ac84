"""Issue 17, part 3: an idle worker stops within 2 s of SIGTERM, and a message its pending
poll brings during the stop is neither lost nor run twice (real processes, moto, PostgreSQL)."""

from __future__ import annotations

import signal
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.orm import Session, sessionmaker

from sqla_outbox import Dispatch
from sqla_outbox.config import OutboxSettings
from tests.support import effects, receive_all, run_row, start_relay, start_worker, trail, wait_for

pytestmark = pytest.mark.e2e

DEFAULT_WAIT = str(OutboxSettings().worker_wait_seconds)  # the library's default, not the tests' 1 s


def _dispatch(app: sessionmaker[Session]) -> uuid.UUID:
    with app() as session, session.begin():
        item = Dispatch("audit", {"mode": "ok"})
        session.add(item)
    return item.run_id


def _wait_for_import(worker: Any, marker: Path) -> None:
    """Until the worker imports ``slow_import_tasks`` (it creates ``marker`` first): by then
    its stop signals are installed. A fixed sleep lost that race on CI's loaded machine,
    where the interpreter took longer than the sleep to start."""
    wait_for(lambda: marker.exists() or worker.process.poll() is not None, timeout=60)
    assert worker.process.poll() is None


def _stop_seconds(process: Any) -> float:
    started = time.monotonic()
    process.process.send_signal(signal.SIGTERM)
    assert process.process.wait(30) == 0
    return time.monotonic() - started


@pytest.mark.parametrize("idle_seconds", [0.4, 1.3, 2.7])
def test_an_idle_worker_stops_within_two_seconds(
    settings: OutboxSettings, sqs_endpoint: str, queues: dict[str, str], idle_seconds: float
) -> None:
    """Whatever the phase of its long polls (SQS cannot cancel one, so the poll is short)."""
    worker = start_worker(settings, sqs_endpoint, name="idle", SQLA_OUTBOX_WORKER_WAIT_SECONDS=DEFAULT_WAIT)
    try:
        worker.wait_for_action("worker.started")
        time.sleep(idle_seconds)
        assert _stop_seconds(worker) < 2.0
        assert worker.actions("worker.stopped")
    finally:
        worker.kill()


def test_a_sigterm_during_start_up_is_a_graceful_stop(
    settings: OutboxSettings, sqs_endpoint: str, queues: dict[str, str], tmp_path: Path
) -> None:
    """A SIGTERM while the worker still imports its task modules is kept for the moment
    its loop starts (exit 0, stopped before receiving), not the default action (exit 143);
    a second one during start-up ends it at once, so a hung start-up still yields."""
    imports = "tests.e2e.worker_tasks,tests.e2e.slow_import_tasks"
    marker = tmp_path / "importing"
    worker = start_worker(
        settings,
        sqs_endpoint,
        name="early",
        imports=imports,
        SLOW_IMPORT_SECONDS="3",
        SLOW_IMPORT_MARKER=str(marker),
    )
    try:
        _wait_for_import(worker, marker)  # the slow module is being imported
        worker.process.send_signal(signal.SIGTERM)
        assert worker.process.wait(30) == 0
        assert worker.actions("worker.stopped")
    finally:
        worker.kill()
    marker = tmp_path / "importing-again"
    twice = start_worker(
        settings,
        sqs_endpoint,
        name="early2",
        imports=imports,
        SLOW_IMPORT_SECONDS="30",
        SLOW_IMPORT_MARKER=str(marker),
    )
    try:
        _wait_for_import(twice, marker)
        twice.process.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        assert twice.process.poll() is None  # the first one is kept for the loop
        twice.process.send_signal(signal.SIGTERM)
        assert twice.process.wait(10) == -signal.SIGTERM
    finally:
        twice.kill()


def test_a_busy_worker_stop_is_bounded_by_its_budget(
    app: sessionmaker[Session],
    engine: sa.Engine,
    settings: OutboxSettings,
    sqs_endpoint: str,
    queues: dict[str, str],
) -> None:
    """A handler still running after the stop budget is cancelled and its run requeued; the
    stop takes the budget plus the give-back, not the handler's 30 s."""
    relay = start_relay(settings, sqs_endpoint)
    worker = start_worker(
        settings,
        sqs_endpoint,
        name="busy",
        SQLA_OUTBOX_WORKER_WAIT_SECONDS=DEFAULT_WAIT,
        SQLA_OUTBOX_WORKER_STOP_BUDGET_SECONDS="2",
    )
    try:
        worker.wait_for_action("worker.started")
        with app() as session, session.begin():
            item = Dispatch("audit", {"mode": "sleep", "seconds": 30})
            session.add(item)
        wait_for(lambda: run_row(engine, item.run_id).status == "running", timeout=20)
        seconds = _stop_seconds(worker)
        assert 2.0 <= seconds < 4.0
        assert run_row(engine, item.run_id).status == "queued"
    finally:
        worker.kill()
        relay.kill()


def test_messages_arriving_during_the_stop_run_exactly_once(
    app: sessionmaker[Session],
    engine: sa.Engine,
    settings: OutboxSettings,
    sqs_endpoint: str,
    sqs: Any,
    queues: dict[str, str],
) -> None:
    """Runs are dispatched every 50 ms from the moment the worker logs that it is stopping
    until it exited. Its pending poll returns some of them while it stops: those go back
    through the outbox (no attempt, no receive spent); the rest wait in the queue. A
    second worker then runs every one of them exactly once, each at attempt 1 on its
    message's first receive, and nothing reaches the DLQ."""
    relay = start_relay(settings, sqs_endpoint)
    run_ids: list[uuid.UUID] = []
    deferred: set[uuid.UUID] = set()
    second = None
    try:
        relay.wait_for_action("relay.leader")
        for cycle in range(3):  # a cycle whose poll ended before the first dispatch arrived proves nothing
            stopping = start_worker(
                settings, sqs_endpoint, name=f"stopping{cycle}", SQLA_OUTBOX_WORKER_WAIT_SECONDS=DEFAULT_WAIT
            )
            try:
                stopping.wait_for_action("worker.started")
                time.sleep(1.5)
                started = time.monotonic()
                stopping.process.send_signal(signal.SIGTERM)
                stopping.wait_for_action("worker.stopping", timeout=5)
                while stopping.process.poll() is None:
                    run_ids.append(_dispatch(app))
                    time.sleep(0.05)
                assert stopping.process.wait(10) == 0
                assert time.monotonic() - started < 2.0
            finally:
                stopping.kill()
            deferred |= {
                r
                for r in run_ids
                if any((t.detail or {}).get("deferred") == "worker-stopping" for t in trail(engine, r))
            }
            if deferred:
                break
        assert deferred, "no message arrived during a pending poll in three stops"
        second = start_worker(settings, sqs_endpoint, name="second")
        wait_for(lambda: all(run_row(engine, r).status == "succeeded" for r in run_ids), timeout=60)
        for run_id in run_ids:
            run = run_row(engine, run_id)
            assert (run.status, run.attempts) == ("succeeded", 1)
            assert len(effects(engine, run_id)) == 1
            [running] = [t for t in trail(engine, run_id) if t.status == "running"]
            assert running.receive_count == 1  # the stop spent no receive of the run's message
        assert receive_all(sqs, queues["default-dlq"]) == []
    finally:
        for process in (relay, second):
            if process is not None:
                process.kill()
