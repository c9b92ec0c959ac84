"""Several active relays (``relay_partitions`` > 1), in process, on real PostgreSQL, Valkey and moto."""

from __future__ import annotations

import collections
import json
import time
from collections.abc import Iterator
from typing import Any

import pytest
import sqlalchemy as sa
from rich.console import Console
from sqlalchemy.orm import Session, sessionmaker
from sqlalchemy.pool import NullPool

from sqla_outbox import Dispatch, flow, health
from sqla_outbox.cli import status as cli_status
from sqla_outbox.config import OutboxSettings
from sqla_outbox.ops import status
from sqla_outbox.relay import Relay
from sqla_outbox.relay.partitions import Ownership, active_relays, read_layout
from tests.support import outbox_rows, receive_all, wait_for

PARTITIONS = 8


@pytest.fixture
def partitioned(settings: OutboxSettings, sqs_endpoint: str, queues: dict[str, str]) -> OutboxSettings:
    return settings.replace(
        sqs_endpoint_url=sqs_endpoint,
        relay_partitions=PARTITIONS,
        relay_standby_poll_seconds=0.2,
        relay_sweep_interval_seconds=30.0,  # a row sent within seconds was woken, not swept
    )


@pytest.fixture
def sessions(database_url: str) -> Iterator[Any]:
    """Connections with a server session each (closing one ends its session and its locks)."""
    engine = sa.create_engine(
        database_url.replace("postgresql://", "postgresql+psycopg://", 1), poolclass=NullPool
    )
    opened: list[sa.Connection] = []

    def connect() -> sa.Connection:
        connection = engine.connect()
        opened.append(connection)
        return connection

    yield connect
    for connection in opened:
        connection.close()
    engine.dispose()


def partition_of(engine: sa.Engine, tenant: int) -> int:
    with engine.connect() as conn:
        return int(
            conn.execute(
                sa.text("SELECT abs(hashint8(CAST(:t AS bigint))::bigint) % :n"),
                {"t": tenant, "n": PARTITIONS},
            ).scalar_one()
        )


def end_session(connection: sa.Connection, observer: sa.Connection) -> None:
    """Close ``connection`` and wait until PostgreSQL has ended its backend (a backend
    exits, and frees its locks, a moment after its client hangs up)."""
    pid = connection.execute(sa.text("SELECT pg_backend_pid()")).scalar_one()
    connection.commit()
    connection.close()

    def gone() -> bool:
        rows = observer.execute(sa.text("SELECT count(*) FROM pg_locks WHERE pid = :p"), {"p": pid}).scalar()
        observer.commit()
        return rows == 0

    wait_for(gone, timeout=10)


def settle(members: list[tuple[Ownership, sa.Connection]], rounds: int = 10) -> None:
    for _ in range(rounds):
        if not any([bool(o.rebalance(c)) for o, c in members]):
            return


def test_relays_split_the_partitions_and_rebalance_when_one_joins_or_dies(
    partitioned: OutboxSettings, sessions: Any
) -> None:
    a = (Ownership(partitioned, "a"), sessions())
    assert a[0].join(a[1]) and a[0].owned == set(range(PARTITIONS))  # alone: everything
    b = (Ownership(partitioned, "b"), sessions())
    b[0].join(b[1])
    settle([a, b])
    assert sorted(len(o.owned) for o, _ in (a, b)) == [4, 4]
    c = (Ownership(partitioned, "c"), sessions())
    c[0].join(c[1])
    members = [a, b, c]
    settle(members)
    assert sorted(len(o.owned) for o, _ in members) == [2, 3, 3]
    owned = [p for o, _ in members for p in o.owned]
    assert sorted(owned) == list(range(PARTITIONS))  # each partition owned exactly once
    assert [o.runs_singletons for o, _ in members].count(True) == 1
    layout = read_layout(a[1], partitioned)
    assert len(layout.members) == 3 and sorted(layout.owners) == list(range(PARTITIONS))
    shown = active_relays(a[1], partitioned)  # what `status` prints
    assert sorted(sorted(r.partitions) for r in shown) == sorted(sorted(o.owned) for o, _ in members)
    end_session(c[1], a[1])  # the session ends: PostgreSQL frees c's locks, as after kill -9
    settle([a, b])
    assert sorted(len(o.owned) for o, _ in (a, b)) == [4, 4]
    assert sorted(p for o, _ in (a, b) for p in o.owned) == list(range(PARTITIONS))


def test_more_relays_than_partitions_leaves_the_extra_ones_waiting(
    partitioned: OutboxSettings, sessions: Any
) -> None:
    two = partitioned.replace(relay_partitions=2)
    members = [(Ownership(two, name), sessions()) for name in "abc"]
    for ownership, connection in members:
        ownership.join(connection)
    settle(members)
    assert sorted(len(o.owned) for o, _ in members) == [0, 1, 1]


def test_each_relay_sends_only_its_partitions_and_together_every_row_once(
    app: sessionmaker[Session],
    partitioned: OutboxSettings,
    sessions: Any,
    sqs: Any,
    queues: dict[str, str],
    engine: sa.Engine,
) -> None:
    with app() as session, session.begin():
        items = [Dispatch("send_welcome", {"n": n}, tenant_id=1 + n % 12) for n in range(60)]
        session.add_all(items)
        platform = [Dispatch("audit", {"n": n}) for n in range(10)]
        session.add_all(platform)
    relays = [Relay(partitioned, engine=engine, name=name) for name in ("a", "b")]
    connections = [sessions(), sessions()]
    for relay, connection in zip(relays, connections, strict=True):
        relay.ownership.join(connection)
    settle([(r.ownership, c) for r, c in zip(relays, connections, strict=True)])
    first = relays[0].pass_once(connections[0])
    sent = {str(r.run_id) for r in outbox_rows(engine) if r.sent_at is not None}
    mine = relays[0].ownership.owned
    tenant_runs = {str(i.run_id) for i in items if partition_of(engine, i.tenant_id or 0) in mine}
    assert first.sent == len(sent) and tenant_runs <= sent
    assert {str(i.run_id) for i in items} & sent == tenant_runs  # no other relay's tenant
    relays[1].pass_once(connections[1])
    assert all(r.sent_at is not None for r in outbox_rows(engine))
    found = collections.Counter(
        json.loads(m["Body"])["run_id"] for m in receive_all(sqs, queues["default"], expect=70)
    )
    assert len(found) == 70 and set(found.values()) == {1}
    for relay in relays:
        relay.sender.close()


@pytest.fixture
def running(partitioned: OutboxSettings, database_url: str) -> Iterator[Any]:
    started: list[Relay] = []

    def start(name: str, **changes: Any) -> Relay:
        relay = Relay(partitioned.replace(**changes), name=name)
        relay.start_in_thread()
        started.append(relay)
        return relay

    yield start
    for relay in started:
        relay.stop()
    for relay in started:
        relay.join(30)


def wait_for_split(relays: list[Relay], timeout: float = 15.0, partitions: int = PARTITIONS) -> None:
    def even() -> bool:
        counts = sorted(len(r.ownership.owned) for r in relays)
        return sum(counts) == partitions and counts[-1] - counts[0] <= 1

    wait_for(even, timeout=timeout)


@pytest.mark.parametrize(
    "partitions", [PARTITIONS, 2], ids=["8 partitions", "2 partitions, one relay owns none"]
)
def test_a_valkey_wake_reaches_every_active_relay(
    app: sessionmaker[Session], partitioned: OutboxSettings, running: Any, engine: sa.Engine, partitions: int
) -> None:
    """Only one BLPOP gets each push; the relay that gets it passes it on (NOTIFY), so rows
    of the other relays' partitions go out at once, not at the 30 s sweep; a relay that
    owns no partition passes on what it pops too."""
    assert partitioned.wake_channels == {"valkey"}
    # relays also pass at each rebalance (every 10 s here): a relay that the push did not
    # reach passes within `within` of a commit by its own timer with odds within / 10, so
    # five rounds in a row within it, with no wake passed on, happen with odds 0.25 ** 5 for
    # even one such relay; 2.5 s leaves a slow machine (a round took 1.4 s on one) room
    within = 2.5
    relays = [running(name, relay_standby_poll_seconds=10.0, relay_partitions=partitions) for name in "abc"]
    wait_for_split(relays, timeout=120, partitions=partitions)
    with app() as session, session.begin():  # each relay's first send builds its SQS client
        session.add_all([Dispatch("send_welcome", {}, tenant_id=t) for t in range(1, 21)])
    wait_for(lambda: all(r.sent_at is not None for r in outbox_rows(engine)), timeout=20)
    time.sleep(0.5)  # what follows is woken
    for round_ in range(5):
        committed_at = time.monotonic()
        with app() as session, session.begin():
            session.add_all([Dispatch("send_welcome", {"r": round_}, tenant_id=t) for t in range(1, 21)])
        wait_for(lambda: all(r.sent_at is not None for r in outbox_rows(engine)), timeout=10)
        assert time.monotonic() - committed_at < within
    owning = [r for r in relays if r.ownership.owned]
    assert len(owning) == min(3, partitions)
    assert all(r.counters.sent for r in owning)  # every relay that owns partitions sent its share


def test_a_stopped_relays_partitions_are_taken_over_and_nothing_is_left(
    app: sessionmaker[Session], partitioned: OutboxSettings, running: Any, engine: sa.Engine
) -> None:
    a, b = running("a"), running("b")
    wait_for_split([a, b])
    a.stop()
    a.join(30)
    wait_for(lambda: len(b.ownership.owned) == PARTITIONS, timeout=10)
    with app() as session, session.begin():
        session.add_all([Dispatch("send_welcome", {}, tenant_id=t) for t in range(1, 21)])
    wait_for(lambda: all(r.sent_at is not None for r in outbox_rows(engine)), timeout=10)
    assert b.ownership.runs_singletons  # the scheduler moved with partition 0


def test_a_pause_holds_rows_in_every_relays_partitions(
    app: sessionmaker[Session], partitioned: OutboxSettings, running: Any, engine: sa.Engine
) -> None:
    with engine.begin() as conn:
        flow.pause(conn, task="send_welcome", reason="partitions test")
    relays = [running("a"), running("b")]
    wait_for_split(relays)
    with app() as session, session.begin():
        session.add_all([Dispatch("send_welcome", {}, tenant_id=t) for t in range(1, 20)])
        session.add(Dispatch("audit", {}))
    wait_for(lambda: any(r.sent_at is not None for r in outbox_rows(engine)), timeout=10)
    time.sleep(1.5)  # two flow refreshes
    rows = outbox_rows(engine)
    assert [r.envelope["task"] for r in rows if r.sent_at is not None] == ["audit"]
    with engine.begin() as conn:
        flow.resume(conn, task="send_welcome")  # (the NOTIFY it sends reaches every relay)
    wait_for(lambda: all(r.sent_at is not None for r in outbox_rows(engine)), timeout=10)


def test_status_shows_the_active_relay_and_its_standby_without_partitions(
    settings: OutboxSettings, sessions: Any
) -> None:
    single = Ownership(settings, "single")
    holder = sessions()
    assert active_relays(holder, settings) == []
    assert single.join(holder)
    standby = Ownership(settings, "standby")
    assert not standby.join(sessions())
    shown = active_relays(sessions(), settings)  # the standby is listed too, owning nothing
    assert [r.partitions for r in shown] == [[0], []] and shown[0].since is not None


def test_status_counts_the_due_rows_of_each_relays_partitions(
    app: sessionmaker[Session], partitioned: OutboxSettings, sessions: Any, engine: sa.Engine
) -> None:
    """The relay whose rows wait (hung, throttled) is the one whose due count grows."""
    members = [(Ownership(partitioned, name), sessions()) for name in "ab"]
    for ownership, connection in members:
        ownership.join(connection)
    settle(members)
    with app() as session, session.begin():
        items = [Dispatch("send_welcome", {"n": n}, tenant_id=1 + n % 12) for n in range(36)]
        items.append(Dispatch("send_welcome", {}, tenant_id=1, delay=3600))  # not due
        session.add_all(items)
        session.add_all([Dispatch("audit", {"n": n}) for n in range(6)])
    with engine.connect() as conn:
        platform_ids = [
            int(i) for i in conn.execute(sa.text("SELECT id FROM platform_outbox_messages")).scalars()
        ]
        platform_parts = [
            int(
                conn.execute(
                    sa.text("SELECT abs(hashint8(CAST(:i AS bigint))::bigint) % :n"),
                    {"i": i, "n": PARTITIONS},
                ).scalar_one()
            )
            for i in platform_ids
        ]
    tenant_parts = [partition_of(engine, 1 + n % 12) for n in range(36)]
    shown = status.collect(sessions(), partitioned, with_valkey=False).relays
    for ownership, _ in members:
        expected = sum(p in ownership.owned for p in tenant_parts + platform_parts)
        relay = next(r for r in shown if sorted(r.partitions) == sorted(ownership.owned))
        assert relay.due == expected
        assert (relay.oldest_due_age_seconds is not None) == (expected > 0)
    assert sum(r.due or 0 for r in shown) == 36 + 6


def test_a_relay_with_another_relay_partitions_waits_instead_of_splitting_the_work(
    partitioned: OutboxSettings, sessions: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """A mistaken value (4 among relays on 8, or the default 1) must not leave partitions
    unowned: the relays on 8 keep the whole outbox between them, the odd one waits, logs
    why, and shows in status."""
    members = [(Ownership(partitioned, name), sessions()) for name in "ab"]
    for ownership, connection in members:
        ownership.join(connection)
    settle(members)
    odd = (Ownership(partitioned.replace(relay_partitions=4), "odd"), sessions())
    with caplog.at_level("WARNING", logger="sqla_outbox.relay"):
        assert not odd[0].join(odd[1])
    assert any("disagree on relay_partitions" in r.getMessage() for r in caplog.records)
    settle([*members, odd])
    assert sorted(len(o.owned) for o, _ in members) == [4, 4] and not odd[0].owned
    single = (Ownership(partitioned.replace(relay_partitions=1), "single"), sessions())
    assert not single[0].join(single[1])  # the default value beside partitioned relays waits too
    shown = active_relays(sessions(), partitioned)
    assert sorted((r.relay_partitions, len(r.partitions)) for r in shown) == [(1, 0), (4, 0), (8, 4), (8, 4)]
    out = Console(record=True, width=240)
    cli_status._render_relays(out, status.collect(sessions(), partitioned, with_valkey=False))
    printed = out.export_text()
    assert "Relays disagree on relay_partitions (1, 4, 8): 2 active, the others wait" in printed
    assert printed.count("none (waiting)") == 1 and printed.count("none (standby)") == 1
    for _, connection in members:
        end_session(connection, odd[1])  # the relays on 8 go: the odd one takes over
    assert odd[0].rebalance(odd[1]) and odd[0].owned == {0, 1, 2, 3}


def test_relay_check_fails_only_when_the_active_relays_use_another_value(
    partitioned: OutboxSettings, sessions: Any
) -> None:
    """`relay --check` of a correctly configured relay passes beside a stray relay that waits
    with another value, and fails for the stray value (it would wait)."""
    members = [(Ownership(partitioned, name), sessions()) for name in "ab"]
    for ownership, connection in members:
        ownership.join(connection)
    settle(members)
    stray = (Ownership(partitioned.replace(relay_partitions=3), "stray"), sessions())
    assert not stray[0].join(stray[1])
    right = health.check_partitions(partitioned)
    assert right.ok, right.detail
    assert "relay_partitions 3 are waiting" in right.detail
    wrong = health.check_partitions(partitioned.replace(relay_partitions=3))
    assert not wrong.ok
    assert f"the active relays on this database use {PARTITIONS}:" in wrong.detail


def test_partitioned_relays_wait_while_a_relay_with_one_partition_is_active(
    partitioned: OutboxSettings, sessions: Any
) -> None:
    single = (Ownership(partitioned.replace(relay_partitions=1), "single"), sessions())
    assert single[0].join(single[1])
    late = (Ownership(partitioned, "late"), sessions())
    assert not late[0].join(late[1])
    shown = active_relays(sessions(), partitioned)
    assert [(r.relay_partitions, r.partitions) for r in shown] == [(1, [0]), (8, [])]
    end_session(single[1], late[1])
    assert late[0].rebalance(late[1]) and len(late[0].owned) == PARTITIONS


def test_a_waiting_relay_leaves_the_valkey_wakes_to_the_relay_that_sends(
    app: sessionmaker[Session], partitioned: OutboxSettings, running: Any, engine: sa.Engine
) -> None:
    """During a change of relay_partitions (1 → 8) the new relays wait for the old one to
    stop; they must not BLPOP meanwhile, or the old relay (which does not LISTEN for
    forwarded wakes with the Valkey wake) would miss half the commits until its sweep."""
    old = running("old", relay_partitions=1)
    wait_for(lambda: old.is_leader, timeout=10)
    new = running("new")
    time.sleep(1.0)  # the new relay joined and waits
    assert not new.ownership.owned
    with app() as session, session.begin():  # the old relay's first send builds its SQS client
        session.add(Dispatch("send_welcome", {}, tenant_id=1))
    wait_for(lambda: all(r.sent_at is not None for r in outbox_rows(engine)), timeout=20)
    for round_ in range(6):
        committed_at = time.monotonic()
        with app() as session, session.begin():
            session.add(Dispatch("send_welcome", {"r": round_}, tenant_id=1 + round_))
        wait_for(lambda: all(r.sent_at is not None for r in outbox_rows(engine)), timeout=40)
        assert time.monotonic() - committed_at < 5  # the wake, not the 30 s sweep
    assert new.counters.sent == 0 and not new.ownership.owned


def test_fairness_and_priority_hold_in_the_relay_that_owns_the_tenants(
    app: sessionmaker[Session], partitioned: OutboxSettings, sessions: Any, engine: sa.Engine, queues: Any
) -> None:
    """Two tenants of one partition: its owner's first pass of 10 serves the small tenant
    behind the big one's backlog, and the big one's priority-1 run committed last."""
    tenants: dict[int, list[int]] = {}
    for tenant in range(1, 21):
        tenants.setdefault(partition_of(engine, tenant), []).append(tenant)
    big, small = next(group for group in tenants.values() if len(group) >= 2)[:2]
    with app() as session, session.begin():
        session.add_all([Dispatch("send_welcome", {"n": n}, tenant_id=big) for n in range(50)])
    with app() as session, session.begin():
        urgent = Dispatch("send_welcome", {"urgent": True}, tenant_id=big, priority=1)
        other = Dispatch("send_welcome", {}, tenant_id=small)
        session.add_all([urgent, other])
    settings = partitioned.replace(relay_batch_size=10, relay_queue_depth=0)
    relays = [Relay(settings, engine=engine, name=name) for name in "ab"]
    connections = [sessions(), sessions()]
    for relay, connection in zip(relays, connections, strict=True):
        relay.ownership.join(connection)
    settle([(r.ownership, c) for r, c in zip(relays, connections, strict=True)])
    owner, connection = next(
        (r, c)
        for r, c in zip(relays, connections, strict=True)
        if partition_of(engine, big) in r.ownership.owned
    )
    assert owner.pass_once(connection).sent == 10
    sent = {r.run_id for r in outbox_rows(engine) if r.sent_at is not None}
    assert {urgent.run_id, other.run_id} <= sent
    for relay in relays:
        relay.sender.close()
