"""Cancel and Reschedule against real relay and worker processes, moto SQS, PostgreSQL, Valkey."""

from __future__ import annotations

import datetime as dt
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.orm import Session, sessionmaker

from sqla_outbox import Cancel, ControlOutcome, Dispatch, Reschedule
from sqla_outbox.config import OutboxSettings
from tests.support import effects, receive_all, start_relay, status_of, trail, wait_for

pytestmark = pytest.mark.e2e


def dispatch(app: sessionmaker[Session], task: str, payload: dict[str, Any], **options: Any) -> uuid.UUID:
    with app() as session, session.begin():
        item = Dispatch(task, payload, **options)
        session.add(item)
    return item.run_id


def cancel(app: sessionmaker[Session], *args: Any, **options: Any) -> Cancel:
    with app() as session, session.begin():
        control = Cancel(*args, **options)
        session.add(control)
    return control


def visible_and_hidden(sqs: Any, url: str) -> int:
    """Messages in a queue (visible + in flight), without receiving them."""
    attributes = sqs.get_queue_attributes(
        QueueUrl=url,
        AttributeNames=["ApproximateNumberOfMessages", "ApproximateNumberOfMessagesNotVisible"],
    )["Attributes"]
    return int(attributes["ApproximateNumberOfMessages"]) + int(
        attributes["ApproximateNumberOfMessagesNotVisible"]
    )


def sent(engine: sa.Engine, run_id: uuid.UUID) -> bool:
    with engine.connect() as connection:
        return bool(
            connection.execute(
                sa.text("SELECT sent_at IS NOT NULL FROM platform_outbox_messages WHERE run_id = :r"),
                {"r": run_id},
            ).scalar()
        )


@pytest.fixture
def relay(settings: OutboxSettings, sqs_endpoint: str, queues: dict[str, str]) -> Any:
    process = start_relay(settings, sqs_endpoint)
    process.wait_for_action("relay.started")
    yield process
    process.kill()
    print("--- relay log (tail) ---\n" + "".join(process.raw[-40:]))


def test_cancel_before_send_never_reaches_sqs(
    app: sessionmaker[Session], engine: sa.Engine, relay: Any, sqs: Any, queues: dict[str, str]
) -> None:
    doomed = dispatch(app, "audit", {"mode": "ok"}, delay=2)
    kept = dispatch(app, "audit", {"mode": "ok"}, delay=2)
    control = cancel(app, doomed, by="booking-service")
    assert control.outcome is ControlOutcome.CANCELLED and control.results[0].was_sent is False
    wait_for(lambda: sent(engine, kept), timeout=15)  # the relay did its work for the other run
    time.sleep(1.5)  # a sweep later
    bodies = [m["Body"] for m in receive_all(sqs, queues["default"], expect=1, timeout=5)]
    assert len(bodies) == 1 and str(kept) in bodies[0] and str(doomed) not in bodies[0]
    assert status_of(engine, doomed) == "cancelled"
    assert [t.status for t in trail(engine, doomed)] == ["cancelled"]


def test_cancel_of_a_message_already_in_sqs_is_acknowledged_without_calling_the_handler(
    app: sessionmaker[Session],
    engine: sa.Engine,
    relay: Any,
    worker_with_relay: Any,
    sqs: Any,
    queues: dict[str, str],
) -> None:
    run_id = dispatch(app, "audit", {"mode": "ok"})
    wait_for(lambda: sent(engine, run_id), timeout=15)
    assert visible_and_hidden(sqs, queues["default"]) == 1
    control = cancel(app, run_id)
    assert control.outcome is ControlOutcome.CANCELLED and control.results[0].was_sent is True
    worker = worker_with_relay()
    worker.wait_for_action("worker.cancelled_skipped")
    wait_for(lambda: visible_and_hidden(sqs, queues["default"]) == 0, timeout=15)
    assert status_of(engine, run_id) == "cancelled"
    assert effects(engine, run_id) == []
    assert [t.status for t in trail(engine, run_id)] == ["cancelled"]
    assert visible_and_hidden(sqs, queues["default-dlq"]) == 0


def test_cancel_racing_the_relays_send(
    app: sessionmaker[Session],
    engine: sa.Engine,
    relay: Any,
    worker_with_relay: Any,
    sqs: Any,
    queues: dict[str, str],
) -> None:
    """Each round commits 10 runs (the relay is woken and sends at once) and cancels them
    straight away: some are cancelled before the send, some after. Whichever way, no
    handler runs, and every message that did reach SQS is acknowledged by the worker."""
    results = []
    for _ in range(5):
        with app() as session, session.begin():
            items = [Dispatch("audit", {"mode": "ok"}) for _ in range(10)]
            session.add_all(items)
        results.extend(cancel(app, [i.run_id for i in items], by="race").results)
    assert len(results) == 50
    assert {r.outcome for r in results} == {ControlOutcome.CANCELLED}
    was_sent = sum(r.was_sent for r in results)
    time.sleep(2)  # the relay settles (it sends nothing more: rows of unsent runs are gone)
    assert visible_and_hidden(sqs, queues["default"]) == was_sent
    with engine.connect() as connection:
        pending = connection.execute(
            sa.text("SELECT count(*) FROM platform_outbox_messages WHERE sent_at IS NULL")
        ).scalar()
        statuses = dict(
            connection.execute(sa.text("SELECT status, count(*) FROM task_runs GROUP BY status")).all()
        )
    assert pending == 0
    assert statuses == {"cancelled": 50}
    worker_with_relay()
    wait_for(lambda: visible_and_hidden(sqs, queues["default"]) == 0, timeout=30)
    assert effects(engine) == []
    with engine.connect() as connection:
        running = connection.execute(
            sa.text("SELECT count(*) FROM task_run_trail WHERE status = 'running'")
        ).scalar()
    assert running == 0
    assert visible_and_hidden(sqs, queues["default-dlq"]) == 0
    print(f"race: {was_sent} of 50 cancelled after the relay sent them, {50 - was_sent} before")


def test_cancel_racing_a_workers_start(
    app: sessionmaker[Session], engine: sa.Engine, worker_with_relay: Any, sqs: Any, queues: dict[str, str]
) -> None:
    """Cancel right after each commit while a worker runs the runs: a run ends either
    cancelled with no effects, or succeeded (the cancel found it finished and says so)."""
    worker_with_relay()
    outcomes = {}
    for i in range(20):
        run_id = dispatch(app, "audit", {"mode": "ok"})
        time.sleep(0.02 * (i % 10))  # spread the cancels over the run's short life
        outcomes[run_id] = cancel(app, run_id).outcome
    wait_for(lambda: all(status_of(engine, r) in ("succeeded", "cancelled") for r in outcomes), timeout=30)
    wait_for(lambda: visible_and_hidden(sqs, queues["default"]) == 0, timeout=30)
    for run_id, outcome in outcomes.items():
        status, done = status_of(engine, run_id), len(effects(engine, run_id))
        if outcome is ControlOutcome.FINISHED:
            assert (status, done) == ("succeeded", 1)
        else:
            assert outcome in (ControlOutcome.CANCELLED, ControlOutcome.STOP_REQUESTED)
            assert (status, done) == ("cancelled", 0)
    assert visible_and_hidden(sqs, queues["default-dlq"]) == 0
    print(
        "worker race outcomes:", {o.value: list(outcomes.values()).count(o) for o in set(outcomes.values())}
    )


@pytest.mark.parametrize("task", ["audit", "index_user"])
def test_cancel_of_a_running_run_stops_it_through_its_context(
    app: sessionmaker[Session],
    engine: sa.Engine,
    worker_with_relay: Any,
    sqs: Any,
    queues: dict[str, str],
    tmp_path: Path,
    task: str,
) -> None:
    worker = worker_with_relay(SQLA_OUTBOX_WORKER_CANCEL_CHECK_SECONDS="0.5")
    marker = tmp_path / "marker"
    run_id = dispatch(app, task, {"mode": "wait_for_cancel", "marker": str(marker), "seconds": 30})
    wait_for(lambda: marker.exists() and "started" in marker.read_text(), timeout=20)
    asked = time.monotonic()
    control = cancel(app, run_id, by="operator:ana")
    assert control.outcome is ControlOutcome.STOP_REQUESTED
    wait_for(lambda: status_of(engine, run_id) == "cancelled", timeout=15)
    stopped_after = time.monotonic() - asked
    wait_for(lambda: "saw-cancel" in marker.read_text(), timeout=10)
    assert effects(engine, run_id) == []  # what the handler did after the cancel was rolled back
    steps = trail(engine, run_id)
    assert [t.status for t in steps] == ["running", "running", "cancelled"]
    assert steps[1].detail["cancelled_by"] == "operator:ana"
    assert steps[2].detail["reason"] == "cancel-requested" and steps[2].worker_id
    queue = queues["bulk" if task == "index_user" else "default"]
    wait_for(lambda: visible_and_hidden(sqs, queue) == 0, timeout=15)
    assert visible_and_hidden(sqs, queues["default-dlq"]) == 0
    assert worker.actions("worker.cancelled")
    assert stopped_after < 5
    print(f"{task}: cancelled {stopped_after:.2f} s after the cancel committed")


def test_reschedule_earlier_and_later_with_the_relay(
    app: sessionmaker[Session], engine: sa.Engine, worker_with_relay: Any
) -> None:
    worker_with_relay()
    far = dispatch(app, "audit", {"mode": "ok"}, delay=3600)
    soon = dispatch(app, "audit", {"mode": "ok"}, delay=2)
    with app() as session, session.begin():
        earlier = Reschedule(far, delay=0)
        later = Reschedule(soon, available_at=dt.datetime.now(dt.UTC) + dt.timedelta(hours=2))
        session.add_all([earlier, later])
    assert (earlier.outcome, later.outcome) == (ControlOutcome.RESCHEDULED, ControlOutcome.RESCHEDULED)
    wait_for(lambda: status_of(engine, far) == "succeeded", timeout=20)
    time.sleep(2)
    assert status_of(engine, soon) == "queued" and not sent(engine, soon)
