"""Flow control in the relay's pass (in process) against real PostgreSQL and moto: tenant
fairness and weights, priority, the queue-depth bound, tenant rate limits, pauses."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.orm import Session, sessionmaker

from sqla_outbox import Dispatch, errors, flow
from sqla_outbox.config import OutboxSettings
from sqla_outbox.ops import status
from sqla_outbox.relay import Relay
from sqla_outbox.relay.fair import interleave, shares
from sqla_outbox.relay.ratelimit import RateWindows
from tests.support import receive_all


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def make_relay(
    settings: OutboxSettings, sqs_endpoint: str, queues: dict[str, str], engine: sa.Engine
) -> Iterator[Any]:
    made: list[Relay] = []

    def make(**changes: Any) -> Relay:
        changes.setdefault("relay_hold_unserved", False)
        relay = Relay(settings.replace(sqs_endpoint_url=sqs_endpoint, **changes), engine=engine)
        made.append(relay)
        return relay

    yield make
    for relay in made:
        relay.sender.close()


def dispatch_many(app: sessionmaker[Session], tenant: int | None, count: int, **options: Any) -> list[Any]:
    with app() as session, session.begin():
        items = [Dispatch("audit", {"n": i}, tenant_id=tenant, **options) for i in range(count)]
        session.add_all(items)
    return [item.run_id for item in items]


def sent_run_ids(engine: sa.Engine) -> list[Any]:
    with engine.connect() as conn:
        return list(
            conn.execute(
                sa.text("SELECT run_id FROM outbox_messages WHERE sent_at IS NOT NULL ORDER BY id")
            ).scalars()
        )


def sent_by_tenant(engine: sa.Engine) -> dict[int, int]:
    with engine.connect() as conn:
        rows = conn.execute(
            sa.text(
                "SELECT tenant_id, count(*) FROM outbox_messages WHERE sent_at IS NOT NULL GROUP BY tenant_id"
            )
        )
        return {int(t): int(n) for t, n in rows}


def test_a_noisy_tenant_does_not_hold_back_a_quiet_one(
    app: sessionmaker[Session], make_relay: Any, engine: sa.Engine, sqs: Any, queues: dict[str, str]
) -> None:
    dispatch_many(app, 1, 300)
    [quiet] = dispatch_many(app, 2, 1)
    fair = make_relay(relay_batch_size=50, relay_queue_depth=0)
    result = fair.run_once()
    # the quiet tenant's one run goes in the very first pass, ahead of the noisy backlog
    assert result.sent == 50
    assert quiet in sent_run_ids(engine)
    assert sent_by_tenant(engine) == {1: 49, 2: 1}
    assert len(receive_all(sqs, queues["default"], expect=50)) == 50


def test_a_pass_interleaves_tenants_priority_first() -> None:
    import datetime as dt
    import uuid

    from sqla_outbox.relay.claim import ClaimedRow

    at = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)

    def row(tenant: int, n: int, priority: int = 3) -> ClaimedRow:
        return ClaimedRow(
            "outbox_messages", tenant * 100 + n, uuid.uuid4(), "default", tenant, {}, 0, at, priority
        )

    noisy = [row(1, n) for n in range(4)]
    quiet = [row(2, 0)]
    urgent = [row(3, 0, priority=1)]
    order = interleave([noisy, quiet, urgent])
    assert [(r.tenant_id, r.id % 100) for r in order] == [(3, 0), (1, 0), (2, 0), (1, 1), (1, 2), (1, 3)]


def test_without_fairness_the_quiet_tenant_waits_behind_the_backlog(
    app: sessionmaker[Session], make_relay: Any, engine: sa.Engine
) -> None:
    dispatch_many(app, 1, 300)
    [quiet] = dispatch_many(app, 2, 1)
    legacy = make_relay(relay_batch_size=50, relay_fairness=False)
    legacy.run_once()
    assert quiet not in sent_run_ids(engine)
    assert sent_by_tenant(engine) == {1: 50}


def test_weights_share_a_pass(app: sessionmaker[Session], make_relay: Any, engine: sa.Engine) -> None:
    dispatch_many(app, 1, 100)
    dispatch_many(app, 2, 100)
    with engine.begin() as conn:
        flow.set_tenant(conn, 1, weight=3)
    make_relay(relay_batch_size=40, relay_queue_depth=0).run_once()
    assert sent_by_tenant(engine) == {1: 30, 2: 10}


def test_a_tenant_alone_gets_the_whole_batch_and_leftover_goes_to_the_busy_ones(
    app: sessionmaker[Session], make_relay: Any, engine: sa.Engine
) -> None:
    dispatch_many(app, 1, 100)
    dispatch_many(app, 2, 3)
    dispatch_many(app, 3, 100)
    make_relay(relay_batch_size=60, relay_queue_depth=0).run_once()
    assert sent_by_tenant(engine) == {1: 29, 2: 3, 3: 28}  # 20/3/20 first, the 17 left shared


def test_shares() -> None:
    assert shares(100, [1, 1], [None, None]) == [50, 50]
    assert shares(17, [1, 1], [None, None]) == [9, 8]
    assert shares(10, [3, 1], [None, 2]) == [8, 2]  # the capped share goes to the other
    assert shares(2, [1, 1, 1], [None, None, None]) == [1, 1, 0]
    assert shares(5, [1], [0]) == [0]


def test_higher_priority_goes_first_within_a_queue_under_backlog(
    app: sessionmaker[Session], make_relay: Any, engine: sa.Engine, sqs: Any, queues: dict[str, str]
) -> None:
    dispatch_many(app, 1, 120, priority=5)  # a schedule-like backlog
    urgent = dispatch_many(app, 1, 5, priority=1)  # committed after it
    manual = dispatch_many(app, 1, 5, priority=2)
    relay = make_relay(relay_batch_size=10, relay_queue_depth=0)
    relay.run_once()
    assert set(sent_run_ids(engine)) == set(urgent) | set(manual)
    messages = receive_all(sqs, queues["default"], expect=10)
    order = [json.loads(m["Body"])["run_id"] for m in messages]
    assert {str(r) for r in order[:5]} == {str(r) for r in urgent}
    with engine.connect() as conn:
        priorities = dict(
            conn.execute(sa.text("SELECT priority, count(*) FROM outbox_messages GROUP BY 1")).all()
        )
    assert priorities == {1: 5, 2: 5, 5: 120}


def test_priority_defaults_come_from_the_catalog_and_bad_ones_are_refused(
    app: sessionmaker[Session], engine: sa.Engine
) -> None:
    with pytest.raises(errors.InvalidDispatch, match=r"priority must be an integer within 1\.\.10"):
        Dispatch("audit", {}, priority=0)
    with pytest.raises(errors.InvalidDispatch, match="priority"):
        Dispatch("audit", {}, priority=True)  # type: ignore[arg-type]
    dispatch_many(app, None, 1)
    with engine.connect() as conn:
        assert conn.execute(sa.text("SELECT priority FROM platform_outbox_messages")).scalar_one() == 3


def test_the_queue_depth_bound_keeps_the_backlog_in_the_outbox(
    app: sessionmaker[Session], make_relay: Any, engine: sa.Engine, sqs: Any, queues: dict[str, str]
) -> None:
    dispatch_many(app, 1, 100)
    relay = make_relay(relay_batch_size=50, relay_queue_depth=20, relay_depth_poll_seconds=0.01)
    assert relay.run_once().sent == 20
    second = relay.run_once()
    assert (second.sent, second.depth_bound) == (0, ["default"])
    assert len(sent_run_ids(engine)) == 20
    taken = sqs.receive_message(QueueUrl=queues["default"], MaxNumberOfMessages=10)["Messages"]
    for message in taken:  # a worker takes 10
        sqs.delete_message(QueueUrl=queues["default"], ReceiptHandle=message["ReceiptHandle"])
    assert relay.run_once().sent == 10


def test_messages_carry_the_tenant_as_message_group(
    app: sessionmaker[Session], make_relay: Any, sqs: Any, queues: dict[str, str]
) -> None:
    dispatch_many(app, 7, 1)
    make_relay(relay_queue_depth=0).run_once()
    answer = sqs.receive_message(QueueUrl=queues["default"], AttributeNames=["All"], WaitTimeSeconds=1)
    [message] = answer["Messages"]
    assert message["Attributes"].get("MessageGroupId", "7") == "7"  # moto may leave it out


def test_a_tenant_rate_limit_leaves_the_excess_pending_without_spending_anything(
    app: sessionmaker[Session], make_relay: Any, engine: sa.Engine, settings: OutboxSettings
) -> None:
    dispatch_many(app, 1, 100)
    dispatch_many(app, 2, 10)
    with engine.begin() as conn:
        flow.set_tenant(conn, 1, rate_limit_per_minute=30, by="test")
    relay = make_relay(relay_batch_size=100, relay_queue_depth=0)
    clock = FakeClock()
    relay.rates = RateWindows(clock=clock)
    first = relay.run_once()
    assert sent_by_tenant(engine) == {1: 30, 2: 10}
    assert first.throttled == [1]
    second = relay.run_once()
    assert (second.sent, second.throttled) == (0, [1])
    with engine.connect() as conn:
        waiting = conn.execute(
            sa.text(
                "SELECT count(*), max(o.attempts), max(r.attempts), min(r.status), max(r.status) "
                "FROM outbox_messages o JOIN task_runs r USING (run_id) WHERE o.sent_at IS NULL"
            )
        ).one()
        assert tuple(waiting) == (70, 0, 0, "queued", "queued")  # nothing spent, nothing failed
        report = status.collect(conn, settings)
    [throttled] = report.throttled
    assert (throttled.tenant_id, throttled.limit_per_minute, throttled.sent_last_minute, throttled.due) == (
        1,
        30,
        30,
        70,
    )
    assert throttled.waited_seconds >= 0
    clock.now += 30
    assert relay.run_once().sent == 0  # the window still holds the 30
    clock.now += 31
    assert relay.run_once().sent == 30  # a minute after the first sends: 30 more


def test_the_global_default_applies_and_an_override_of_0_is_unlimited(
    app: sessionmaker[Session], make_relay: Any, engine: sa.Engine
) -> None:
    dispatch_many(app, 1, 40)
    dispatch_many(app, 2, 40)
    with engine.begin() as conn:
        flow.set_tenant(conn, 2, rate_limit_per_minute=0)
    make_relay(relay_batch_size=100, relay_queue_depth=0, tenant_rate_limit_per_minute=15).run_once()
    assert sent_by_tenant(engine) == {1: 15, 2: 40}


def test_a_new_active_relay_seeds_the_window_from_sent_rows(
    app: sessionmaker[Session], make_relay: Any, engine: sa.Engine
) -> None:
    dispatch_many(app, 1, 50)
    make_relay(relay_batch_size=100, relay_queue_depth=0, tenant_rate_limit_per_minute=20).run_once()
    # another relay takes over: it must not send 20 more within the same minute
    successor = make_relay(relay_batch_size=100, relay_queue_depth=0, tenant_rate_limit_per_minute=20)
    assert successor.run_once().sent == 0
    assert sent_by_tenant(engine) == {1: 20}


@pytest.mark.parametrize("scope", ["task", "tenant", "queue"])
def test_a_pause_keeps_runs_pending_and_resume_releases_them_at_once(
    app: sessionmaker[Session], make_relay: Any, engine: sa.Engine, scope: str
) -> None:
    paused = dispatch_many(app, 1, 20)
    with app() as session, session.begin():
        other = Dispatch("send_welcome", {}, tenant_id=2, queue="bulk")
        session.add(other)
    target = {"task": {"task": "audit"}, "tenant": {"tenant_id": 1}, "queue": {"queue": "default"}}[scope]
    with engine.begin() as conn:
        assert flow.pause(conn, **target, by="alice", reason="incident") is True
        assert flow.pause(conn, **target, by="bob") is False
        [shown] = flow.list_pauses(conn)
        assert (shown.paused_by, shown.reason) == ("alice", "incident")
    relay = make_relay(relay_queue_depth=0)
    result = relay.run_once()
    assert (result.sent, result.held) == (1, 20)
    assert sent_run_ids(engine) == [other.run_id]
    with engine.connect() as conn:
        held = conn.execute(
            sa.text(
                "SELECT count(*) FILTER (WHERE o.available_at > clock_timestamp()), max(o.attempts), "
                "max(r.attempts), min(r.status) FROM outbox_messages o JOIN task_runs r USING (run_id) "
                "WHERE o.sent_at IS NULL"
            )
        ).one()
    assert tuple(held) == (20, 0, 0, "queued")
    assert relay.run_once().sent == 0
    with engine.begin() as conn:
        assert flow.resume(conn, **target) == (True, 20)
        assert flow.list_pauses(conn) == []
    assert relay.run_once().sent == 20
    assert set(paused) <= set(sent_run_ids(engine))


def test_a_resume_that_lands_mid_pass_does_not_hold_the_rows(
    app: sessionmaker[Session], make_relay: Any, engine: sa.Engine
) -> None:
    """The hold re-checks the pause in SQL: a pause gone by then leaves the rows to send."""
    from sqla_outbox.relay import pauses as relay_pauses
    from sqla_outbox.relay.claim import claim

    dispatch_many(app, 1, 3)
    with engine.begin() as conn:
        flow.pause(conn, task="audit")
    with engine.connect() as conn, conn.begin():
        seen = flow.current(conn)  # the pass read the pause ...
        with engine.begin() as other:  # ... then a resume commits
            flow.resume(other, task="audit")
        rows = claim(conn, "outbox_messages", limit=10)
        assert relay_pauses.split(conn, rows, seen) == rows
    with engine.connect() as conn:
        assert (
            conn.execute(
                sa.text("SELECT count(*) FROM outbox_messages WHERE available_at <= clock_timestamp()")
            ).scalar()
            == 3
        )


def test_flow_control_input_is_checked_before_anything_is_written(engine: sa.Engine) -> None:
    with engine.begin() as conn:
        with pytest.raises(errors.InvalidFlowControl, match="exactly one"):
            flow.pause(conn, task="audit", queue="default")
        with pytest.raises(errors.InvalidFlowControl, match="exactly one"):
            flow.pause(conn)
        with pytest.raises(errors.InvalidFlowControl, match="is not a queue name"):
            flow.pause(conn, queue="bad queue!")
        with pytest.raises(errors.InvalidFlowControl, match="task names"):
            flow.pause(conn, task="bad name!")
        with pytest.raises(errors.InvalidFlowControl, match="weight"):
            flow.set_tenant(conn, 1, weight=0)
        with pytest.raises(errors.InvalidFlowControl, match="rate_limit_per_minute"):
            flow.set_tenant(conn, 1, rate_limit_per_minute=-1)
        assert flow.list_pauses(conn) == [] and flow.tenants(conn) == {}
        saved = flow.set_tenant(conn, 1, weight=2)
        assert (saved.weight, saved.rate_limit_per_minute) == (2, None)
        saved = flow.set_tenant(conn, 1, rate_limit_per_minute=100)
        assert (saved.weight, saved.rate_limit_per_minute) == (2, 100)  # the weight stays
        assert flow.clear_tenant(conn, 1) is True


def test_throttled_tenants_are_metered_and_the_gauge_is_removed_after(
    app: sessionmaker[Session], make_relay: Any, engine: sa.Engine
) -> None:
    from prometheus_client import REGISTRY

    dispatch_many(app, 9, 20)
    relay = make_relay(relay_batch_size=100, relay_queue_depth=0, tenant_rate_limit_per_minute=5)
    clock = FakeClock()
    relay.rates = RateWindows(clock=clock)
    assert relay.run_once().throttled == [9]
    with engine.connect() as conn:
        relay._refresh_stats(conn)
    assert REGISTRY.get_sample_value("sqla_outbox_tenant_throttled", {"tenant": "9"}) == 1
    wait = REGISTRY.get_sample_value("sqla_outbox_tenant_throttled_wait_seconds", {"tenant": "9"})
    assert wait is not None and wait >= 0
    clock.now += 61
    with engine.begin() as conn:  # the backlog is gone (sent elsewhere): nothing throttled any more
        conn.execute(sa.text("UPDATE outbox_messages SET sent_at = clock_timestamp() WHERE sent_at IS NULL"))
    relay.run_once()
    relay._stats_due = 0.0
    with engine.connect() as conn:
        relay._refresh_stats(conn)
    assert REGISTRY.get_sample_value("sqla_outbox_tenant_throttled", {"tenant": "9"}) is None
