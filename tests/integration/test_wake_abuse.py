"""The wake key is untrusted: whoever may write to Valkey can set it to anything.

Each test runs against a Valkey/Redis server of its own (``support.private_valkey``), so
it can fill keys and change users freely. ``docs/security.md`` ("Valkey") cites them.
"""

from __future__ import annotations

import logging
import threading
import time
import tracemalloc
from collections.abc import Callable, Iterator
from pathlib import Path

import prometheus_client
import psycopg
import pytest
import redis
import sqlalchemy as sa

from sqla_outbox.config import OutboxSettings
from sqla_outbox.relay import WAKE_HOLD_SECONDS, Relay
from sqla_outbox.types import WAKE_CHANNEL
from sqla_outbox.wakeup import WAKE_ELEMENT_MAX_BYTES, WakeListener, Waker
from tests.support import private_valkey, wait_for

ROOT = Path(__file__).resolve().parents[2]

# the ACL that docs/security.md shows, line for line
APP_ACL = (
    "ACL SETUSER outbox-app on >APP-PASSWORD resetkeys ~sqla_outbox:outbox:wake resetchannels "
    "-@all +lpush +ltrim +ping +client|setname"
)
RELAY_ACL = (
    "ACL SETUSER outbox-relay on >RELAY-PASSWORD resetkeys ~sqla_outbox:outbox:wake resetchannels "
    "-@all +blpop +del +type +ping +client|setname"
)


@pytest.fixture
def valkey_url() -> Iterator[str]:
    with private_valkey() as url:
        yield url


@pytest.fixture
def local(settings: OutboxSettings, valkey_url: str) -> OutboxSettings:
    return settings.replace(valkey_url=valkey_url, relay_sweep_interval_seconds=1.0)


@pytest.fixture
def client(valkey_url: str) -> Iterator[redis.Redis]:
    connection = redis.Redis.from_url(valkey_url)
    yield connection
    connection.close()


@pytest.fixture
def listener(local: OutboxSettings) -> Iterator[tuple[WakeListener, list[float]]]:
    woken: list[float] = []
    started = WakeListener(local, lambda: woken.append(time.monotonic()))
    yield started, woken
    started.stop()


def blocked_in_blpop(client: redis.Redis) -> bool:
    return any(c.get("cmd") == "blpop" for c in client.client_list())


def wake_records(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == "sqla_outbox.wakeup"]


def test_a_wake_key_of_another_type_gives_one_warning_then_backs_off_without_passes(
    local: OutboxSettings,
    client: redis.Redis,
    listener: tuple[WakeListener, list[float]],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Issue 12 (3): ``SET <wake key> not-a-list``. Before: ~15 lines a second ("lost
    Valkey", which is wrong) and a database pass each time, indefinitely."""
    wake, woken = listener
    client.set(local.wake_key, "not-a-list")
    with caplog.at_level(logging.INFO, logger="sqla_outbox"):
        wake.start()
        time.sleep(4.0)  # observe a window: with 1 s, 2 s backoff, three BLPOPs at most
        records = wake_records(caplog)
        assert [r.levelname for r in records] == ["WARNING"]
        assert f"wake key {local.wake_key!r} holds a string, not a list" in records[0].getMessage()
        assert records[0].sqla_outbox["key_type"] == "string"  # type: ignore[attr-defined]
        assert woken == [] and wake.problems <= 3
        client.delete(local.wake_key)
        wait_for(lambda: len(wake_records(caplog)) == 2, timeout=15)  # one more line: usable again
        assert "usable again" in wake_records(caplog)[1].getMessage()
        client.lpush(local.wake_key, 1)
        wait_for(lambda: woken, timeout=5)


def test_a_huge_wake_element_is_dropped_unread(
    local: OutboxSettings,
    client: redis.Redis,
    listener: tuple[WakeListener, list[float]],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Issue 12 (3): one 64 MiB LPUSH tripled the relay's memory. The element is built in
    the server (Lua), so the only allocations traced here are the listener's."""
    wake, woken = listener
    with caplog.at_level(logging.INFO, logger="sqla_outbox"):
        wake.start()
        wait_for(lambda: blocked_in_blpop(client), timeout=10)
        tracemalloc.start()
        try:
            client.eval(
                "return redis.call('LPUSH', KEYS[1], string.rep('x', tonumber(ARGV[1])))",
                1,
                local.wake_key,
                64 * 1024 * 1024,
            )
            wait_for(lambda: woken or wake_records(caplog), timeout=10)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert peak < 4 * 1024 * 1024, f"{peak / 2**20:.1f} MiB traced while a 64 MiB element was pushed"
        assert client.llen(local.wake_key) == 0  # consumed by the pop, never read
        [warning] = wake_records(caplog)
        assert f"held an element of {64 * 1024 * 1024} bytes" in warning.getMessage()
        assert woken == []
        client.lpush(local.wake_key, "x" * WAKE_ELEMENT_MAX_BYTES)  # the longest element still read
        wait_for(lambda: woken, timeout=10)


def _sample(trigger: str, claimed: str) -> float:
    value = prometheus_client.REGISTRY.get_sample_value(
        "sqla_outbox_relay_passes_total", {"trigger": trigger, "claimed": claimed}
    )
    return value or 0.0


def committed_transactions(pg_url: str, database: str) -> int:
    """``xact_commit`` of ``database`` (PostgreSQL counts them per database; a backend
    reports its counts at least when it exits)."""
    with sa.create_engine(pg_url.replace("postgresql://", "postgresql+psycopg://", 1)).connect() as conn:
        conn.execute(sa.text("SELECT pg_stat_clear_snapshot()"))
        value = conn.execute(
            sa.text("SELECT xact_commit FROM pg_stat_database WHERE datname = :d"), {"d": database}
        ).scalar_one()
    return int(value)


def flood_a_relay(
    settings: OutboxSettings, engine: sa.Engine, wake: Callable[[], None]
) -> tuple[int, float, float]:
    """Run a relay; call ``wake`` in a loop for 3 s; return (wakes sent, wake-started passes,
    seconds). The relay's engine is disposed at the end (its backends exit)."""
    relay = Relay(settings.replace(relay_scheduler=False, relay_sweep_interval_seconds=30), engine=engine)
    relay.start_in_thread()
    stop = threading.Event()
    sent = 0

    def flood() -> None:
        nonlocal sent
        while not stop.is_set():
            wake()
            sent += 1

    try:
        wait_for(lambda: relay.is_leader, timeout=10)
        time.sleep(1.0)  # the first pass is done and the listeners listen
        before = _sample("wake", "no") + _sample("wake", "yes")
        started = time.monotonic()
        flooder = threading.Thread(target=flood)
        flooder.start()
        time.sleep(3.0)
        stop.set()
        flooder.join()
        elapsed = time.monotonic() - started
        passes = _sample("wake", "no") + _sample("wake", "yes") - before
    finally:
        relay.stop()
        relay.join(10)
        engine.dispose()  # the relay's backends exit and report their transaction counts
    return sent, passes, elapsed


def test_a_push_flood_drives_a_bounded_number_of_database_passes(
    local: OutboxSettings, client: redis.Redis, pg_url: str, database_url: str
) -> None:
    """Issue 12 (3): a 20 s push flood drove about 350 database transactions a second.
    A wake that finds nothing holds the next one for WAKE_HOLD_SECONDS."""
    engine = sa.create_engine(database_url)
    pusher = redis.Redis.from_url(local.valkey_url or "")
    pushes, passes, elapsed = flood_a_relay(local, engine, lambda: pusher.lpush(local.wake_key, 1))
    pusher.close()
    transactions = committed_transactions(pg_url, engine.url.database or "")
    assert pushes > 300, pushes  # it was a flood
    bound = elapsed / WAKE_HOLD_SECONDS
    assert passes <= bound + 5, (passes, pushes)
    # everything this database committed since it was cloned: the relay's start, its
    # passes (one transaction each, plus at most one due-time query per pass) and the flood
    assert transactions <= 2 * bound + 40, (transactions, pushes)


def test_a_notify_flood_drives_a_bounded_number_of_database_passes(
    settings: OutboxSettings, database_url: str
) -> None:
    """The same hold bounds the PostgreSQL wake: anyone who can log in may NOTIFY the channel."""
    engine = sa.create_engine(database_url)
    with psycopg.connect(
        database_url.replace("postgresql+psycopg://", "postgresql://"), autocommit=True
    ) as conn:
        notifies, passes, elapsed = flood_a_relay(
            settings.replace(wake_mode="postgres"),
            engine,
            lambda: conn.execute(f"SELECT pg_notify('{WAKE_CHANNEL}', '')"),
        )
    assert notifies > 300, notifies
    assert 0 < passes <= elapsed / WAKE_HOLD_SECONDS + 5, (passes, notifies)


def test_the_documented_acl_lets_the_application_only_push_on_the_wake_key(
    settings: OutboxSettings, valkey_url: str, client: redis.Redis
) -> None:
    """docs/security.md shows these ACL lines; with them the application can push wakes and
    nothing else, and the relay can take them."""
    document = (ROOT / "docs" / "security.md").read_text()
    assert APP_ACL in document and RELAY_ACL in document
    for line in (APP_ACL, RELAY_ACL):
        words = line.replace("APP-PASSWORD", "app-secret-0123").replace("RELAY-PASSWORD", "relay-secret-0123")
        assert client.execute_command(*words.split()) == b"OK"
    key = "sqla_outbox:outbox:wake"
    host = valkey_url.removeprefix("redis://")
    app = settings.replace(valkey_url=f"redis://outbox-app:app-secret-0123@{host}", wake_key=key)
    relay = settings.replace(
        valkey_url=f"redis://outbox-relay:relay-secret-0123@{host}",
        wake_key=key,
        relay_sweep_interval_seconds=1,
    )
    woken: list[int] = []
    listener = WakeListener(relay, lambda: woken.append(1))
    waker = Waker(app)
    try:
        listener.start()
        wait_for(lambda: blocked_in_blpop(client), timeout=10)
        waker.wake()
        assert waker.drain(5) and waker.stats.sent == 1
        wait_for(lambda: woken, timeout=10)
    finally:
        listener.stop()
        waker.close()
    as_app = redis.Redis.from_url(app.valkey_url or "")
    for command in (("SET", key, "x"), ("LPUSH", "other-key", "1"), ("LRANGE", key, "0", "-1"), ("DEL", key)):
        with pytest.raises(redis.exceptions.NoPermissionError):
            as_app.execute_command(*command)
    as_app.close()
