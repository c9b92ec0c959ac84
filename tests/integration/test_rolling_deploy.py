"""Holding work back during a rolling deploy, on real PostgreSQL and a moto SQS server.

* :func:`sqla_outbox.worker.deferral.defer_run`: the run goes back to the outbox (pending,
  due later), its attempts and status untouched, the deferral in the trail;
* the relay keeps rows no live worker implements pending (no SQS message at all), and
  releases them once a worker that implements the task registers;
* ``status`` lists the live workers and the tasks waiting for one, with how long.
"""

from __future__ import annotations

import datetime as dt
import json
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.orm import Session, sessionmaker

from sqla_outbox import Dispatch, envelope, presence
from sqla_outbox.config import OutboxSettings
from sqla_outbox.lifecycle import attempts
from sqla_outbox.lifecycle.deferral import DeferStatus, defer_run
from sqla_outbox.ops import status
from sqla_outbox.relay import Relay
from tests.support import outbox_rows, receive_all, run_row, trail


@pytest.fixture
def relay(
    settings: OutboxSettings, sqs_endpoint: str, queues: dict[str, str], engine: sa.Engine
) -> Iterator[Relay]:
    relay = Relay(settings.replace(sqs_endpoint_url=sqs_endpoint), engine=engine)
    yield relay
    relay.sender.close()


def dispatch(app: sessionmaker[Session], task: str, **options: Any) -> uuid.UUID:
    with app() as session, session.begin():
        item = Dispatch(task, {"n": 1}, **options)
        session.add(item)
    return item.run_id


def received_document(engine: sa.Engine, run_id: uuid.UUID) -> envelope.Envelope:
    """The envelope as a worker would decode it from the message the relay sent."""
    [row] = [r for r in outbox_rows(engine) if r.run_id == run_id]
    return envelope.decode(envelope.encode_document(row.envelope), max_bytes=262_144)


def defer(engine: sa.Engine, env: envelope.Envelope, **overrides: Any) -> Any:
    arguments: dict[str, Any] = {
        "run_id": env.run_id,
        "task": env.task,
        "tenant_id": env.tenant_id,
        "queue": env.queue,
        "document": env.encode(),
        "reason": "no-handler",
        "delay_seconds": 30.0,
        "worker_id": "old-worker",
        "receive_count": 1,
    }
    with engine.begin() as connection:
        return defer_run(connection, **{**arguments, **overrides})


def lease(conn: Any, run_id: uuid.UUID, task: str, tenant_id: int | None, worker: str) -> attempts.Claim:
    return attempts.take_lease(
        conn,
        run_id=run_id,
        task=task,
        tenant_id=tenant_id,
        worker_id=worker,
        lease_seconds=60,
        receive_count=1,
    )


def register(engine: sa.Engine, worker_id: str, tasks: list[str], queues: list[str]) -> None:
    with engine.begin() as connection:
        presence.register(connection, worker_id=worker_id, tasks=tasks, queues=queues)


# --- the deferral primitive -------------------------------------------------------------------


def test_a_deferred_run_is_pending_again_with_nothing_spent(
    app: sessionmaker[Session], engine: sa.Engine, relay: Relay, sqs: Any, queues: dict[str, str]
) -> None:
    run_id = dispatch(app, "send_welcome", tenant_id=2)
    assert relay.run_once().sent == 1
    env = received_document(engine, run_id)
    result = defer(engine, env)
    assert result.status is DeferStatus.DEFERRED and result.deferrals == 1
    [row] = outbox_rows(engine)
    assert row.sent_at is None and row.attempts == 0
    assert dt.timedelta(seconds=25) < row.available_at - dt.datetime.now(dt.UTC) < dt.timedelta(seconds=35)
    run = run_row(engine, run_id)
    assert (run.status, run.attempts, run.lease_owner) == ("queued", 0, None)
    [step] = trail(engine, run_id)
    assert (step.status, step.attempt, step.worker_id) == ("queued", 0, "old-worker")
    assert step.detail == {"deferred": "no-handler", "delay_seconds": 30.0, "deferrals": 1}
    # another copy of the same message: the row is already pending, nothing changes
    assert defer(engine, env).status is DeferStatus.ALREADY_PENDING
    assert len(trail(engine, run_id)) == 1


def test_the_delay_can_grow_with_earlier_deferrals(app: sessionmaker[Session], engine: sa.Engine) -> None:
    run_id = dispatch(app, "audit")
    env = received_document(engine, run_id)
    seen: list[int] = []
    for _ in range(3):
        with engine.begin() as conn:  # the relay sent it again
            conn.execute(sa.text("UPDATE platform_outbox_messages SET sent_at = clock_timestamp()"))
        defer(engine, env, delay_seconds=lambda earlier: seen.append(earlier) or 2.0**earlier)
    assert seen == [0, 1, 2]
    assert [t.detail["delay_seconds"] for t in trail(engine, run_id)] == [1.0, 2.0, 4.0]


def test_a_purged_outbox_row_is_put_back_from_the_received_envelope(
    app: sessionmaker[Session], engine: sa.Engine
) -> None:
    run_id = dispatch(app, "send_welcome", tenant_id=3)
    env = received_document(engine, run_id)
    with engine.begin() as conn:
        conn.execute(sa.text("DELETE FROM outbox_messages"))
    assert defer(engine, env).status is DeferStatus.DEFERRED
    [row] = outbox_rows(engine)
    assert (row.run_id, row.tenant_id, row.sent_at) == (run_id, 3, None)
    assert row.envelope == json.loads(env.encode())


@pytest.mark.parametrize("priority", [1, 8])
def test_a_purged_outbox_row_put_back_keeps_the_runs_priority(
    app: sessionmaker[Session], engine: sa.Engine, priority: int
) -> None:
    """The re-written row takes its priority from the run (task_runs.priority), not the
    column's default: a priority-8 run deferred after the purge must not jump the queue, nor
    a priority-1 run fall behind."""
    run_id = dispatch(app, "send_welcome", tenant_id=3, priority=priority)
    assert run_row(engine, run_id).priority == priority
    env = received_document(engine, run_id)
    with engine.begin() as conn:
        conn.execute(sa.text("DELETE FROM outbox_messages"))
    assert defer(engine, env).status is DeferStatus.DEFERRED
    [row] = outbox_rows(engine)
    assert (row.run_id, row.priority, row.queue) == (run_id, priority, env.queue)


def test_a_deferral_never_makes_a_delayed_run_due_earlier(
    app: sessionmaker[Session], engine: sa.Engine
) -> None:
    """An early copy of a delayed run (forged, or a stale duplicate) handed to a worker that
    defers it, whether the outbox row is still there or was purged, keeps the run's due time."""
    run_id = dispatch(app, "send_welcome", tenant_id=2, delay=dt.timedelta(hours=1))
    env = received_document(engine, run_id)
    due = run_row(engine, run_id).available_at
    with engine.begin() as conn:  # as if the relay had sent it (say, after a hold)
        conn.execute(sa.text("UPDATE outbox_messages SET sent_at = clock_timestamp()"))
    assert defer(engine, env, delay_seconds=0.0).status is DeferStatus.DEFERRED
    [row] = outbox_rows(engine)
    assert row.sent_at is None and row.available_at == due
    with engine.begin() as conn:
        conn.execute(sa.text("DELETE FROM outbox_messages"))
    assert defer(engine, env, delay_seconds=0.0, reason="worker-stopping").status is DeferStatus.DEFERRED
    [row] = outbox_rows(engine)
    assert row.available_at == due


def test_runs_that_are_not_ours_or_not_waiting_are_not_deferred(
    app: sessionmaker[Session], engine: sa.Engine
) -> None:
    run_id = dispatch(app, "send_welcome", tenant_id=3)
    env = received_document(engine, run_id)
    forged = envelope.Envelope(run_id, env.task, env.queue, env.tenant_id, '{"n":666}')
    assert defer(engine, forged, document=forged.encode()).claim.status is attempts.ClaimStatus.MISMATCH
    assert defer(engine, env, task="audit").claim.status is attempts.ClaimStatus.MISMATCH
    assert defer(engine, env, run_id=uuid.uuid4()).claim.status is attempts.ClaimStatus.NOT_FOUND
    with engine.begin() as conn:  # another worker is running it
        claim = lease(conn, run_id, env.task, 3, "new")
    leased = defer(engine, env).claim
    assert leased.status is attempts.ClaimStatus.LEASED and leased.lease_remaining_seconds > 50
    with engine.begin() as conn:
        attempts.mark_succeeded(conn, attempts.Attempt(run_id, claim.attempt, 1, "new"))
    assert defer(engine, env).claim.status is attempts.ClaimStatus.SUCCEEDED
    assert [t.status for t in trail(engine, run_id)] == ["running", "succeeded"]


def test_a_leased_attempt_can_defer_itself_without_counting(
    app: sessionmaker[Session], engine: sa.Engine
) -> None:
    """For hold-back checks made after taking the lease (issue 13's limits): the attempt
    is given back, not counted."""
    run_id = dispatch(app, "audit")
    env = received_document(engine, run_id)
    with engine.begin() as conn:
        claim = lease(conn, run_id, "audit", None, "w")
    assert defer(engine, env, attempt=claim.attempt, reason="rate-limit").status is DeferStatus.DEFERRED
    run = run_row(engine, run_id)
    assert (run.status, run.attempts, run.lease_owner, run.lease_expires_at) == ("queued", 0, None, None)
    assert trail(engine, run_id)[-1].detail["deferred"] == "rate-limit"


def test_an_attempt_that_failed_during_an_outage_is_deferred_with_its_error(
    app: sessionmaker[Session], engine: sa.Engine
) -> None:
    """A failure the breaker's outage pays for (``verdict.ride_out``): the attempt is given
    back, and its error is on the run and in the trail, as a retry would record it."""
    run_id = dispatch(app, "audit")
    env = received_document(engine, run_id)
    with engine.begin() as conn:
        claim = lease(conn, run_id, "audit", None, "w")
    failure = attempts.Failure.from_exception(RuntimeError("stub answered 500\x00"), "Traceback ...")
    result = defer(engine, env, attempt=claim.attempt, reason="breaker-outage", failure=failure)
    assert result.status is DeferStatus.DEFERRED
    run = run_row(engine, run_id)
    assert (run.status, run.attempts, run.last_error_type) == ("queued", 0, "RuntimeError")
    assert run.last_error == "stub answered 500\\x00"
    step = trail(engine, run_id)[-1]
    assert (step.status, step.error_type, step.traceback) == ("queued", "RuntimeError", "Traceback ...")
    assert step.detail["deferred"] == "breaker-outage"


def test_an_attempt_whose_run_a_cancel_asked_to_stop_is_not_deferred(
    app: sessionmaker[Session], engine: sa.Engine
) -> None:
    """A ``Cancel`` committed while the attempt ran wins: nothing changes, the caller ends
    the run ``cancelled`` (the worker's ``mark_cancelled``), it is not queued again."""
    run_id = dispatch(app, "audit")
    env = received_document(engine, run_id)
    with engine.begin() as conn:
        claim = lease(conn, run_id, "audit", None, "w")
        conn.execute(
            sa.text("UPDATE task_runs SET cancel_requested_at = clock_timestamp() WHERE run_id = :r"),
            {"r": run_id},
        )
    result = defer(engine, env, attempt=claim.attempt, reason="breaker-outage")
    assert result.status is DeferStatus.NOT_DEFERRABLE
    assert result.claim.status is attempts.ClaimStatus.CANCELLED
    assert (run_row(engine, run_id).status, run_row(engine, run_id).attempts) == ("running", 1)
    with engine.begin() as conn:
        assert attempts.mark_cancelled(conn, attempts.Attempt(run_id, claim.attempt, 1, "w"))


# --- the relay and presence -------------------------------------------------------------------


def test_the_relay_holds_rows_no_live_worker_implements_and_releases_them_when_one_appears(
    app: sessionmaker[Session], engine: sa.Engine, relay: Relay, sqs: Any, queues: dict[str, str]
) -> None:
    register(engine, "old:1", ["audit", "maintenance.purge"], ["default", "maintenance"])
    new_task = dispatch(app, "send_welcome", tenant_id=1)  # only the new code implements it
    old_task = dispatch(app, "audit", tenant_id=1)
    result = relay.run_once()
    assert (result.claimed, result.sent, result.held) == (2, 1, 1)
    [message] = receive_all(sqs, queues["default"], expect=1)
    assert json.loads(message["Body"])["run_id"] == str(old_task)
    held = next(r for r in outbox_rows(engine) if r.run_id == new_task)
    assert held.sent_at is None and held.attempts == 0 and held.available_at > dt.datetime.now(dt.UTC)
    assert relay.run_once().claimed == 0  # not cycled: it waits out its hold
    with engine.connect() as conn:
        report = status.collect(conn, relay.settings)
    [waiting] = report.waiting_for_a_worker
    assert (waiting.task, waiting.queue, waiting.pending) == ("send_welcome", "default", 1)
    assert waiting.waited_seconds >= 0
    assert [w.worker_id for w in report.workers] == ["old:1"]

    register(engine, "new:1", ["audit", "send_welcome"], ["default"])
    assert relay.holder is not None
    relay.holder.reread_soon()  # (a running relay re-reads presence every 2 s)
    result = relay.run_once()
    assert (result.sent, result.held) == (1, 0)
    assert [json.loads(m["Body"])["run_id"] for m in receive_all(sqs, queues["default"], expect=1)] == [
        str(new_task)
    ]
    assert run_row(engine, new_task).attempts == 0


def test_a_task_on_a_queue_no_live_worker_consumes_is_held_too(
    app: sessionmaker[Session], engine: sa.Engine, relay: Relay
) -> None:
    register(engine, "w:1", ["index_user", "audit"], ["default"])  # bulk is not consumed
    dispatch(app, "index_user")
    assert relay.run_once().held == 1


def test_without_any_registered_worker_nothing_is_held(
    app: sessionmaker[Session], engine: sa.Engine, relay: Relay, settings: OutboxSettings
) -> None:
    dispatch(app, "send_welcome")
    assert relay.run_once().sent == 1
    with engine.connect() as conn:
        assert status.collect(conn, settings).waiting_for_a_worker == []


def test_a_silent_worker_stops_counting_after_the_ttl(
    app: sessionmaker[Session], engine: sa.Engine, relay: Relay
) -> None:
    register(engine, "alive:1", ["audit"], ["default"])
    register(engine, "dead:1", ["send_welcome"], ["default"])
    with engine.begin() as conn:  # its last heartbeat was a minute ago (kill -9)
        conn.execute(
            sa.text(
                "UPDATE worker_presence SET heartbeat_at = clock_timestamp() - interval '1 minute' "
                "WHERE worker_id = 'dead:1'"
            )
        )
    dispatch(app, "send_welcome")
    assert relay.run_once().held == 1
    with engine.connect() as conn:
        assert [w.worker_id for w in presence.live_workers(conn)] == ["alive:1"]


def test_holding_can_be_turned_off(
    app: sessionmaker[Session], engine: sa.Engine, settings: OutboxSettings, sqs_endpoint: str, queues: Any
) -> None:
    register(engine, "old:1", ["audit"], ["default"])
    dispatch(app, "send_welcome")
    relay = Relay(settings.replace(sqs_endpoint_url=sqs_endpoint, relay_hold_unserved=False), engine=engine)
    try:
        assert relay.run_once().sent == 1
    finally:
        relay.sender.close()
