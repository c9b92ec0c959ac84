"""The PostgreSQL wake: a NOTIFY inside the dispatching statement, a relay that LISTENs."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
import sqlalchemy as sa
from sqlalchemy.orm import Session, sessionmaker

import sqla_outbox
from sqla_outbox import Dispatch, Publish
from sqla_outbox.catalog import Catalog
from sqla_outbox.config import OutboxSettings
from sqla_outbox.relay import Relay
from sqla_outbox.relay import listen as listen_mod
from sqla_outbox.relay.listen import NotifyListener
from sqla_outbox.types import WAKE_CHANNEL
from tests.support import outbox_rows, wait_for


def libpq(url: str) -> str:
    return url.replace("postgresql+psycopg://", "postgresql://")


@pytest.fixture
def listener_connection(database_url: str) -> Iterator[psycopg.Connection[Any]]:
    """A session LISTENing on the wake channel of the test database."""
    with psycopg.connect(libpq(database_url), autocommit=True) as conn:
        conn.execute(f'LISTEN "{WAKE_CHANNEL}"')
        yield conn


def notifications(conn: psycopg.Connection[Any], wait: float = 0.5) -> list[Any]:
    return [n for n in conn.notifies(timeout=wait) if n.channel == WAKE_CHANNEL]


@pytest.fixture
def pg_app(engine: sa.Engine, settings: OutboxSettings, catalog: Catalog) -> Iterator[sessionmaker[Session]]:
    maker = sessionmaker(engine)
    sqla_outbox.install(maker, settings.replace(wake_mode="postgres"), catalog=catalog)
    yield maker
    sqla_outbox.uninstall(maker)


def test_notify_is_delivered_once_per_committed_transaction(
    pg_app: sessionmaker[Session], listener_connection: psycopg.Connection[Any]
) -> None:
    with pg_app() as session, session.begin():
        session.add(Dispatch("audit", {"n": 1}))
        session.flush()
        session.add(Dispatch("audit", {"n": 2}))
        session.add(Dispatch("send_welcome", {"user_id": 1}, tenant_id=1))
        session.flush()
        session.add(Publish("user.created", {"user_id": 1}))
    got = notifications(listener_connection)
    assert len(got) == 1  # three flushes, one wake (PostgreSQL folds identical notifications)
    assert got[0].payload == ""


def test_rolled_back_transaction_and_savepoint_notify_nobody(
    pg_app: sessionmaker[Session], engine: sa.Engine, listener_connection: psycopg.Connection[Any]
) -> None:
    with pg_app() as session:
        session.begin()
        session.add(Dispatch("audit", {}))
        session.flush()
        session.rollback()
    with pg_app() as session, session.begin():
        nested = session.begin_nested()
        session.add(Dispatch("audit", {}))
        session.flush()
        nested.rollback()
    assert notifications(listener_connection, wait=1.0) == []
    assert outbox_rows(engine) == []


def test_a_deduplicated_dispatch_notifies_nobody(
    pg_app: sessionmaker[Session], listener_connection: psycopg.Connection[Any]
) -> None:
    with pg_app() as session, session.begin():
        session.add(Dispatch("audit", {}, idempotency_key="k"))
    assert len(notifications(listener_connection)) == 1
    with pg_app() as session, session.begin():
        session.add(Dispatch("audit", {}, idempotency_key="k"))  # joins the unfinished run
    assert notifications(listener_connection, wait=1.0) == []


@pytest.mark.parametrize("mode", ["valkey", "none"])
def test_other_wake_modes_issue_no_notify(
    mode: str,
    engine: sa.Engine,
    settings: OutboxSettings,
    catalog: Catalog,
    listener_connection: psycopg.Connection[Any],
) -> None:
    maker = sessionmaker(engine)
    sqla_outbox.install(maker, settings.replace(wake_mode=mode), catalog=catalog)
    try:
        with maker() as session, session.begin():
            session.add(Dispatch("audit", {}))
    finally:
        sqla_outbox.uninstall(maker)
    assert notifications(listener_connection, wait=1.0) == []


@pytest.mark.parametrize("dispatches", [1, 3])
def test_the_notify_rides_on_the_write_statement(
    dispatches: int, engine: sa.Engine, settings: OutboxSettings, catalog: Catalog
) -> None:
    """Same statements, same round trips, with or without the PostgreSQL wake."""
    statements: dict[str, list[str]] = {}
    for mode in ("none", "postgres"):
        seen: list[str] = statements.setdefault(mode, [])

        def record(conn: Any, cursor: Any, statement: str, *args: Any, seen: list[str] = seen) -> None:
            seen.append(statement)

        maker = sessionmaker(engine)
        sqla_outbox.install(maker, settings.replace(wake_mode=mode), catalog=catalog)
        sa.event.listen(engine, "before_cursor_execute", record)
        try:
            with maker() as session, session.begin():
                for n in range(dispatches):
                    session.add(Dispatch("audit", {"n": n}))
        finally:
            sa.event.remove(engine, "before_cursor_execute", record)
            sqla_outbox.uninstall(maker)
    assert len(statements["postgres"]) == len(statements["none"]) == 1
    assert "pg_notify" in statements["postgres"][0] and "pg_notify" not in statements["none"][0]


def test_relay_listening_sends_a_commit_long_before_its_sweep(
    pg_app: sessionmaker[Session], settings: OutboxSettings, sqs_endpoint: str, queues: dict[str, str]
) -> None:
    relay_settings = settings.replace(
        wake_mode="postgres", sqs_endpoint_url=sqs_endpoint, relay_sweep_interval_seconds=60.0
    )
    relay = Relay(relay_settings, name="listen-test")
    relay.start_in_thread()
    try:
        wait_for(lambda: relay.is_leader, timeout=20)
        time.sleep(0.5)  # the first pass (at start) is over; the relay now waits up to 60 s
        passes = relay.counters.passes
        started = time.monotonic()
        with pg_app() as session, session.begin():
            session.add(Dispatch("audit", {}))
        wait_for(lambda: relay.counters.sent == 1, timeout=30)
        assert time.monotonic() - started < 30  # the sweep would take 60 s
        assert relay.counters.passes > passes
    finally:
        relay.stop()
        relay.join(20)


def test_listener_reconnects_after_its_session_is_killed(
    database_url: str, settings: OutboxSettings, caplog: pytest.LogCaptureFixture
) -> None:
    woken: list[float] = []
    listener = NotifyListener(settings.replace(wake_mode="postgres"), lambda: woken.append(time.monotonic()))
    with caplog.at_level(logging.INFO, logger="sqla_outbox"):
        listener.start()
        try:
            wait_for(lambda: listener.held is True, timeout=20)
            with psycopg.connect(libpq(database_url), autocommit=True) as conn:
                conn.execute("SELECT pg_notify(%s, '')", (WAKE_CHANNEL,))
                wait_for(lambda: listener.wakes == 1, timeout=10)
                killed = conn.execute(
                    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                    "WHERE application_name = 'sqla_outbox_listen' AND datname = current_database()"
                ).fetchall()
                assert killed == [(True,)]
                wait_for(lambda: any(r.getMessage().startswith("wake listener lost") for r in caplog.records))
                wait_for(lambda: listener.listening, timeout=20)
                wakes_before = len(woken)
                conn.execute("SELECT pg_notify(%s, 'anything at all')", (WAKE_CHANNEL,))
                wait_for(lambda: listener.wakes == 2, timeout=10)
                assert len(woken) > wakes_before
        finally:
            listener.stop()
            listener.join(10)
    assert [r.getMessage() for r in caplog.records if "reconnected" in r.getMessage()]


def test_listener_is_off_unless_the_postgres_wake_is_in_force(settings: OutboxSettings) -> None:
    for mode in ("valkey", "none"):
        listener = NotifyListener(settings.replace(wake_mode=mode), lambda: None)
        listener.start()
        assert listener._thread is None


def test_probe_says_a_direct_connection_holds_a_listen(settings: OutboxSettings) -> None:
    assert listen_mod.probe(settings) is True


def test_a_requeue_notifies_the_relay_when_it_commits(
    pg_app: sessionmaker[Session],
    engine: sa.Engine,
    settings: OutboxSettings,
    sqs: Any,
    sqs_endpoint: str,
    queues: dict[str, str],
    listener_connection: psycopg.Connection[Any],
) -> None:
    from sqla_outbox.ops import dlq, requeue
    from tests.integration.test_ops import dispatch, fail_into_dlq

    pg_settings = settings.replace(wake_mode="postgres", sqs_endpoint_url=sqs_endpoint)
    run_id = dispatch(pg_app, "audit", {}, tenant_id=3)
    relay = Relay(pg_settings, engine=engine)
    try:
        relay.run_once()
    finally:
        relay.sender.close()
    fail_into_dlq(engine, sqs, pg_settings, "default", {run_id})
    assert len(notifications(listener_connection)) == 1  # the dispatch's own wake

    dry = requeue.requeue(engine, sqs, pg_settings, dlq.DeadLetterFilter(run_ids={run_id}), dry_run=True)
    assert dry.requeued == 1 and not dry.woke
    assert notifications(listener_connection, wait=1.0) == []  # rolled back: nobody woken
    report = requeue.requeue(engine, sqs, pg_settings, dlq.DeadLetterFilter(run_ids={run_id}))
    assert (report.requeued, report.woke) == (1, True)
    assert len(notifications(listener_connection)) == 1


def test_check_reports_the_listen_connection(settings: OutboxSettings) -> None:
    from sqla_outbox import health
    from tests.support import free_port

    pg = settings.replace(wake_mode="postgres")
    listen = {r.service: r for r in health.check_services(pg, need_queues=False).results}["listen"]
    # it tested a connection of its own, and says so (a running relay's session is its metric)
    assert listen.ok and "a fresh connection holds a LISTEN" in listen.detail
    assert "sqla_outbox_relay_listen_alive" in listen.detail
    unreachable = pg.replace(database_direct_url=f"postgresql://postgres@127.0.0.1:{free_port()}/postgres")
    listen = {r.service: r for r in health.check_services(unreachable, need_queues=False).results}["listen"]
    assert not listen.ok and "OperationalError" in listen.detail
    assert "listen" not in {r.service for r in health.check_services(settings, need_queues=False).results}
