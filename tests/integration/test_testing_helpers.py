"""sqla_outbox.testing and the pytest plugin's ``outbox`` fixture, against real PostgreSQL."""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.orm import Session, sessionmaker

import sqla_outbox
from sqla_outbox import Dispatch, Publish, errors, testing
from sqla_outbox.catalog import Catalog
from sqla_outbox.config import OutboxSettings
from sqla_outbox.worker import Registry, RetryPolicy, TaskContext
from tests import support

ROOT = Path(__file__).resolve().parents[2]
_EFFECT = sa.text(
    "INSERT INTO effects (run_id, task, attempt, worker, note) VALUES (:run_id, :task, :a, :w, :n)"
)


def _effect_params(ctx: TaskContext, note: str) -> dict[str, Any]:
    return {"run_id": ctx.run_id, "task": ctx.task, "a": ctx.attempt, "w": "inline", "n": note}


@pytest.fixture
def registry() -> Registry:
    """Handlers for the test catalog's tasks; each records an ``effects`` row."""
    registry = Registry()

    @registry.task("send_welcome")
    def send_welcome(payload: dict[str, Any], ctx: TaskContext) -> None:
        assert isinstance(ctx.session, Session)
        ctx.session.execute(_EFFECT, _effect_params(ctx, f"welcome {payload['user_id']}"))

    @registry.task("index_user", queue="bulk", subscribes=["user.created"])
    async def index_user(payload: dict[str, Any], ctx: TaskContext) -> None:
        assert isinstance(ctx.session, AsyncSession)
        await asyncio.sleep(0)
        await ctx.session.execute(_EFFECT, _effect_params(ctx, f"indexed {payload['user_id']}"))

    @registry.task(
        "charge_card",
        queue="critical",
        scope="tenant",
        permanent=(KeyError,),
        retry=RetryPolicy(max_receives=3),
    )
    def charge_card(payload: dict[str, Any], ctx: TaskContext) -> None:
        behaviour = payload.get("behaviour")
        if behaviour == "flaky" and ctx.attempt == 1:
            raise ConnectionError("gateway timed out")
        if behaviour == "down":
            raise ConnectionError("gateway down")
        if behaviour == "declined":
            raise errors.ValidationFailed("card declined")
        if behaviour == "bad-payload":
            payload["card"]  # KeyError: listed in permanent=
        if behaviour == "later" and ctx.attempt == 1:
            raise errors.Retry(30)
        ctx.session.execute(_EFFECT, _effect_params(ctx, "charged"))

    @registry.task("rebuild_cache", queue="maintenance", scope="platform")
    def rebuild_cache(payload: dict[str, Any], ctx: TaskContext) -> None:
        ctx.session.execute(_EFFECT, _effect_params(ctx, "rebuilt"))
        ctx.session.add(Dispatch("audit", {"what": "cache rebuilt", "again": 0}))  # a follow-up

    @registry.task("audit")
    def audit(payload: dict[str, Any]) -> None:  # no context: payload only
        if payload.get("again"):
            raise AssertionError("only the looping variant below dispatches again")

    return registry


def _looping_registry() -> Registry:
    registry = Registry()

    @registry.task("audit")
    def audit(payload: dict[str, Any], ctx: TaskContext) -> None:
        ctx.session.add(Dispatch("audit", {"n": payload["n"] + 1}))

    return registry


def _notes(engine: sa.Engine, task: str | None = None) -> list[str]:
    return [row.note for row in support.effects(engine) if task is None or row.task == task]


def _trail_statuses(engine: sa.Engine, run_id: Any) -> list[str]:
    return [row.status for row in support.trail(engine, run_id)]


# --------------------------------------------------------------------------------------
# reading


def test_dispatched_reads_the_transaction_then_committed_rows(app: sessionmaker[Session], engine: sa.Engine):
    with app.begin() as session:
        session.add(
            Dispatch(
                "send_welcome",
                {"user_id": 7, "tags": ("a", "b")},
                tenant_id=3,
                delay=dt.timedelta(minutes=10),
                idempotency_key="welcome-7",
            )
        )
        session.add(Dispatch("rebuild_cache", {"scope": "all"}))
        session.add(Publish("user.created", {"user_id": 7}, tenant_id=3))
        inside = testing.dispatched(session)  # flushed by the helper, read in the transaction
        assert testing.dispatched(engine) == []  # not committed yet
    assert sorted(run.task for run in inside) == [
        "index_user",
        "rebuild_cache",
        "send_welcome",
        "send_welcome",
    ]

    committed = testing.dispatched(engine)
    assert [r.run_id for r in committed] == [r.run_id for r in testing.dispatched(app)]
    with engine.connect() as connection:
        assert [r.run_id for r in testing.dispatched(connection)] == [r.run_id for r in committed]
    assert {r.run_id for r in committed} == {r.run_id for r in inside}

    [welcome] = testing.dispatched(engine, task="send_welcome", event=None)
    assert welcome.payload == {"user_id": 7, "tags": ["a", "b"]}
    assert (welcome.tenant_id, welcome.queue, welcome.event) == (3, "default", None)
    assert welcome.idempotency_key == "welcome-7"
    assert welcome.delay == dt.timedelta(minutes=10)
    assert welcome.available_at - welcome.created_at == pytest.approx(
        dt.timedelta(minutes=10), abs=dt.timedelta(milliseconds=10)
    )
    assert (welcome.status, welcome.attempts, welcome.pending, welcome.last_error) == (
        "queued",
        0,
        True,
        None,
    )

    [cache] = testing.dispatched(engine, tenant_id=None)
    assert (cache.task, cache.queue, cache.payload, cache.delay) == (
        "rebuild_cache",
        "maintenance",
        {"scope": "all"},
        dt.timedelta(0),
    )
    published = testing.dispatched(engine, event="user.created")
    assert sorted(r.task for r in published) == ["index_user", "send_welcome"]
    assert {r.tenant_id for r in published} == {3}
    assert len(testing.dispatched(engine, tenant_id=3)) == 3
    assert testing.dispatched(engine, tenant_id=4) == []


def test_a_rolled_back_transaction_dispatched_nothing(app: sessionmaker[Session], engine: sa.Engine):
    with app() as session:
        session.begin()
        session.add(Dispatch("send_welcome", {"user_id": 1}, tenant_id=1))
        testing.assert_dispatched(session, "send_welcome", tenant_id=1)
        session.rollback()
    testing.assert_not_dispatched(engine, "send_welcome")
    assert testing.dispatched(engine) == []


def test_assert_dispatched_matches_fields_and_returns_the_runs(app: sessionmaker[Session], engine: sa.Engine):
    with app.begin() as session:
        first = Dispatch("send_welcome", {"user_id": 1}, tenant_id=1, delay=90)
        session.add(first)
        session.add(Dispatch("send_welcome", {"user_id": 2}, tenant_id=1, delay=90))
        session.add(Dispatch("charge_card", {"amount": 5}, tenant_id=2))

    [run] = testing.assert_dispatched(engine, "send_welcome", payload={"user_id": 1})
    assert run.run_id == first.run_id
    assert len(testing.assert_dispatched(engine, "send_welcome", tenant_id=1, delay=90, count=2)) == 2
    testing.assert_dispatched(engine, "send_welcome", delay=dt.timedelta(seconds=90), queue="default")
    testing.assert_dispatched(
        engine, "send_welcome", payload=lambda p: isinstance(p, dict) and p["user_id"] > 1
    )
    testing.assert_dispatched(engine, "charge_card", tenant_id=2, event=None, status="queued", count=1)
    testing.assert_not_dispatched(engine, "charge_card", tenant_id=1)
    testing.assert_not_dispatched(engine, "send_welcome", delay=0)


def test_assert_dispatched_message_lists_what_was_dispatched(app: sessionmaker[Session], engine: sa.Engine):
    with pytest.raises(AssertionError) as empty:
        testing.assert_dispatched(engine, "send_welcome")
    assert str(empty.value) == (
        "expected a dispatch of task 'send_welcome', found 0.\n"
        "Dispatched: nothing (the outbox tables are empty)."
    )

    with app.begin() as session:
        session.add(Dispatch("send_welcome", {"user_id": 7}, tenant_id=3, delay=60))
        session.add(Dispatch("rebuild_cache", {"scope": "all"}))

    with pytest.raises(AssertionError) as mismatch:
        testing.assert_dispatched(engine, "send_welcome", payload={"user_id": 8}, tenant_id=4, delay=60)
    message = str(mismatch.value)
    assert message.startswith(
        "expected a dispatch of task 'send_welcome' with tenant_id=4, payload={\"user_id\": 8}, "
        "delay=60s, found 0.\nRuns that differ:\n"
        '  - send_welcome tenant_id=3 queue=default delay=60s status=queued payload={"user_id": 7}\n'
        "      tenant_id: expected 4, got 3\n"
        '      payload: expected {"user_id": 8}, got {"user_id": 7}\n'
        "Dispatched (2 run(s) in the outbox):\n"
    ), message
    assert (
        '  - rebuild_cache tenant_id=None queue=maintenance delay=0s status=queued payload={"scope": "all"}'
        in (message)
    )

    with pytest.raises(
        AssertionError, match=r"expected 2 dispatch\(es\) of task 'send_welcome', found 1\."
    ) as few:
        testing.assert_dispatched(engine, "send_welcome", count=2)
    assert "Matching runs:\n  - send_welcome tenant_id=3" in str(few.value)


def test_assert_not_dispatched_lists_the_matches(app: sessionmaker[Session], engine: sa.Engine):
    with app.begin() as session:
        session.add(Dispatch("charge_card", {"amount": 5}, tenant_id=2, idempotency_key="order-9"))
    with pytest.raises(AssertionError) as caught:
        testing.assert_not_dispatched(engine, "charge_card", tenant_id=2)
    assert str(caught.value) == (
        "expected no dispatch of task 'charge_card' with tenant_id=2, found 1:\n"
        "  - charge_card tenant_id=2 queue=critical delay=0s status=queued idempotency_key='order-9' "
        'payload={"amount": 5}'
    )


def test_assert_published(app: sessionmaker[Session], engine: sa.Engine):
    with app.begin() as session:
        session.add(Publish("user.created", {"user_id": 7}, tenant_id=3, delay=5))
        session.add(Publish("nobody.listens", {}))  # no subscribers: writes nothing

    runs = testing.assert_published(
        engine, "user.created", payload={"user_id": 7}, tenant_id=3, delay=5, count=1,
        subscribers=["send_welcome", "index_user"],
    )  # fmt: skip
    assert sorted(r.task for r in runs) == ["index_user", "send_welcome"]
    assert len({r.run_id for r in runs}) == 2  # one run per subscriber

    with pytest.raises(AssertionError) as wrong_subscribers:
        testing.assert_published(engine, "user.created", subscribers=["send_welcome"])
    assert str(wrong_subscribers.value).startswith(
        "expected event 'user.created' to reach subscribers ['send_welcome'], "
        "found runs of ['index_user', 'send_welcome'].\nMatching runs:\n"
    )
    with pytest.raises(
        AssertionError, match=r"published 2 time\(s\), found runs per subscriber: index_user: 1"
    ):
        testing.assert_published(engine, "user.created", count=2)
    with pytest.raises(AssertionError) as other_payload:
        testing.assert_published(engine, "user.created", payload={"user_id": 8})
    assert 'payload: expected {"user_id": 8}, got {"user_id": 7}' in str(other_payload.value)
    with pytest.raises(
        AssertionError, match=r"expected event 'nobody.listens' to be published, found no run"
    ):
        testing.assert_published(engine, "nobody.listens")


def test_reading_from_an_async_session(database_url: str, settings: OutboxSettings, catalog: Catalog):
    from sqlalchemy.ext.asyncio import async_sessionmaker, create_async_engine

    async def scenario() -> None:
        engine = create_async_engine(database_url)
        maker = async_sessionmaker(engine)
        sqla_outbox.install(maker, settings, catalog=catalog)
        try:
            async with maker() as session, session.begin():
                session.add(Dispatch("send_welcome", {"user_id": 1}, tenant_id=1))
                found = await session.run_sync(testing.dispatched, task="send_welcome")
                assert [r.payload for r in found] == [{"user_id": 1}]
                await session.run_sync(testing.assert_dispatched, "send_welcome", tenant_id=1)
                with pytest.raises(errors.ConfigurationError, match="run_sync"):
                    testing.dispatched(session)
        finally:
            sqla_outbox.uninstall(maker)
            await engine.dispose()

    asyncio.run(scenario())


def test_reading_refuses_other_sources():
    with pytest.raises(errors.ConfigurationError, match="pass a Session, Connection, Engine or sessionmaker"):
        testing.dispatched("postgresql://nowhere")


# --------------------------------------------------------------------------------------
# running inline


def test_run_pending_runs_sync_and_async_handlers(
    app: sessionmaker[Session], engine: sa.Engine, registry: Registry
):
    with app.begin() as session:
        session.add(Dispatch("send_welcome", {"user_id": 1}, tenant_id=1))
        session.add(Publish("user.created", {"user_id": 2}, tenant_id=2))

    report = testing.run_pending(app, registry=registry)

    report.assert_all_succeeded()
    assert report.rounds == 1
    assert sorted((o.task, o.tenant_id, o.event) for o in report.runs) == [
        ("index_user", 2, "user.created"),
        ("send_welcome", 1, None),
        ("send_welcome", 2, "user.created"),
    ]
    assert all((o.status, o.attempts, o.failures, o.round) == ("succeeded", 1, (), 1) for o in report.runs)
    assert sorted(_notes(engine)) == ["indexed 2", "welcome 1", "welcome 2"]
    for run in testing.dispatched(engine):
        assert (run.status, run.attempts, run.pending) == ("succeeded", 1, False)
        assert _trail_statuses(engine, run.run_id) == ["running", "succeeded"]
        assert support.run_row(engine, run.run_id).lease_owner is None
        assert {row.worker_id for row in support.trail(engine, run.run_id) if row.status == "running"} == {
            testing.WORKER_ID
        }
    # nothing left: a second call does nothing, and never runs a handler twice
    again = testing.run_pending(app, registry=registry)
    assert (again.runs, again.rounds) == ([], 0)
    assert len(support.effects(engine)) == 3


def test_run_pending_inside_a_running_event_loop(
    app: sessionmaker[Session], engine: sa.Engine, registry: Registry
):
    with app.begin() as session:
        session.add(Publish("user.created", {"user_id": 5}, tenant_id=1))

    async def async_test() -> testing.RunReport:
        return testing.run_pending(app, registry=registry)  # async handlers run on a helper thread

    report = asyncio.run(async_test())
    report.assert_all_succeeded()
    assert sorted(_notes(engine)) == ["indexed 5", "welcome 5"]


def test_a_transient_failure_is_retried_until_it_succeeds(
    app: sessionmaker[Session], engine: sa.Engine, registry: Registry
):
    with app.begin() as session:
        flaky = Dispatch("charge_card", {"behaviour": "flaky"}, tenant_id=1)
        session.add(flaky)

    report = testing.run_pending(app, registry=registry)

    outcome = report.by_run_id(flaky.run_id)
    assert (outcome.status, outcome.attempts, outcome.reason, outcome.error) == ("succeeded", 2, None, None)
    [failure] = outcome.failures
    assert (failure.error_type, failure.message) == ("ConnectionError", "gateway timed out")
    assert failure.traceback is not None and "gateway timed out" in failure.traceback
    assert _trail_statuses(engine, flaky.run_id)[-4:] == ["running", "retrying", "running", "succeeded"]
    assert [row.attempt for row in support.effects(engine)] == [2]  # the failed attempt left nothing
    run = support.run_row(engine, flaky.run_id)
    assert (run.status, run.attempts, run.last_error_type) == ("succeeded", 2, "ConnectionError")


def test_without_retries_a_transient_failure_stays_pending_for_the_next_call(
    app: sessionmaker[Session], engine: sa.Engine, registry: Registry
):
    with app.begin() as session:
        flaky = Dispatch("charge_card", {"behaviour": "flaky"}, tenant_id=1)
        session.add(flaky)

    first = testing.run_pending(app, registry=registry, retries=False)
    assert (first.by_run_id(flaky.run_id).status, first.rounds) == ("retrying", 1)
    assert [o.run_id for o in first.retrying] == [flaky.run_id]
    assert first.by_run_id(flaky.run_id).error is not None
    [run] = testing.assert_dispatched(engine, "charge_card", status="retrying")
    assert run.pending and run.last_error == "gateway timed out"
    with pytest.raises(
        AssertionError, match=r"1 of 1 run\(s\) did not succeed:\n  - charge_card .*: retrying"
    ):
        first.assert_all_succeeded()

    second = testing.run_pending(app, registry=registry, retries=False)
    outcome = second.by_run_id(flaky.run_id)
    assert (outcome.status, outcome.attempts) == ("succeeded", 1)
    assert support.run_row(engine, flaky.run_id).attempts == 2
    assert [row.note for row in support.effects(engine)] == ["charged"]


def test_a_transient_failure_fails_the_run_at_its_receive_limit(
    app: sessionmaker[Session], engine: sa.Engine, registry: Registry
):
    with app.begin() as session:
        down = Dispatch("charge_card", {"behaviour": "down"}, tenant_id=1)
        session.add(down)

    report = testing.run_pending(app, registry=registry)

    outcome = report.by_run_id(down.run_id)
    assert (outcome.status, outcome.attempts, outcome.reason) == (
        "failed",
        3,
        "retries-exhausted",
    )  # max_receives=3
    assert [f.message for f in outcome.failures] == ["gateway down"] * 3
    assert report.failed == [outcome]
    assert _trail_statuses(engine, down.run_id)[-2:] == ["running", "failed"]
    assert support.trail(engine, down.run_id)[-1].detail == {"reason": "retries-exhausted"}
    with pytest.raises(AssertionError) as caught:
        report.assert_all_succeeded()
    assert "charge_card tenant_id=1" in str(caught.value)
    assert "failed after 3 attempt(s) [retries-exhausted]; last error ConnectionError: gateway down" in str(
        caught.value
    )
    assert 'raise ConnectionError("gateway down")' in str(caught.value)  # the traceback excerpt


@pytest.mark.parametrize(
    ("behaviour", "error_type"),
    [("declined", "sqla_outbox.errors.ValidationFailed"), ("bad-payload", "KeyError")],
)
def test_a_permanent_failure_fails_the_run_at_once(
    app: sessionmaker[Session], engine: sa.Engine, registry: Registry, behaviour: str, error_type: str
):
    with app.begin() as session:
        bad = Dispatch("charge_card", {"behaviour": behaviour}, tenant_id=1)
        session.add(bad)
        session.add(Dispatch("charge_card", {"behaviour": "fine"}, tenant_id=1))

    report = testing.run_pending(app, registry=registry)

    outcome = report.by_run_id(bad.run_id)
    assert (outcome.status, outcome.attempts, outcome.reason) == ("failed", 1, "permanent-error")
    assert outcome.error is not None and outcome.error.error_type == error_type
    assert [o.status for o in report.runs] == ["failed", "succeeded"]  # one failing run spoils nothing else
    run = support.run_row(engine, bad.run_id)
    assert (run.status, run.last_error_type, run.finished_at is not None) == ("failed", error_type, True)
    assert run.dead_lettered_at is None  # inline: there is no DLQ
    [listed] = testing.assert_dispatched(engine, "charge_card", status="failed")
    assert not listed.pending
    assert _notes(engine) == ["charged"]


def test_retry_requested_by_the_handler_runs_again(
    app: sessionmaker[Session], engine: sa.Engine, registry: Registry
):
    with app.begin() as session:
        later = Dispatch("charge_card", {"behaviour": "later"}, tenant_id=1)
        session.add(later)
    outcome = testing.run_pending(app, registry=registry).by_run_id(later.run_id)
    assert (outcome.status, outcome.attempts) == ("succeeded", 2)
    assert outcome.failures[0].error_type == "sqla_outbox.errors.Retry"


def test_follow_up_dispatches_run_in_a_later_round(
    app: sessionmaker[Session], engine: sa.Engine, registry: Registry
):
    with app.begin() as session:
        session.add(Dispatch("rebuild_cache", {}))

    report = testing.run_pending(app, registry=registry)

    report.assert_all_succeeded()
    assert report.rounds == 2
    assert [(o.task, o.round, o.tenant_id) for o in report.runs] == [
        ("rebuild_cache", 1, None),
        ("audit", 2, None),
    ]
    testing.assert_dispatched(
        engine, "audit", payload={"what": "cache rebuilt", "again": 0}, status="succeeded"
    )
    assert report.statuses() == {"rebuild_cache": "succeeded", "audit": "succeeded"}


def test_follow_ups_with_an_engine_source_use_the_given_catalog(engine: sa.Engine, registry: Registry):
    session_factory = sessionmaker(engine)
    sqla_outbox.install(
        session_factory, OutboxSettings(valkey_url=None), catalog=Catalog.from_dict(support.CATALOG)
    )
    try:
        with session_factory.begin() as session:
            session.add(Dispatch("rebuild_cache", {}))
    finally:
        sqla_outbox.uninstall(session_factory)

    report = testing.run_pending(engine, registry=registry, catalog=Catalog.from_dict(support.CATALOG))

    assert [(o.task, o.status) for o in report.runs] == [
        ("rebuild_cache", "succeeded"),
        ("audit", "succeeded"),
    ]


def test_an_installation_on_the_session_class_is_used_as_it_is(
    engine: sa.Engine, registry: Registry, settings: OutboxSettings, catalog: Catalog
):
    class AppSession(Session):
        pass

    sqla_outbox.install(AppSession, settings, catalog=catalog)
    try:
        factory = sessionmaker(engine, class_=AppSession)
        with factory.begin() as session:
            session.add(Dispatch("rebuild_cache", {}))
        report = testing.run_pending(factory, registry=registry)
        assert sqla_outbox.installation_for(factory) is None  # no second set of listeners
    finally:
        sqla_outbox.uninstall(AppSession)
    assert [(o.task, o.status) for o in report.runs] == [
        ("rebuild_cache", "succeeded"),
        ("audit", "succeeded"),
    ]
    assert len(testing.dispatched(engine, task="audit")) == 1


def test_delayed_runs_wait_unless_included(app: sessionmaker[Session], engine: sa.Engine, registry: Registry):
    with app.begin() as session:
        later = Dispatch("send_welcome", {"user_id": 1}, tenant_id=1, delay=dt.timedelta(hours=1))
        session.add(later)
        session.add(Dispatch("send_welcome", {"user_id": 2}, tenant_id=1))

    now = testing.run_pending(app, registry=registry)
    assert [o.payload for o in now.runs] == [{"user_id": 2}]
    testing.assert_dispatched(engine, "send_welcome", payload={"user_id": 1}, status="queued", delay=3600)

    everything = testing.run_pending(app, registry=registry, include_delayed=True)
    assert [(o.run_id, o.status) for o in everything.runs] == [(later.run_id, "succeeded")]
    assert sorted(_notes(engine)) == ["welcome 1", "welcome 2"]


def test_tasks_limits_what_runs(app: sessionmaker[Session], engine: sa.Engine, registry: Registry):
    with app.begin() as session:
        session.add(Dispatch("send_welcome", {"user_id": 1}, tenant_id=1))
        session.add(Dispatch("charge_card", {}, tenant_id=1))
    report = testing.run_pending(app, registry=registry, tasks=["charge_card"])
    assert [o.task for o in report.runs] == ["charge_card"]
    testing.assert_dispatched(engine, "send_welcome", status="queued")


def test_a_task_without_handler_waits_like_in_the_worker(app: sessionmaker[Session], engine: sa.Engine):
    """A worker without the handler hands the run back to the outbox, unleased, for a worker
    that has it: inline, the run stays queued with its row pending, and the report says so."""
    with app.begin() as session:
        session.add(Dispatch("send_welcome", {"user_id": 1}))
    report = testing.run_pending(app, registry=Registry())
    [outcome] = report.runs
    assert (outcome.status, outcome.skipped, outcome.attempts, outcome.reason) == (
        "queued",
        "no-handler",
        0,
        None,
    )
    [run] = testing.assert_dispatched(engine, "send_welcome", status="queued")
    assert _trail_statuses(engine, run.run_id) == []  # no lease taken, nothing spent
    with engine.connect() as conn:
        pending = conn.execute(sa.text("SELECT count(*) FROM platform_outbox_messages WHERE sent_at IS NULL"))
        assert pending.scalar_one() == 1
    with pytest.raises(AssertionError, match=r"send_welcome .*: queued \(not executed: no-handler\)"):
        report.assert_all_succeeded()


def test_endless_follow_ups_stop_at_max_rounds(app: sessionmaker[Session], engine: sa.Engine):
    with app.begin() as session:
        session.add(Dispatch("audit", {"n": 0}))
    with pytest.raises(testing.RoundLimitReached, match=r"still 1 due run\(s\) after 3 round\(s\)") as caught:
        testing.run_pending(app, registry=_looping_registry(), max_rounds=3)
    assert [o.payload for o in caught.value.report.runs] == [{"n": 0}, {"n": 1}, {"n": 2}]
    assert (caught.value.max_rounds, caught.value.left) == (3, 1)
    # a library error like every other, not an assertion (python -O must not change it)
    assert isinstance(caught.value, errors.OutboxError) and not isinstance(caught.value, AssertionError)


def test_a_finished_run_is_not_executed_again(
    app: sessionmaker[Session], engine: sa.Engine, registry: Registry
):
    with app.begin() as session:
        once = Dispatch("send_welcome", {"user_id": 1}, tenant_id=1)
        session.add(once)
    testing.run_pending(app, registry=registry)
    with engine.begin() as connection:  # the relay resending a row (at-least-once delivery)
        connection.execute(sa.text("UPDATE outbox_messages SET sent_at = NULL"))
    [outcome] = testing.run_pending(app, registry=registry).runs
    assert (outcome.skipped, outcome.status, outcome.attempts) == ("already-succeeded", "succeeded", 0)
    assert _notes(engine) == ["welcome 1"]


# --------------------------------------------------------------------------------------
# the pytest plugin


@pytest.fixture
def outbox_session_factory(app: sessionmaker[Session]) -> sessionmaker[Session]:
    return app


@pytest.fixture
def outbox_registry(registry: Registry) -> Registry:
    return registry


def test_the_outbox_fixture(app: sessionmaker[Session], engine: sa.Engine, outbox: testing.Outbox):
    with app.begin() as session:
        session.add(Publish("user.created", {"user_id": 4}, tenant_id=4))
        outbox.assert_published("user.created", tenant_id=4, session=session)
        assert outbox.dispatched() == []  # committed rows only, without session=
    outbox.assert_published("user.created", subscribers=["send_welcome", "index_user"])
    outbox.assert_dispatched("send_welcome", payload={"user_id": 4}, event="user.created")
    outbox.assert_not_dispatched("send_welcome", event=None)
    assert len(outbox.dispatched(tenant_id=4)) == 2

    outbox.run_pending().assert_all_succeeded()

    assert sorted(_notes(engine)) == ["indexed 4", "welcome 4"]
    outbox.assert_dispatched("index_user", status="succeeded")


@pytest.fixture
def plugin_project(tmp_path: Path) -> Iterator[Path]:
    """An application's test directory that knows nothing of this repository's conftest."""
    (tmp_path / "test_uses_outbox.py").write_text(
        textwrap.dedent(
            """
            import os
            import sys

            import pytest
            import sqlalchemy as sa
            from sqlalchemy.orm import sessionmaker

            import sqla_outbox
            from sqla_outbox import Dispatch
            from sqla_outbox.worker import Registry

            CATALOG = {"version": 1, "tasks": {"ping": {"queue": "default"}}}
            registry = Registry()

            @registry.task("ping")
            def ping(payload, ctx):
                ctx.session.execute(sa.text("INSERT INTO effects (run_id, task) VALUES (:r, 'ping')"),
                                    {"r": ctx.run_id})

            @pytest.fixture
            def outbox_session_factory():
                engine = sa.create_engine(os.environ["APP_DATABASE_URL"])
                factory = sessionmaker(engine)
                sqla_outbox.install(factory, sqla_outbox.OutboxSettings(valkey_url=None),
                                    catalog=sqla_outbox.Catalog.from_dict(CATALOG))
                yield factory
                sqla_outbox.uninstall(factory)
                engine.dispose()

            @pytest.fixture
            def outbox_registry():
                return registry

            def test_dispatch_and_run(outbox_session_factory, outbox):
                with outbox_session_factory.begin() as session:
                    session.add(Dispatch("ping", {"n": 1}, tenant_id=1))
                outbox.assert_dispatched("ping", payload={"n": 1}, tenant_id=1)
                outbox.run_pending().assert_all_succeeded()
                outbox.assert_dispatched("ping", status="succeeded")
                assert "boto3" not in sys.modules
            """
        )
    )
    (tmp_path / "test_forgot_the_override.py").write_text("def test_needs_a_database(outbox):\n    pass\n")
    yield tmp_path


def test_the_plugin_is_found_through_its_entry_point(plugin_project: Path, database_url: str):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SQLA_OUTBOX_", "PYTEST_"))}
    env["APP_DATABASE_URL"] = database_url
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-W", "error", str(plugin_project)],
        capture_output=True,
        text=True,
        env=env,
        cwd=plugin_project,
        timeout=120,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 1, output
    assert "1 passed, 1 error" in output, output
    assert "override the `outbox_session_factory` fixture in your conftest.py" in output, output
    engine = sa.create_engine(database_url)
    try:
        assert [row.task for row in support.effects(engine)] == ["ping"]
    finally:
        engine.dispose()


def test_the_plugin_module_imports_neither_helpers_nor_boto3():
    probe = (
        "import sys, sqla_outbox.pytest_plugin; "
        "watched = ('boto3', 'sqla_outbox.testing', 'sqla_outbox.lifecycle.attempts'); "
        "print(sorted(m for m in watched if m in sys.modules))"
    )
    result = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True, cwd=ROOT
    )
    assert result.stdout.strip() == "[]"


def test_a_handler_that_commits_its_session_fails_and_its_effects_roll_back(
    app: sessionmaker[Session], engine: sa.Engine
):
    """The handler's session commits with the run's success, never before: a commit()
    inside the handler would keep effects of an attempt that then fails (and repeat them)."""
    registry = Registry()

    @registry.task("audit")
    def audit(payload: dict[str, Any], ctx: TaskContext) -> None:
        ctx.session.execute(_EFFECT, _effect_params(ctx, "audit"))
        if payload["commit"]:
            ctx.session.commit()
        with ctx.session.begin_nested():  # savepoints stay allowed
            ctx.session.execute(_EFFECT, _effect_params(ctx, "savepoint"))

    @registry.task("index_user", queue="bulk")
    async def index_user(payload: dict[str, Any], ctx: TaskContext) -> None:
        await ctx.session.execute(_EFFECT, _effect_params(ctx, "indexed"))
        try:
            await ctx.session.commit()
        except errors.HandlerCommitForbidden:
            pass  # swallowing the refusal does not make the attempt succeed

    with app.begin() as session:
        committing = Dispatch("audit", {"commit": True})
        fine = Dispatch("audit", {"commit": False})
        committing_async = Dispatch("index_user", {"user_id": 1})
        session.add_all([committing, fine, committing_async])

    report = testing.run_pending(app, registry=registry)

    for item in (committing, committing_async):
        outcome = report.by_run_id(item.run_id)
        assert (outcome.status, outcome.reason) == ("failed", "permanent-error")
        assert outcome.error is not None
        assert outcome.error.error_type == "sqla_outbox.errors.HandlerCommitForbidden"
        assert "use flush()" in outcome.error.message
    assert report.by_run_id(fine.run_id).status == "succeeded"
    assert _notes(engine) == ["audit", "savepoint"]  # only the run that did not commit


# --- a PostgreSQL for applications' tests --------------------------------------------------
def test_embedded_database_has_the_outbox_tables_and_leaves_nothing_behind() -> None:
    from sqla_outbox import migrations, testing

    with testing.embedded_database(tenant_foreign_key=None) as url:
        engine = sa.create_engine(url)
        try:
            with engine.connect() as conn:
                assert migrations.missing_tables(conn) == []
                socket_dir = conn.execute(sa.text("SHOW unix_socket_directories")).scalar_one()
        finally:
            engine.dispose()
    assert not Path(socket_dir).exists()  # the embedded cluster's folder is gone


def test_database_server_prefers_a_server_that_answers(pg_url: str, free_tcp_url: str) -> None:
    from sqla_outbox import testing

    with testing.database_server(pg_url) as url:
        assert url == pg_url
    with testing.database_server(free_tcp_url) as url:
        assert "host=/" in url  # nothing answered: an embedded server on a Unix socket
        with psycopg.connect(url) as conn:
            assert conn.execute("SELECT 1").fetchone() == (1,)


def test_an_applications_suite_gets_a_migrated_database_without_a_server(
    tmp_path: Path, free_tcp_url: str
) -> None:
    """What the pytest plugin offers a project whose CI has no PostgreSQL service."""
    catalog = {"version": 1, "tasks": {"notify": {"queue": "default"}}}
    (tmp_path / "catalog.json").write_text(json.dumps(catalog))
    (tmp_path / "test_app.py").write_text(
        textwrap.dedent(
            """
            from pathlib import Path

            import sqlalchemy as sa
            from sqlalchemy.orm import sessionmaker

            import sqla_outbox
            from sqla_outbox import Dispatch, testing

            def test_dispatch_on_the_embedded_database(outbox_database_url):
                engine = sa.create_engine(outbox_database_url)
                maker = sessionmaker(engine)
                catalog = sqla_outbox.Catalog.load(Path(__file__).parent / "catalog.json")
                sqla_outbox.install(maker, sqla_outbox.OutboxSettings(wake_mode="none"), catalog=catalog)
                with maker.begin() as session:
                    session.add(Dispatch("notify", {"n": 1}))
                testing.assert_dispatched(engine, "notify", payload={"n": 1})
                engine.dispose()
            """
        )
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("SQLA_OUTBOX_")}
    env["DATABASE_URL"] = free_tcp_url
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tmp_path / "test_app.py")],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "1 passed" in result.stdout


@pytest.fixture
def free_tcp_url() -> str:
    """A PostgreSQL URL on a loopback port where nothing listens."""
    from tests.support import free_port

    return f"postgresql://postgres@127.0.0.1:{free_port()}/postgres"
