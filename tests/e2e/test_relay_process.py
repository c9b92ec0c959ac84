"""``python -m sqla_outbox.relay`` as a real subprocess: wake, sweep, delays, outages, failover."""

from __future__ import annotations

import collections
import datetime as dt
import errno
import json
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.orm import Session, sessionmaker

from sqla_outbox import Dispatch
from sqla_outbox.config import OutboxSettings
from sqla_outbox.relay.partitions import active_relays
from tests import support
from tests.support import outbox_rows, receive_all, start_relay, wait_for

pytestmark = pytest.mark.e2e

QUEUES = ("critical", "default", "bulk", "maintenance")
TASK_FOR_QUEUE = {
    "critical": "charge_card",
    "default": "audit",
    "bulk": "index_user",
    "maintenance": "rebuild_cache",
}


def run_ids_in(sqs: Any, queues: dict[str, str], expect: int, timeout: float = 60.0) -> list[str]:
    """Every run_id on the four source queues, duplicates included."""
    found: list[str] = []
    deadline = time.monotonic() + timeout
    while len(found) < expect and time.monotonic() < deadline:
        for queue in QUEUES:
            for message in receive_all(sqs, queues[queue]):
                found.append(json.loads(message["Body"])["run_id"])
    return found


def sent_run_ids(engine: sa.Engine) -> set[str]:
    return {str(r.run_id) for r in outbox_rows(engine) if r.sent_at is not None}


def test_commit_reaches_the_right_queue_at_once_and_rollback_never_does(
    app: sessionmaker[Session],
    settings: OutboxSettings,
    sqs_endpoint: str,
    sqs: Any,
    queues: dict[str, str],
    engine: sa.Engine,
) -> None:
    relay = start_relay(settings.replace(relay_sweep_interval_seconds=30), sqs_endpoint)
    try:
        relay.wait_for_action("relay.leader")
        with app() as session:
            session.add(Dispatch("audit", {"rolled": "back"}))
            session.flush()
            session.rollback()
        started = time.monotonic()
        with app() as session, session.begin():
            item = Dispatch("charge_card", {"amount": 12}, tenant_id=2)
            session.add(item)
        [message] = receive_all(sqs, queues["critical"], expect=1, timeout=10)
        elapsed = time.monotonic() - started
        body = json.loads(message["Body"])
        assert body["run_id"] == str(item.run_id)
        assert json.loads(body["payload"]) == {"amount": 12}
        assert elapsed < 5  # the wake, not the 30 s sweep
        assert receive_all(sqs, queues["default"]) == []
    finally:
        assert relay.terminate() == 0
    assert relay.actions("relay.stopped")


def test_delayed_run_is_sent_on_time(
    app: sessionmaker[Session],
    settings: OutboxSettings,
    sqs_endpoint: str,
    queues: dict[str, str],
    engine: sa.Engine,
) -> None:
    relay = start_relay(settings.replace(relay_sweep_interval_seconds=30), sqs_endpoint)
    try:
        relay.wait_for_action("relay.leader")
        with app() as session, session.begin():
            session.add_all(
                [Dispatch("audit", {"d": d}, delay=dt.timedelta(seconds=d)) for d in (1.0, 1.5, 2.0)]
            )
        wait_for(lambda: len(sent_run_ids(engine)) == 3, timeout=15)
        lateness = [r.sent_at - r.available_at for r in outbox_rows(engine)]
        assert all(dt.timedelta(0) <= late < dt.timedelta(milliseconds=500) for late in lateness), lateness
    finally:
        assert relay.terminate() == 0


def test_backlog_over_four_queues_drains_exactly_once(
    app: sessionmaker[Session],
    settings: OutboxSettings,
    sqs_endpoint: str,
    sqs: Any,
    queues: dict[str, str],
    engine: sa.Engine,
) -> None:
    expected: dict[str, str] = {}
    with app() as session, session.begin():
        for n in range(500):
            queue = QUEUES[n % 4]
            tenant = 1 + n % 5 if queue != "maintenance" else None
            item = Dispatch(TASK_FOR_QUEUE[queue], {"n": n}, tenant_id=tenant)
            session.add(item)
            expected[str(item.run_id)] = queue
    relay = start_relay(settings, sqs_endpoint)
    try:
        wait_for(lambda: len(sent_run_ids(engine)) == 500, timeout=90)
        found: dict[str, list[str]] = collections.defaultdict(list)
        for queue in QUEUES:
            for message in receive_all(sqs, queues[queue], expect=125, timeout=60):
                found[json.loads(message["Body"])["run_id"]].append(queue)
        assert {run: qs for run, qs in found.items() if len(qs) > 1} == {}
        assert {run: qs[0] for run, qs in found.items()} == expected
    finally:
        assert relay.terminate() == 0


def test_without_valkey_the_sweep_delivers(
    engine: sa.Engine,
    settings: OutboxSettings,
    sqs_endpoint: str,
    sqs: Any,
    queues: dict[str, str],
    catalog: Any,
) -> None:
    import sqla_outbox

    down = settings.replace(valkey_url=support.closed_port_url(), relay_sweep_interval_seconds=1)
    maker = sessionmaker(engine)
    sqla_outbox.install(maker, down, catalog=catalog)
    relay = start_relay(down, sqs_endpoint)
    try:
        relay.wait_for_action("relay.leader")
        relay.wait_for_action("relay.wake_lost")
        with maker() as session, session.begin():
            session.add_all([Dispatch("audit", {"n": n}) for n in range(5)])
        assert len(receive_all(sqs, queues["default"], expect=5, timeout=15)) == 5
    finally:
        sqla_outbox.uninstall(maker)
        assert relay.terminate() == 0


@pytest.fixture
def proxied_relay(settings: OutboxSettings, sqs_endpoint: str) -> Iterator[tuple[support.TcpProxy, Any]]:
    """A relay (short backoff) that reaches SQS through a proxy the test can cut or hang."""
    host, port = sqs_endpoint.removeprefix("http://").split(":")
    proxy = support.TcpProxy(host, int(port))
    relay = start_relay(
        settings,
        proxy.endpoint,
        SQLA_OUTBOX_RELAY_BACKOFF_BASE_SECONDS="0.2",
        SQLA_OUTBOX_RELAY_BACKOFF_MAX_SECONDS="1",
    )
    try:
        relay.wait_for_action("relay.leader")
        yield proxy, relay
    finally:
        relay.terminate()
        proxy.close()


def test_sqs_outage_then_recovery_delivers_everything_and_counts_attempts(
    app: sessionmaker[Session],
    proxied_relay: tuple[support.TcpProxy, Any],
    sqs: Any,
    queues: dict[str, str],
    engine: sa.Engine,
) -> None:
    proxy, relay = proxied_relay
    proxy.disable()
    with app() as session, session.begin():
        session.add_all([Dispatch("audit", {"n": n}) for n in range(20)])
    wait_for(lambda: all(r.attempts >= 2 for r in outbox_rows(engine)), timeout=60)
    assert sent_run_ids(engine) == set()
    proxy.enable()
    wait_for(lambda: len(sent_run_ids(engine)) == 20, timeout=60)
    assert (
        len({json.loads(m["Body"])["run_id"] for m in receive_all(sqs, queues["default"], expect=20)}) == 20
    )
    assert relay.actions("relay.send_failed")


def test_hung_sqs_endpoint_fails_the_pass_in_seconds_and_delivers_after(
    app: sessionmaker[Session],
    proxied_relay: tuple[support.TcpProxy, Any],
    sqs: Any,
    queues: dict[str, str],
    engine: sa.Engine,
) -> None:
    """Regression: an endpoint that accepts the connection and never answers held a pass (and
    its row locks) for minutes under botocore's defaults (60 s read timeout, retried). The
    relay's own client gives up within ~20 s (10 s read timeout, 2 attempts) and backs off."""
    proxy, relay = proxied_relay
    proxy.hang()
    hung_at = time.monotonic()
    with app() as session, session.begin():
        session.add(Dispatch("audit", {"n": 1}))
    wait_for(lambda: all(r.attempts >= 1 for r in outbox_rows(engine)), timeout=50)
    assert time.monotonic() - hung_at < 35
    assert sent_run_ids(engine) == set()
    assert relay.actions("relay.send_failed")
    proxy.unhang()
    wait_for(lambda: len(sent_run_ids(engine)) == 1, timeout=30)
    assert len(receive_all(sqs, queues["default"], expect=1)) == 1


def test_sigterm_during_a_backlog_marks_only_what_sqs_accepted(
    app: sessionmaker[Session],
    settings: OutboxSettings,
    sqs_endpoint: str,
    sqs: Any,
    queues: dict[str, str],
    engine: sa.Engine,
) -> None:
    with app() as session, session.begin():
        session.add_all([Dispatch("audit", {"n": n}) for n in range(400)])
    relay = start_relay(settings.replace(relay_batch_size=20), sqs_endpoint)
    wait_for(lambda: len(sent_run_ids(engine)) >= 40, timeout=60)
    relay.process.send_signal(signal.SIGTERM)
    assert relay.process.wait(60) == 0
    marked = sent_run_ids(engine)
    assert 40 <= len(marked) < 400
    in_sqs = set(run_ids_in(sqs, queues, expect=len(marked), timeout=60))
    assert marked <= in_sqs  # nothing marked sent that SQS did not accept
    assert in_sqs == marked  # the pass in progress finished: nothing sent and left unmarked
    assert relay.actions("relay.stopped")


def test_two_relays_never_both_send_and_the_standby_takes_over(
    app: sessionmaker[Session],
    settings: OutboxSettings,
    sqs_endpoint: str,
    sqs: Any,
    queues: dict[str, str],
    engine: sa.Engine,
) -> None:
    first = start_relay(settings, sqs_endpoint, name="first")
    first.wait_for_action("relay.leader")
    second = start_relay(settings, sqs_endpoint, name="second")
    try:
        second.wait_for_action("relay.started")
        with app() as session, session.begin():
            session.add_all([Dispatch("audit", {"n": n}) for n in range(100)])
        wait_for(lambda: len(sent_run_ids(engine)) == 100, timeout=60)
        assert not second.actions("relay.leader")  # hot standby only
        first.kill()  # kill -9: the advisory lock goes with its session
        killed_at = time.monotonic()
        second.wait_for_action("relay.leader", timeout=15)
        assert time.monotonic() - killed_at < 5
        with app() as session, session.begin():
            session.add_all([Dispatch("audit", {"n": n}) for n in range(100, 150)])
        wait_for(lambda: len(sent_run_ids(engine)) == 150, timeout=60)
        found = run_ids_in(sqs, queues, expect=150)
        assert len(found) == 150 and len(set(found)) == 150
    finally:
        first.kill()
        assert second.terminate() == 0


def test_relay_exposes_its_metrics(
    app: sessionmaker[Session],
    settings: OutboxSettings,
    sqs_endpoint: str,
    queues: dict[str, str],
    engine: sa.Engine,
) -> None:
    import urllib.request

    port = support.free_port()
    with app() as session, session.begin():
        session.add(Dispatch("audit", {}, delay=dt.timedelta(hours=1)))  # pending, not due
    relay = start_relay(settings, sqs_endpoint, SQLA_OUTBOX_HEALTH_PORT=str(port))
    try:
        relay.wait_for_action("relay.leader")
        with app() as session, session.begin():
            session.add_all([Dispatch("audit", {"n": n}) for n in range(3)])
        wait_for(lambda: len(sent_run_ids(engine)) == 3, timeout=20)

        def metrics() -> str:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
                return response.read().decode()

        # The pending gauges are refreshed every few seconds: the first refresh may have seen the
        # three rows before they were sent, so wait for one taken after the send.
        pending_line = 'sqla_outbox_relay_pending_rows{queue="default",table="platform_outbox_messages"} 1.0'
        text = wait_for(lambda: (m := metrics()) and pending_line in m and m, timeout=15)
        assert "sqla_outbox_relay_leader 1.0" in text
        assert 'sqla_outbox_relay_messages_sent_total{queue="default"} 3.0' in text
        assert "sqla_outbox_relay_batch_size_bucket" in text
        assert "sqla_outbox_relay_oldest_pending_age_seconds" in text
        assert "sqla_outbox_worker_in_flight" not in text  # the relay serves its own metrics only
    finally:
        assert relay.terminate() == 0


def test_relay_reconnects_to_valkey_and_logs_once_per_outage(
    engine: sa.Engine,
    settings: OutboxSettings,
    sqs_endpoint: str,
    sqs: Any,
    queues: dict[str, str],
    catalog: Any,
) -> None:
    """Valkey is down when the relay starts, comes up, goes down, comes up again."""
    import shutil
    import subprocess

    import sqla_outbox

    server = shutil.which("valkey-server") or shutil.which("redis-server")
    assert server is not None, "redis-server or valkey-server is needed for this test"
    port = support.free_port()
    url = f"redis://127.0.0.1:{port}/0"
    local = settings.replace(valkey_url=url, relay_sweep_interval_seconds=30)
    maker = sessionmaker(engine)
    sqla_outbox.install(maker, local, catalog=catalog)
    relay = start_relay(local, sqs_endpoint)

    def start_valkey() -> subprocess.Popen[bytes]:
        process = subprocess.Popen(
            [server, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
            stdout=subprocess.DEVNULL,
        )
        relay.wait_for_action("relay.wake_recovered", count=len(relay.actions("relay.wake_recovered")) + 1)
        return process

    valkey = None
    try:
        relay.wait_for_action("relay.leader")
        relay.wait_for_action("relay.wake_lost")
        time.sleep(2)  # several reconnect attempts while down ...
        assert len(relay.actions("relay.wake_lost")) == 1  # ... but one line per outage
        valkey = start_valkey()
        started = time.monotonic()
        with maker() as session, session.begin():
            session.add(Dispatch("audit", {"after": "recovery"}))
        assert len(receive_all(sqs, queues["default"], expect=1, timeout=10)) == 1
        assert time.monotonic() - started < 5  # the wake, not the 30 s sweep
        valkey.kill()
        valkey.wait()
        relay.wait_for_action("relay.wake_lost", count=2)
        valkey = start_valkey()
        assert len(relay.actions("relay.wake_recovered")) == 2
    finally:
        sqla_outbox.uninstall(maker)
        if valkey is not None:
            valkey.kill()
        assert relay.terminate() == 0


def _metric(port: int, name: str) -> float | None:
    """One sample of the relay's ``/metrics`` (the first line starting with ``name``)."""
    import urllib.request

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        for line in response.read().decode().splitlines():
            if line.startswith(name):
                return float(line.rsplit(" ", 1)[1])
    return None


def test_a_listen_session_cut_quietly_behind_a_proxy_is_noticed_and_replaced(
    engine: sa.Engine,
    settings: OutboxSettings,
    sqs_endpoint: str,
    queues: dict[str, str],
    catalog: Any,
) -> None:
    """The relay's LISTEN connection goes through a proxy that stops forwarding it without
    closing its socket (TCP keepalives are still answered), while refusing new connections
    for a while. The relay's probes notice within their bound (0.5 s interval + 1 s timeout),
    log it once, export it (alive 0, a stalled reconnect), reconnect through the proxy once
    it forwards again, and commit → send is back to a wake's latency, not the 30 s sweep."""
    import urllib.parse

    import sqla_outbox

    url = urllib.parse.urlsplit(settings.database_url.replace("postgresql+psycopg://", "postgresql://"))
    proxy = support.TcpProxy(url.hostname or "127.0.0.1", url.port or 5432)
    direct = url._replace(netloc=f"{url.username}@127.0.0.1:{proxy.port}").geturl()
    local = settings.replace(wake_mode="postgres", relay_sweep_interval_seconds=30)
    maker = sessionmaker(engine)
    sqla_outbox.install(maker, local, catalog=catalog)
    port = support.free_port()
    relay = start_relay(
        local,
        sqs_endpoint,
        SQLA_OUTBOX_DATABASE_DIRECT_URL=direct,
        SQLA_OUTBOX_RELAY_LISTEN_PROBE_INTERVAL_SECONDS="0.5",
        SQLA_OUTBOX_RELAY_LISTEN_PROBE_TIMEOUT_SECONDS="1",
        SQLA_OUTBOX_HEALTH_PORT=str(port),
    )
    alive = 'sqla_outbox_relay_listen_alive{channel="sqla_outbox_wake"}'
    stalled = 'sqla_outbox_relay_listen_reconnects_total{reason="stalled"}'
    age = 'sqla_outbox_relay_listen_probe_age_seconds{channel="sqla_outbox_wake"}'

    def commit_to_send() -> float:
        started = time.monotonic()
        with maker() as session, session.begin():
            item = Dispatch("audit", {})
            session.add(item)
        wait_for(lambda: str(item.run_id) in sent_run_ids(engine), timeout=60, interval=0.02)
        return time.monotonic() - started

    try:
        relay.wait_for_action("relay.leader")
        wait_for(lambda: _metric(port, alive) == 1.0, timeout=20)
        assert commit_to_send() < 10  # the wake (the sweep is 30 s)
        proxy.freeze()  # the LISTEN session: its socket open, nothing forwarded either way
        proxy.enabled = False  # and no new connection for now: the relay cannot reconnect yet
        cut = time.monotonic()
        relay.wait_for_action("relay.listen_stalled", timeout=20)
        noticed = time.monotonic() - cut
        wait_for(lambda: _metric(port, alive) == 0.0, timeout=10)
        assert _metric(port, stalled) == 1.0
        time.sleep(2)  # reconnects fail meanwhile (the proxy closes new connections) ...
        assert len(relay.actions("relay.listen_stalled")) == 1  # ... one line per episode
        assert relay.actions("relay.listen_lost") == []
        assert (_metric(port, age) or 0.0) >= 2
        proxy.enable()
        recovered = relay.wait_for_action("relay.listen_recovered", timeout=30)
        assert recovered["after"] == "stalled"
        wait_for(lambda: _metric(port, alive) == 1.0, timeout=10)
        assert (_metric(port, age) or 0.0) < 5
        assert commit_to_send() < 10  # back to the wake's latency
        assert noticed < 15  # bounded: 1.5 s by the settings, with room for a loaded machine
    finally:
        sqla_outbox.uninstall(maker)
        assert relay.terminate() == 0
        proxy.close()


def test_partitioned_relays_share_the_outbox_and_take_over_a_killed_ones_partitions(
    app: sessionmaker[Session],
    settings: OutboxSettings,
    sqs_endpoint: str,
    sqs: Any,
    queues: dict[str, str],
    engine: sa.Engine,
) -> None:
    partitioned = {"SQLA_OUTBOX_RELAY_PARTITIONS": "4", "SQLA_OUTBOX_RELAY_STANDBY_POLL_SECONDS": "0.3"}
    first = start_relay(settings, sqs_endpoint, name="first", **partitioned)
    second = start_relay(settings, sqs_endpoint, name="second", **partitioned)
    try:
        env = support.service_env(settings, sqs_endpoint, **partitioned)

        def owners() -> list[list[int]]:  # what `status` reads
            with engine.connect() as conn:
                shown = active_relays(conn, settings.replace(relay_partitions=4))
            return sorted(sorted(r.partitions) for r in shown)

        wait_for(lambda: [len(p) for p in owners()] == [2, 2], timeout=30)
        listed = support.run_cli(env, "status", "--json")
        assert listed.returncode == 0, listed.stderr
        assert sorted(sorted(r["partitions"]) for r in json.loads(listed.stdout)["relays"]) == owners()
        assert all(r["due"] == 0 for r in json.loads(listed.stdout)["relays"])  # nothing dispatched yet
        with app() as session, session.begin():
            session.add_all([Dispatch("send_welcome", {"n": n}, tenant_id=1 + n % 20) for n in range(100)])
        wait_for(lambda: len(sent_run_ids(engine)) == 100, timeout=60)
        assert first.actions("relay.leader") and second.actions("relay.leader")  # both active at once
        first.kill()  # kill -9: its session ends, and its partitions with it
        killed_at = time.monotonic()
        wait_for(lambda: owners() == [[0, 1, 2, 3]], timeout=15)
        assert time.monotonic() - killed_at < 5
        with app() as session, session.begin():
            session.add_all(
                [Dispatch("send_welcome", {"n": n}, tenant_id=1 + n % 20) for n in range(100, 150)]
            )
        wait_for(lambda: len(sent_run_ids(engine)) == 150, timeout=60)
        human = support.run_cli(env, "status")
        assert "Relays (1 active on 4 partitions)" in human.stdout and "0,1,2,3" in human.stdout
        assert "due rows" in human.stdout
        found = run_ids_in(sqs, queues, expect=150)
        assert len(found) == 150 and len(set(found)) == 150
    finally:
        first.kill()
        assert second.terminate() == 0


def test_a_sigterm_during_start_up_is_a_graceful_stop(
    settings: OutboxSettings, sqs_endpoint: str, tmp_path: Any
) -> None:
    """The relay reads its catalog while it starts: a catalog path that is a FIFO holds it
    there until the test writes the catalog. A SIGTERM meanwhile is kept, and the relay
    stops before its first pass (exit 0, never active) instead of dying by the default
    action (exit 143)."""
    fifo = tmp_path / "catalog.fifo"
    os.mkfifo(fifo)
    relay = start_relay(settings, sqs_endpoint, name="early", SQLA_OUTBOX_CATALOG_PATH=str(fifo))
    writer = None
    try:
        # The relay has opened the FIFO (its stop signals are installed by then) once a
        # non-blocking open for writing stops failing with ENXIO; the open for reading then
        # returns and the relay waits in read() until the catalog is written and closed.
        # (A fixed sleep lost the race on CI's loaded machine: the interpreter had not yet
        # started when the signal came.)
        def reader_waits() -> bool:
            nonlocal writer
            assert relay.process.poll() is None
            try:
                writer = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
            except OSError as exc:
                if exc.errno != errno.ENXIO:
                    raise
                return False
            return True

        wait_for(reader_waits, timeout=60)
        assert writer is not None
        relay.process.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        assert relay.process.poll() is None  # kept, not the default action
        os.set_blocking(writer, True)
        with os.fdopen(writer, "w") as catalog:
            writer = None
            catalog.write(Path(settings.catalog_path).read_text())
        assert relay.process.wait(30) == 0
        assert relay.actions("relay.stopped")
        assert not relay.actions("relay.leader")
    finally:
        if writer is not None:
            os.close(writer)
        relay.kill()
