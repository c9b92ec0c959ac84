"""The relay on long failure streaks and on messages SQS refuses: capped backoff, no resends,
parking (issue 11, items 3 and 4). Real PostgreSQL, the AWS-strict SQS double, a real relay."""

from __future__ import annotations

import datetime as dt
import json
import time
import uuid
from typing import Any

import pytest
import sqlalchemy as sa
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy.orm import Session, sessionmaker

from sqla_outbox import Dispatch
from sqla_outbox.config import OutboxSettings
from sqla_outbox.ops import resend
from sqla_outbox.ops import status as status_ops
from sqla_outbox.relay import Relay, claim
from tests import support


@pytest.fixture
def relay_settings(settings: OutboxSettings, sqs_endpoint: str, queues: dict[str, str]) -> OutboxSettings:
    return settings.replace(sqs_endpoint_url=sqs_endpoint)


def dispatch(app: sessionmaker[Session], task: str, payload: Any = None, **options: Any) -> uuid.UUID:
    with app() as session, session.begin():
        item = Dispatch(task, payload or {}, **options)
        session.add(item)
    return item.run_id


def row(engine: sa.Engine, run_id: uuid.UUID) -> Any:
    with engine.connect() as conn:
        return conn.execute(
            sa.text(
                "SELECT *, EXTRACT(EPOCH FROM available_at - clock_timestamp())::float8 AS due_in FROM ("
                "SELECT run_id, sent_at, parked_at, attempts, last_error, available_at FROM outbox_messages "
                "UNION ALL SELECT run_id, sent_at, parked_at, attempts, last_error, available_at "
                "FROM platform_outbox_messages) AS o WHERE run_id = :r"
            ),
            {"r": run_id},
        ).one()


def bodies(sqs: Any, queue_url: str) -> list[dict[str, Any]]:
    return [json.loads(m["Body"]) for m in support.receive_all(sqs, queue_url, visibility=60)]


def test_a_failure_streak_of_any_length_backs_off_and_never_resends_what_sqs_took(
    app: sessionmaker[Session],
    engine: sa.Engine,
    relay_settings: OutboxSettings,
    sqs: Any,
    queues: dict[str, str],
) -> None:
    """The issue's input: one healthy row, one row with attempts = 1100 for a queue that no
    longer exists. PostgreSQL's power(2, 1100) overflowed after SQS took the healthy row,
    the pass rolled back, and a running relay sent that row again and again."""
    healthy = dispatch(app, "send_welcome", {"n": 1})
    streak = dispatch(app, "index_user", {"n": 2})  # bulk queue
    with engine.begin() as conn:
        conn.execute(sa.text("UPDATE outbox_messages SET attempts = 1100"), {})
        conn.execute(sa.text("UPDATE platform_outbox_messages SET attempts = 1100"), {})
    sqs.delete_queue(QueueUrl=queues["bulk"])
    relay = Relay(relay_settings, engine=engine)

    result = relay.run_once()

    assert (result.sent, result.failed, result.parked) == (1, 1, 0)
    assert row(engine, healthy).sent_at is not None
    failed = row(engine, streak)
    assert failed.sent_at is None and failed.parked_at is None  # an outage never parks
    assert failed.attempts == 1101
    assert 290 < failed.due_in <= 300  # relay_backoff_max_seconds
    assert "NonExistentQueue" in failed.last_error or "QueueDoesNotExist" in failed.last_error
    with engine.begin() as conn:  # due again, for a relay that keeps running
        conn.execute(sa.text("UPDATE platform_outbox_messages SET available_at = clock_timestamp()"))
        conn.execute(sa.text("UPDATE outbox_messages SET available_at = clock_timestamp()"))
    relay.start_in_thread()
    support.wait_for(lambda: row(engine, streak).attempts >= 1102, timeout=15)
    relay.stop()
    relay.join(10)
    assert [b["run_id"] for b in bodies(sqs, queues["default"])] == [str(healthy)]


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(attempts=st.integers(min_value=0, max_value=1_000_000))
def test_the_relay_backoff_statement_is_capped_for_any_attempt_count(
    app: sessionmaker[Session], engine: sa.Engine, attempts: int
) -> None:
    run_id = dispatch(app, "send_welcome", tenant_id=1)
    with engine.begin() as conn:
        conn.execute(
            sa.text("UPDATE outbox_messages SET attempts = :a WHERE run_id = :r"),
            {"a": attempts, "r": run_id},
        )
        (claimed,) = [r for r in claim.claim(conn, "outbox_messages", limit=100) if r.run_id == run_id]
        claim.mark_failed(conn, "outbox_messages", [(claimed, "X: y")], base_seconds=1.0, max_seconds=300.0)
    after = row(engine, run_id)
    expected = min(300.0, 2.0 ** min(attempts, 62))
    assert after.attempts == attempts + 1
    assert expected - 2 <= after.due_in <= expected


def test_an_error_recording_failed_sends_never_resends_what_sqs_took(
    app: sessionmaker[Session],
    engine: sa.Engine,
    relay_settings: OutboxSettings,
    sqs: Any,
    queues: dict[str, str],
) -> None:
    """Whatever fails after a send (here a trigger refusing the failed row's update) must
    not roll back ``sent_at`` of the rows SQS accepted in the same pass."""
    healthy = dispatch(app, "send_welcome", {"n": 1})
    dispatch(app, "index_user", {"n": 2})
    sqs.delete_queue(QueueUrl=queues["bulk"])
    with engine.begin() as conn:
        conn.execute(
            sa.text(
                "CREATE FUNCTION refuse_update() RETURNS trigger LANGUAGE plpgsql AS "
                "$$ BEGIN RAISE EXCEPTION 'refused by the test'; END $$"
            )
        )
        conn.execute(
            sa.text(
                "CREATE TRIGGER refuse BEFORE UPDATE OF attempts ON outbox_messages "
                "FOR EACH ROW EXECUTE FUNCTION refuse_update()"
            )
        )
    relay = Relay(relay_settings.replace(relay_sweep_interval_seconds=0.2), engine=engine)
    relay.start_in_thread()
    try:
        support.wait_for(lambda: row(engine, healthy).sent_at is not None, timeout=15)
        time.sleep(3)  # several more passes over the row whose failure cannot be recorded
    finally:
        relay.stop()
        relay.join(10)
    assert [b["run_id"] for b in bodies(sqs, queues["default"])] == [str(healthy)]
    assert relay.counters.passes < 20  # the stalled row is retried with backoff, not in a spin


def _big_row(engine: sa.Engine, *, payload_bytes: int) -> uuid.UUID:
    """A run and an outbox row written straight into the tables (not through Dispatch,
    which would refuse it): a message larger than the queue takes."""
    run_id = uuid.uuid4()
    envelope = {
        "v": 1,
        "run_id": str(run_id),
        "task": "rebuild_cache",
        "queue": "maintenance",
        "tenant_id": None,
        "event": None,
        "idempotency_key": None,
        "payload": json.dumps("x" * payload_bytes),
    }
    with engine.begin() as conn:
        conn.execute(
            sa.text(
                "INSERT INTO task_runs (run_id, task, queue, available_at) "
                "VALUES (:r, 'rebuild_cache', 'maintenance', clock_timestamp())"
            ),
            {"r": run_id},
        )
        conn.execute(
            sa.text(
                "INSERT INTO platform_outbox_messages (run_id, queue, envelope, available_at) "
                "VALUES (:r, 'maintenance', CAST(:e AS jsonb), clock_timestamp())"
            ),
            {"r": run_id, "e": json.dumps(envelope)},
        )
    return run_id


def assert_parked(engine: sa.Engine, run_id: uuid.UUID, code: str, *, attempts: int = 1) -> None:
    parked = row(engine, run_id)
    assert parked.parked_at is not None and parked.sent_at is None
    assert parked.attempts == attempts and parked.last_error.startswith(f"{code}: ")
    run = support.run_row(engine, run_id)
    assert (run.status, run.last_error_type) == ("failed", code)
    assert run.last_error and run.finished_at is not None
    last = support.trail(engine, run_id)[-1]
    assert (last.status, last.error_type) == ("failed", code)
    assert last.detail == {"reason": "send-refused", "parked": True, "send_attempts": attempts}


def test_a_message_larger_than_the_queue_takes_is_parked_at_once_and_others_go(
    app: sessionmaker[Session],
    engine: sa.Engine,
    relay_settings: OutboxSettings,
    sqs: Any,
    queues: dict[str, str],
) -> None:
    """The relay allows 1 MiB; the queue was provisioned with the 256 KiB default."""
    big = _big_row(engine, payload_bytes=300_000)
    healthy = dispatch(app, "rebuild_cache", {"n": 1})
    relay = Relay(relay_settings.replace(max_message_bytes=1_048_576), engine=engine)

    result = relay.run_once()

    assert (result.sent, result.parked) == (1, 1)
    assert_parked(engine, big, "BatchRequestTooLong")
    assert row(engine, healthy).sent_at is not None
    assert relay.run_once().claimed == 0  # never claimed again
    report = status_ops.collect(engine.connect(), relay_settings)
    assert report.parked_count == 1 and report.parked[0].run_id == big
    assert all(p.table != "platform_outbox_messages" or p.pending == 0 for p in report.pending)


def test_a_message_above_the_relays_own_limit_is_parked_unsent_naming_the_setting(
    app: sessionmaker[Session],
    engine: sa.Engine,
    relay_settings: OutboxSettings,
    sqs: Any,
    queues: dict[str, str],
) -> None:
    """Trial finding: the application dispatched with max_message_bytes 1 MiB, the queues
    were provisioned for 1 MiB, and the relay (256 KiB, the default) sent a 300 KB message
    anyway; a worker with the default then refused it unexecuted and the run stayed queued.
    The relay now refuses what its own setting refuses, so the mismatch shows at once."""
    sqs.set_queue_attributes(QueueUrl=queues["maintenance"], Attributes={"MaximumMessageSize": "1048576"})
    big = _big_row(engine, payload_bytes=300_000)
    healthy = dispatch(app, "rebuild_cache", {"n": 1})

    result = Relay(relay_settings, engine=engine).run_once()

    assert (result.sent, result.parked) == (1, 1)
    assert_parked(engine, big, "MessageTooLargeForRelay")
    assert "above this relay's max_message_bytes (262144)" in row(engine, big).last_error
    assert [body["run_id"] for body in bodies(sqs, queues["maintenance"])] == [str(healthy)]


def test_a_batch_too_long_for_the_queue_is_sent_entry_by_entry(
    app: sessionmaker[Session],
    engine: sa.Engine,
    relay_settings: OutboxSettings,
    sqs: Any,
    queues: dict[str, str],
) -> None:
    """The queue's MaximumMessageSize is below max_message_bytes: the packed batch is too
    long as a whole, but each message but one fits; only that one is parked."""
    support.set_visibility(sqs, queues["default"], 30)
    sqs.set_queue_attributes(QueueUrl=queues["default"], Attributes={"MaximumMessageSize": "2048"})
    small = [dispatch(app, "send_welcome", {"text": "s" * 700}) for _ in range(3)]
    large = dispatch(app, "send_welcome", {"text": "L" * 3000})

    result = Relay(relay_settings, engine=engine).run_once()

    assert (result.sent, result.parked) == (3, 1)
    assert all(row(engine, run_id).sent_at is not None for run_id in small)
    assert_parked(engine, large, "BatchRequestTooLong")


def test_an_entry_refused_with_sender_fault_is_parked_at_once(
    app: sessionmaker[Session], engine: sa.Engine, relay_settings: OutboxSettings, sqs_endpoint: str
) -> None:
    support.refuse_messages(sqs_endpoint, "poison-7", "InvalidParameterValue", message="bad attribute")
    poison = dispatch(app, "send_welcome", {"note": "poison-7"})
    healthy = dispatch(app, "send_welcome", {"note": "fine"})

    result = Relay(relay_settings, engine=engine).run_once()

    assert (result.sent, result.parked) == (1, 1)
    assert_parked(engine, poison, "InvalidParameterValue")
    assert support.run_row(engine, poison).last_error == "bad attribute"
    assert row(engine, healthy).sent_at is not None


def test_an_entry_sqs_keeps_failing_without_blame_is_parked_after_the_setting_and_holds_nothing_back(
    app: sessionmaker[Session], engine: sa.Engine, relay_settings: OutboxSettings, sqs_endpoint: str
) -> None:
    support.refuse_messages(sqs_endpoint, "flaky-9", "InternalError", sender_fault=False, message="try again")
    tuned = relay_settings.replace(
        relay_max_send_attempts=3, relay_backoff_base_seconds=0.01, relay_backoff_max_seconds=0.02
    )
    relay = Relay(tuned, engine=engine)
    poison = dispatch(app, "send_welcome", {"note": "flaky-9"})
    healthy = []
    for attempt in (1, 2, 3):
        healthy.append(dispatch(app, "send_welcome", {"n": attempt}))
        time.sleep(0.05)
        result = relay.run_once()
        assert result.sent == 1  # the run dispatched just before: never held back
        if attempt < 3:
            pending = row(engine, poison)
            assert pending.parked_at is None and pending.attempts == attempt
            assert pending.last_error == "InternalError: try again"
            assert support.status_of(engine, poison) == "queued"
    assert_parked(engine, poison, "InternalError", attempts=3)
    assert all(row(engine, run_id).sent_at is not None for run_id in healthy)


def test_a_parked_row_is_put_back_after_the_fix_and_delivered(
    app: sessionmaker[Session],
    engine: sa.Engine,
    relay_settings: OutboxSettings,
    sqs: Any,
    queues: dict[str, str],
    sqs_endpoint: str,
) -> None:
    support.refuse_messages(sqs_endpoint, "poison-3", "InvalidParameterValue")
    poison = dispatch(app, "send_welcome", {"note": "poison-3"}, idempotency_key="order-3", tenant_id=2)
    relay = Relay(relay_settings, engine=engine)
    relay.run_once()
    assert_parked(engine, poison, "InvalidParameterValue")
    only = resend.Selection(run_ids=(poison,))

    dry = resend.unpark(engine, only, dry_run=True)
    assert [(i.run_id, i.action) for i in dry.items] == [(poison, "would-unpark")]
    assert row(engine, poison).parked_at is not None
    # meanwhile the application dispatched the same work again under the key: it wins
    rival = dispatch(app, "send_welcome", {"note": "again"}, idempotency_key="order-3", tenant_id=2)
    conflict = resend.unpark(engine, only)
    assert [(i.action, i.reason) for i in conflict.items] == [("skipped", "idempotency-conflict")]
    with engine.begin() as conn:
        conn.execute(sa.text("UPDATE task_runs SET status = 'succeeded' WHERE run_id = :r"), {"r": rival})

    support.refuse_messages(sqs_endpoint, "poison-3", clear=True)  # the fix
    done = resend.unpark(engine, only)

    assert [(i.run_id, i.action) for i in done.items] == [(poison, "unparked")]
    back = row(engine, poison)
    assert back.parked_at is None and back.sent_at is None and back.attempts == 0
    assert support.status_of(engine, poison) == "queued"
    assert support.trail(engine, poison)[-1].detail == {"unparked_by": "operator", "from": "failed"}
    assert relay.run_once().sent == 2  # the parked run, and the rival's row
    assert row(engine, poison).sent_at is not None
    assert str(poison) in {b["run_id"] for b in bodies(sqs, queues["default"])}
    again = resend.unpark(engine, only)
    assert [(i.action, i.reason) for i in again.items] == [("skipped", "not-parked")]


def test_runs_whose_message_waited_in_sqs_too_long_are_flagged_and_resent(
    app: sessionmaker[Session],
    engine: sa.Engine,
    relay_settings: OutboxSettings,
    sqs: Any,
    queues: dict[str, str],
) -> None:
    """Workers down longer than the queue's retention: SQS dropped the message silently,
    the run stayed queued with sent_at set (issue 11, item 7)."""
    lost = dispatch(app, "send_welcome", {"n": "lost"}, tenant_id=1)
    recent = dispatch(app, "send_welcome", {"n": "recent"}, tenant_id=1)
    running = dispatch(app, "send_welcome", {"n": "running"}, tenant_id=1)
    relay = Relay(relay_settings, engine=engine)
    assert relay.run_once().sent == 3
    sqs.purge_queue(QueueUrl=queues["default"])  # what SQS does at the retention period's end
    with engine.begin() as conn:
        conn.execute(
            sa.text(
                "UPDATE outbox_messages SET sent_at = clock_timestamp() - interval '3 days' "
                "WHERE run_id IN (:a, :b)"
            ),
            {"a": lost, "b": running},
        )
        conn.execute(
            sa.text(
                "UPDATE task_runs SET updated_at = clock_timestamp() - interval '3 days' "
                "WHERE run_id IN (:a, :b)"
            ),
            {"a": lost, "b": running},
        )
        conn.execute(sa.text("UPDATE task_runs SET status = 'running' WHERE run_id = :r"), {"r": running})

    with engine.connect() as conn:
        report = status_ops.collect(conn, relay_settings, unreceived_after=dt.timedelta(days=1))
    assert [u.run_id for u in report.unreceived] == [lost] and report.unreceived_count == 1
    assert report.unreceived[0].waiting_seconds > 2.9 * 86_400

    everything = resend.Selection(run_ids=(lost, recent, running))
    dry = resend.resend_unreceived(engine, everything, older_than=dt.timedelta(days=1), dry_run=True)
    # the operator named the other two: any unfinished run without a live lease is sent again
    assert {i.run_id: (i.action, i.reason) for i in dry.items} == {
        lost: ("would-resend", None),
        recent: ("would-resend", None),
        running: ("would-resend", None),
    }
    assert row(engine, lost).sent_at is not None
    done = resend.resend_unreceived(engine, everything, older_than=dt.timedelta(days=1))
    assert done.done == 3
    assert support.status_of(engine, running) == "queued"  # its lease had lapsed: back to queued
    assert row(engine, lost).sent_at is None and support.status_of(engine, lost) == "queued"
    assert support.trail(engine, lost)[-1].detail["resent_by"] == "operator"
    assert relay.run_once().sent == 3
    assert sorted(b["run_id"] for b in bodies(sqs, queues["default"])) == sorted(
        map(str, (lost, recent, running))
    )
