"""``python -m sqla_outbox.worker`` as a real subprocess against moto, PostgreSQL and Redis."""

from __future__ import annotations

import json
import signal
import time
import uuid
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.orm import Session, sessionmaker

from sqla_outbox import Dispatch, Publish
from sqla_outbox.config import OutboxSettings
from tests.support import (
    effects,
    receive_all,
    run_row,
    set_visibility,
    start_relay,
    start_worker,
    status_of,
    trail,
    wait_for,
)

pytestmark = pytest.mark.e2e


def dispatch(app: sessionmaker[Session], task: str, payload: dict[str, Any], **options: Any) -> uuid.UUID:
    with app() as session, session.begin():
        item = Dispatch(task, payload, **options)
        session.add(item)
    return item.run_id


def finished(engine: sa.Engine, run_id: uuid.UUID) -> bool:
    return status_of(engine, run_id) in ("succeeded", "failed")


def test_success_commits_effects_with_the_status_and_deletes_the_message(
    app: sessionmaker[Session], engine: sa.Engine, worker_with_relay: Any, sqs: Any, queues: dict[str, str]
) -> None:
    worker = worker_with_relay()
    run_id = dispatch(app, "audit", {"mode": "ok"})
    wait_for(lambda: finished(engine, run_id), timeout=20)
    run = run_row(engine, run_id)
    assert (run.status, run.attempts, run.lease_owner) == ("succeeded", 1, None)
    assert run.finished_at is not None
    assert [t.status for t in trail(engine, run_id)] == ["running", "succeeded"]
    assert len(effects(engine, run_id)) == 1
    assert receive_all(sqs, queues["default"]) == []
    assert worker.terminate() == 0


def test_transient_failures_retry_with_backoff_then_succeed(
    app: sessionmaker[Session], engine: sa.Engine, worker_with_relay: Any
) -> None:
    worker_with_relay()
    run_id = dispatch(app, "audit", {"mode": "fail_times", "times": 2})
    wait_for(lambda: finished(engine, run_id), timeout=30)
    run = run_row(engine, run_id)
    assert (run.status, run.attempts) == ("succeeded", 3)
    steps = trail(engine, run_id)
    assert [t.status for t in steps] == ["running", "retrying", "running", "retrying", "running", "succeeded"]
    retries = [t for t in steps if t.status == "retrying"]
    assert all(t.error_type == "ConnectionError" for t in retries)
    assert all("flaky dependency" in t.error_message for t in retries)
    assert all(t.traceback and "ConnectionError" in t.traceback for t in retries)
    assert [t.detail["backoff_seconds"] > 0 for t in retries] == [True, True]
    assert [t.receive_count for t in steps if t.status == "running"] == [1, 2, 3]
    assert len(effects(engine, run_id)) == 1


def test_permanent_error_goes_to_the_dlq_with_context(
    app: sessionmaker[Session], engine: sa.Engine, worker_with_relay: Any, sqs: Any, queues: dict[str, str]
) -> None:
    worker_with_relay()
    run_id = dispatch(app, "audit", {"mode": "permanent"})
    wait_for(lambda: run_row(engine, run_id).dead_lettered_at is not None, timeout=20)
    run = run_row(engine, run_id)
    assert (run.status, run.attempts) == ("failed", 1)
    assert run.last_error_type == "sqla_outbox.errors.ValidationFailed"
    [message] = receive_all(sqs, queues["default-dlq"], expect=1, timeout=10)
    assert json.loads(message["Body"])["run_id"] == str(run_id)
    attributes = {k: v["StringValue"] for k, v in message["MessageAttributes"].items()}
    assert attributes["reason"] == "permanent-error"
    assert attributes["error_type"] == "sqla_outbox.errors.ValidationFailed"
    assert "order 7 has no lines" in attributes["error_message"]
    assert attributes["run_id"] == str(run_id)
    assert attributes["source_queue"] == "default"
    assert receive_all(sqs, queues["default"]) == []
    assert effects(engine, run_id) == []


def test_listed_exception_types_are_permanent(
    app: sessionmaker[Session], engine: sa.Engine, worker_with_relay: Any
) -> None:
    worker_with_relay()
    run_id = dispatch(app, "charge_card", {"mode": "keyerror"}, tenant_id=1)
    wait_for(lambda: finished(engine, run_id), timeout=20)
    assert (status_of(engine, run_id), run_row(engine, run_id).attempts) == ("failed", 1)


def test_five_transient_failures_end_in_the_dlq(
    app: sessionmaker[Session], engine: sa.Engine, worker_with_relay: Any, sqs: Any, queues: dict[str, str]
) -> None:
    worker_with_relay(
        SQLA_OUTBOX_WORKER_BACKOFF_BASE_SECONDS="0.2", SQLA_OUTBOX_WORKER_BACKOFF_MAX_SECONDS="1"
    )
    run_id = dispatch(app, "audit", {"mode": "always_fail"})
    wait_for(lambda: run_row(engine, run_id).dead_lettered_at is not None, timeout=40)
    run = run_row(engine, run_id)
    assert (run.status, run.attempts) == ("failed", 5)
    statuses = [
        t.status for t in trail(engine, run_id) if t.detail is None or "dead_lettered" not in t.detail
    ]
    assert statuses == ["running", "retrying"] * 4 + ["running", "failed"]
    [message] = receive_all(sqs, queues["default-dlq"], expect=1, timeout=10)
    assert message["MessageAttributes"]["reason"]["StringValue"] == "retries-exhausted"
    assert message["MessageAttributes"]["receive_count"]["StringValue"] == "5"


def test_timeout_is_a_transient_failure_and_frees_the_slot(
    app: sessionmaker[Session], engine: sa.Engine, worker_with_relay: Any
) -> None:
    worker_with_relay(SQLA_OUTBOX_WORKER_CONCURRENCY="1")
    slow = dispatch(app, "charge_card", {"mode": "sleep_ignoring_cancel", "seconds": 6}, tenant_id=1)
    wait_for(lambda: any(t.status == "retrying" for t in trail(engine, slow)), timeout=20)
    quick = dispatch(app, "audit", {"mode": "ok"})  # the only slot was freed at the timeout
    wait_for(lambda: finished(engine, quick), timeout=10)
    assert any(t.status == "running" for t in trail(engine, slow))
    wait_for(lambda: finished(engine, slow), timeout=30)
    steps = trail(engine, slow)
    timeout_step = next(t for t in steps if t.status == "retrying")
    assert timeout_step.error_type == "sqla_outbox.errors.AttemptTimeout"
    assert status_of(engine, slow) == "succeeded"
    time.sleep(6)  # the first attempt's thread finishes late: its result must be discarded
    assert len(effects(engine, slow)) == 1


def test_handler_raising_timeout_error_is_not_mistaken_for_the_attempt_timeout(
    app: sessionmaker[Session], engine: sa.Engine, worker_with_relay: Any
) -> None:
    worker_with_relay(
        SQLA_OUTBOX_WORKER_BACKOFF_BASE_SECONDS="30", SQLA_OUTBOX_WORKER_BACKOFF_MAX_SECONDS="60"
    )
    run_id = dispatch(app, "audit", {"mode": "own_timeout_error"})
    wait_for(lambda: status_of(engine, run_id) == "retrying", timeout=20)
    assert run_row(engine, run_id).last_error_type == "TimeoutError"


def test_retry_exception_sets_the_delay(
    app: sessionmaker[Session], engine: sa.Engine, worker_with_relay: Any
) -> None:
    worker_with_relay()
    run_id = dispatch(app, "audit", {"mode": "retry_in", "seconds": 2})
    wait_for(lambda: finished(engine, run_id), timeout=20)
    steps = trail(engine, run_id)
    retry = next(t for t in steps if t.status == "retrying")
    assert retry.detail["backoff_seconds"] == 2
    second = [t for t in steps if t.status == "running"][1]
    assert second.at - retry.at >= __import__("datetime").timedelta(seconds=1.5)


def test_async_handler(app: sessionmaker[Session], engine: sa.Engine, worker_with_relay: Any) -> None:
    worker_with_relay()
    with app() as session, session.begin():
        event = Publish("user.created", {"mode": "fail_times", "times": 1})
        session.add(event)
    index_run = event.runs["index_user"]
    wait_for(lambda: finished(engine, index_run), timeout=30)
    assert (status_of(engine, index_run), run_row(engine, index_run).attempts) == ("succeeded", 2)
    assert [e.note for e in effects(engine, index_run)] == ["async"]


def test_handler_dispatches_a_follow_up_in_its_own_transaction(
    app: sessionmaker[Session], engine: sa.Engine, worker_with_relay: Any
) -> None:
    worker_with_relay()
    run_id = dispatch(app, "audit", {"mode": "followup"})
    wait_for(lambda: finished(engine, run_id), timeout=20)
    with engine.connect() as conn:
        follow = conn.execute(
            sa.text("SELECT run_id FROM task_runs WHERE task = 'send_welcome'")
        ).scalar_one()
    wait_for(lambda: finished(engine, follow), timeout=20)
    assert status_of(engine, follow) == "succeeded"


def test_same_message_twice_runs_the_handler_effects_once(
    app: sessionmaker[Session], engine: sa.Engine, worker_with_relay: Any, sqs: Any, queues: dict[str, str]
) -> None:
    worker_with_relay()
    run_id = dispatch(app, "audit", {"mode": "ok"})
    wait_for(lambda: finished(engine, run_id), timeout=20)
    with engine.connect() as conn:
        envelope = conn.execute(
            sa.text("SELECT envelope FROM platform_outbox_messages WHERE run_id = :r"), {"r": run_id}
        ).scalar_one()
    body = json.dumps(envelope, separators=(",", ":"))
    for _ in range(2):  # SQS at-least-once: the same message again
        sqs.send_message(QueueUrl=queues["default"], MessageBody=body)
    wait_for(lambda: len(receive_all(sqs, queues["default"], visibility=0)) == 0, timeout=20, interval=0.5)
    time.sleep(1)
    assert len(effects(engine, run_id)) == 1
    assert status_of(engine, run_id) == "succeeded"


def test_concurrent_copies_never_run_the_handler_at_the_same_time(
    app: sessionmaker[Session],
    engine: sa.Engine,
    settings: OutboxSettings,
    sqs_endpoint: str,
    sqs: Any,
    queues: dict[str, str],
) -> None:
    run_id = dispatch(app, "audit", {"mode": "sleep", "seconds": 3})
    with engine.connect() as conn:
        envelope = conn.execute(
            sa.text("SELECT envelope FROM platform_outbox_messages WHERE run_id = :r"), {"r": run_id}
        ).scalar_one()
    body = json.dumps(envelope, separators=(",", ":"))
    for _ in range(3):
        sqs.send_message(QueueUrl=queues["default"], MessageBody=body)
    workers = [start_worker(settings, sqs_endpoint, name=f"w{i}") for i in range(2)]
    try:
        wait_for(lambda: finished(engine, run_id), timeout=30)
        time.sleep(2)
        running = [t for t in trail(engine, run_id) if t.status == "running"]
        assert len(running) == 1  # the copies were held off by the lease
        assert len(effects(engine, run_id)) == 1
        assert sum(len(w.actions("worker.leased_elsewhere")) for w in workers) >= 1
    finally:
        for w in workers:
            w.kill()


def test_kill_9_mid_task_the_message_comes_back_and_the_run_completes(
    app: sessionmaker[Session],
    engine: sa.Engine,
    settings: OutboxSettings,
    sqs_endpoint: str,
    sqs: Any,
    queues: dict[str, str],
) -> None:
    set_visibility(sqs, queues["default"], 3)
    relay = start_relay(settings, sqs_endpoint)
    first = start_worker(settings, sqs_endpoint, name="first")
    try:
        run_id = dispatch(app, "audit", {"mode": "sleep", "seconds": 4, "attempts": 1})
        wait_for(lambda: status_of(engine, run_id) == "running", timeout=20)
        first.kill()
        second = start_worker(settings, sqs_endpoint, name="second")
        wait_for(lambda: finished(engine, run_id), timeout=40)
        run = run_row(engine, run_id)
        assert (run.status, run.attempts) == ("succeeded", 2)
        assert [t.detail.get("from") for t in trail(engine, run_id) if t.status == "running"] == [
            "queued",
            "running",
        ]
        assert len(effects(engine, run_id)) == 1
        assert second.terminate() == 0
    finally:
        first.kill()
        relay.kill()


def test_sigterm_returns_a_slow_message_and_requeues_its_run(
    app: sessionmaker[Session], engine: sa.Engine, worker_with_relay: Any, sqs: Any, queues: dict[str, str]
) -> None:
    # a 5 s long poll is pending on the queue while the worker stops
    worker = worker_with_relay(
        SQLA_OUTBOX_WORKER_STOP_BUDGET_SECONDS="1", SQLA_OUTBOX_WORKER_WAIT_SECONDS="5"
    )
    run_id = dispatch(app, "audit", {"mode": "sleep", "seconds": 30})
    wait_for(lambda: status_of(engine, run_id) == "running", timeout=20)
    started = time.monotonic()
    worker.process.send_signal(signal.SIGTERM)
    assert worker.process.wait(30) == 0
    assert time.monotonic() - started < 15
    run = run_row(engine, run_id)
    assert (run.status, run.lease_owner) == ("queued", None)
    assert [t.status for t in trail(engine, run_id)] == ["running", "queued"]
    [message] = receive_all(sqs, queues["default"], expect=1, timeout=10)  # visible within seconds
    assert json.loads(message["Body"])["run_id"] == str(run_id)
    # regression: the stopping worker's own last long poll used to take the returned message
    # back (and return it again), spending a second receive of the run's budget
    assert message["Attributes"]["ApproximateReceiveCount"] == "2"
    assert effects(engine, run_id) == []
    [returned] = worker.actions("worker.returned")
    assert 1 <= returned["hide_s"] <= 7


def test_a_message_received_while_stopping_goes_back_through_the_outbox_at_no_cost(
    app: sessionmaker[Session],
    engine: sa.Engine,
    settings: OutboxSettings,
    sqs_endpoint: str,
    sqs: Any,
    queues: dict[str, str],
) -> None:
    """A long poll still pending when SIGTERM arrives brings a message back: the stopping
    worker hands the run back to the outbox instead of returning the message to the queue
    (which would have cost it a receive of its redrive budget); a fresh message carries it."""
    relay = start_relay(settings, sqs_endpoint)
    stopping = start_worker(settings, sqs_endpoint, name="stopping", SQLA_OUTBOX_WORKER_WAIT_SECONDS="10")
    second = None
    try:
        relay.wait_for_action("relay.leader")
        stopping.wait_for_action("worker.started")
        time.sleep(1)  # its long polls are pending
        stopping.process.send_signal(signal.SIGTERM)
        stopping.wait_for_action("worker.stopping")
        run_id = dispatch(app, "audit", {"mode": "ok"})
        assert stopping.process.wait(30) == 0
        [deferral] = [
            t for t in trail(engine, run_id) if (t.detail or {}).get("deferred") == "worker-stopping"
        ]
        assert (deferral.status, deferral.receive_count) == ("queued", 1)
        assert run_row(engine, run_id).attempts == 0
        second = start_worker(settings, sqs_endpoint, name="second")
        wait_for(lambda: finished(engine, run_id), timeout=40)
        [running] = [t for t in trail(engine, run_id) if t.status == "running"]
        assert running.receive_count == 1  # a fresh message: the stop spent nothing
        assert (run_row(engine, run_id).status, len(effects(engine, run_id))) == ("succeeded", 1)
        assert receive_all(sqs, queues["default-dlq"]) == []
    finally:
        for process in (stopping, relay, second):
            if process is not None:
                process.kill()


def test_forged_messages_go_to_the_dlq_and_never_run(
    app: sessionmaker[Session], engine: sa.Engine, worker_with_relay: Any, sqs: Any, queues: dict[str, str]
) -> None:
    worker = worker_with_relay()
    real = dispatch(app, "audit", {"mode": "ok"})
    wait_for(lambda: finished(engine, real), timeout=20)
    forged_run = str(uuid.uuid4())
    bodies = {
        "not json at all": "malformed-envelope:not-json",
        json.dumps(
            {
                "v": 1,
                "run_id": forged_run,
                "task": "audit",
                "queue": "default",
                "tenant_id": None,
                "payload": "{}",
            }
        ): "unknown-run",
        json.dumps(
            {
                "v": 1,
                "run_id": str(real),
                "task": "charge_card",
                "queue": "default",
                "tenant_id": 1,
                "payload": "{}",
            }
        ): "envelope-mismatch",
        json.dumps({"v": 1, "run_id": 5, "task": "audit"}): "malformed-envelope:bad-field",
    }
    for body in bodies:
        sqs.send_message(QueueUrl=queues["default"], MessageBody=body)
    dead = receive_all(sqs, queues["default-dlq"], expect=len(bodies), timeout=20)
    reasons = {m["Body"]: m["MessageAttributes"]["reason"]["StringValue"] for m in dead}
    assert reasons == bodies
    assert len(effects(engine)) == 1
    assert status_of(engine, real) == "succeeded"
    assert worker.process.poll() is None  # still running


def test_worker_started_while_sqs_is_down_waits_and_then_works(
    app: sessionmaker[Session],
    engine: sa.Engine,
    settings: OutboxSettings,
    sqs_endpoint: str,
    queues: dict[str, str],
) -> None:
    from tests import support

    host, port = sqs_endpoint.removeprefix("http://").split(":")
    proxy = support.TcpProxy(host, int(port))
    proxy.disable()
    worker = start_worker(settings, proxy.endpoint, SQLA_OUTBOX_WORKER_RUN_RELAY="true")
    try:
        worker.wait_for_action("worker.sqs_unreachable")
        time.sleep(1)
        assert worker.process.poll() is None  # waiting, not exiting
        proxy.enable()
        worker.wait_for_action("worker.started", timeout=30)
        run_id = dispatch(app, "audit", {"mode": "ok"})
        wait_for(lambda: finished(engine, run_id), timeout=20)
    finally:
        worker.kill()
        proxy.close()


def test_worker_refuses_to_start_without_its_queues(settings: OutboxSettings, sqs_endpoint: str) -> None:
    worker = start_worker(settings.replace(queue_prefix="never-provisioned-"), sqs_endpoint)
    assert worker.process.wait(60) == 2
    assert "does not exist" in worker.output() and "python -m sqla_outbox provision" in worker.output()
