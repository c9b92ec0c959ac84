"""Per-task rate limits, concurrency caps and circuit breakers with real worker and relay
processes, real Valkey, PostgreSQL and (AWS-strict) moto.

Tasks: ``tests/e2e/limits_tasks.py``. Every throttled run must be deferred through the
outbox (ADR 0010/0014): no attempt spent, no SQS receive budget spent, nothing in a DLQ.
"""

from __future__ import annotations

import copy
import http.server
import itertools
import shutil
import subprocess
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.orm import Session, sessionmaker

from sqla_outbox import Dispatch
from sqla_outbox.catalog import Catalog
from sqla_outbox.config import OutboxSettings
from tests import support
from tests.e2e.limits_tasks import LAB
from tests.support import (
    ServiceProcess,
    free_port,
    receive_all,
    run_row,
    start_relay,
    start_worker,
    trail,
    wait_for,
)

pytestmark = pytest.mark.e2e

TASKS = "tests.e2e.limits_tasks"
LIMITED = (
    "limits.single",
    "limits.rated",
    "limits.charge",
    "limits.refund",
    "limits.flaky",
    "limits.lab_order",
)


@pytest.fixture
def catalog() -> Catalog:
    data = copy.deepcopy(support.CATALOG)
    data["tasks"].update({name: {"queue": "default"} for name in LIMITED})
    return Catalog.from_dict(data)


@pytest.fixture
def services(settings: OutboxSettings, sqs_endpoint: str, queues: dict[str, str]) -> Iterator[Any]:
    started: list[ServiceProcess] = []

    def start(kind: str, **extra: str) -> ServiceProcess:
        name = f"{kind}{len(started)}"
        if kind == "relay":
            extra.setdefault("SQLA_OUTBOX_RELAY_SWEEP_INTERVAL_SECONDS", "0.1")
            process = start_relay(settings, sqs_endpoint, name=name, **extra)
            process.wait_for_action("relay.leader")
        else:
            process = start_worker(
                settings, sqs_endpoint, name=name, imports=TASKS, SQLA_OUTBOX_WORKER_QUEUES="default", **extra
            )
            process.wait_for_action("worker.started")
        started.append(process)
        return process

    yield start
    for process in started:
        process.kill()
        print(f"--- {process.name} log (tail) ---\n" + "".join(process.raw[-30:]))  # shown on failure


def dispatch(app: sessionmaker[Session], task: str, payload: dict[str, Any] | None = None) -> uuid.UUID:
    with app() as session, session.begin():
        item = Dispatch(task, payload or {}, tenant_id=1)
        session.add(item)
    return item.run_id


def succeeded(engine: sa.Engine, run_ids: list[uuid.UUID]) -> bool:
    return all(run_row(engine, r).status == "succeeded" for r in run_ids)


def effect_times(engine: sa.Engine, task: str) -> list[tuple[float, str]]:
    with engine.connect() as conn:
        rows = conn.execute(
            sa.text(
                "SELECT EXTRACT(EPOCH FROM at)::float8 AS started, worker FROM effects "
                "WHERE task = :t ORDER BY at"
            ),
            {"t": task},
        )
        return [(float(r.started), str(r.worker)) for r in rows]


def deferrals(engine: sa.Engine, run_id: uuid.UUID, reason: str) -> int:
    return sum(1 for row in trail(engine, run_id) if (row.detail or {}).get("deferred") == reason)


def counted_failures(rows: list[Any]) -> int:
    """Trail rows of attempts that failed and counted (``retrying``, not a deferral's row)."""
    return sum(1 for r in rows if r.status == "retrying" and "deferred" not in (r.detail or {}))


def no_dead_letters(sqs: Any, queues: dict[str, str]) -> bool:
    return receive_all(sqs, queues["default-dlq"], visibility=0) == []


FAST_THROTTLE = {
    "SQLA_OUTBOX_LIMITS_THROTTLE_DELAY_SECONDS": "0.01",
    "SQLA_OUTBOX_LIMITS_THROTTLE_DELAY_MAX_SECONDS": "0.02",
}


@pytest.mark.parametrize("wake_mode", ["valkey", "postgres"])
def test_a_run_throttled_50_times_succeeds_on_its_first_attempt(
    services: Any,
    settings: OutboxSettings,
    catalog: Catalog,
    engine: sa.Engine,
    sqs: Any,
    queues: dict[str, str],
    tmp_path: Path,
    wake_mode: str,
) -> None:
    """``limits.single`` (concurrency=1): while run A holds the only slot, run B is refused
    and deferred through the outbox again and again; after 50 deferrals A finishes and B
    runs: attempt 1, receive count 1, nothing dead-lettered. The relay sweeps only every
    30 s: each deferral wakes it, so its timer follows the deferred row's due time."""
    import sqla_outbox

    app = sessionmaker(engine)
    sqla_outbox.install(app, settings.replace(wake_mode=wake_mode), catalog=catalog)
    wake = {"SQLA_OUTBOX_WAKE_MODE": wake_mode}
    services("relay", SQLA_OUTBOX_RELAY_SWEEP_INTERVAL_SECONDS="30", **wake)
    services("worker", **wake, **FAST_THROTTLE)
    hold = tmp_path / "hold"
    hold.write_text("")
    first = dispatch(app, "limits.single", {"hold_while": str(hold)})
    wait_for(lambda: run_row(engine, first).status == "running", timeout=30)
    second = dispatch(app, "limits.single")
    wait_for(lambda: deferrals(engine, second, "concurrency") >= 50, timeout=120, interval=0.2)
    hold.unlink()
    wait_for(lambda: succeeded(engine, [first, second]), timeout=30)
    row = run_row(engine, second)
    assert row.attempts == 1
    rows = trail(engine, second)
    assert max(r.receive_count or 0 for r in rows) == 1  # every delivery was a first receive
    assert [r.attempt for r in rows if r.status == "succeeded"] == [1]
    assert deferrals(engine, second, "concurrency") >= 50
    assert no_dead_letters(sqs, queues)
    sqla_outbox.uninstall(app)


def test_rate_limit_holds_across_two_worker_processes(
    services: Any, app: Any, engine: sa.Engine, sqs: Any, queues: dict[str, str]
) -> None:
    """``limits.rated`` allows 4 runs per 2 s; 16 runs on two workers start at most 4 in any
    2-second window, both workers take part, and every run succeeds on attempt 1."""
    services("relay")
    services("worker")
    services("worker")
    started = time.monotonic()
    run_ids = [dispatch(app, "limits.rated", {"n": n}) for n in range(16)]
    wait_for(lambda: succeeded(engine, run_ids), timeout=90, interval=0.2)
    elapsed = time.monotonic() - started
    times = effect_times(engine, "limits.rated")
    assert len(times) == 16
    # (a 50 ms margin for the gap between admission in Valkey and the handler's INSERT)
    most = max(sum(1 for t, _ in times if start <= t < start + 1.95) for start, _ in times)
    assert most <= 4, [round(t - times[0][0], 2) for t, _ in times]
    assert elapsed >= 5.5  # 16 runs at 4 per 2 s need at least 3 full windows after the first
    assert len({worker for _, worker in times}) == 2
    assert all(run_row(engine, r).attempts == 1 for r in run_ids)
    assert no_dead_letters(sqs, queues)


def test_a_slot_held_by_a_killed_worker_frees_after_its_lease(
    services: Any, app: Any, engine: sa.Engine, tmp_path: Path
) -> None:
    """A worker holding ``limits.single``'s only slot is killed with SIGKILL: the other
    worker runs the next run once the slot's 4-second lease lapses, not never."""
    lease = {"SQLA_OUTBOX_LIMITS_SLOT_LEASE_SECONDS": "4", **FAST_THROTTLE}
    services("relay")
    workers = [services("worker", **lease), services("worker", **lease)]
    hold = tmp_path / "hold"
    hold.write_text("")
    first = dispatch(app, "limits.single", {"hold_while": str(hold)})
    owner = wait_for(lambda: run_row(engine, first).lease_owner, timeout=30)
    holder = next(w for w in workers if owner.endswith(f":{w.process.pid}"))
    survivor = next(w for w in workers if w is not holder)
    time.sleep(5)  # longer than the lease: the heartbeat kept renewing it
    holder.kill()  # SIGKILL: no release, no clean stop
    killed_at = time.time()
    # dispatched once the killed worker's last long poll (1 s) has ended: a message SQS hands
    # to a dead poll only comes back after the visibility timeout, not what this test is about
    time.sleep(1.5)
    second = dispatch(app, "limits.single")
    wait_for(lambda: deferrals(engine, second, "concurrency") >= 1, timeout=10)  # the dead slot still counts
    wait_for(lambda: run_row(engine, second).status == "succeeded", timeout=30)
    ran_at = effect_times(engine, "limits.single")[-1][0]
    assert ran_at - killed_at <= 4 + 2.5  # lease + deferral and resend latency
    assert effect_times(engine, "limits.single")[-1][1] == str(survivor.process.pid)
    assert run_row(engine, second).attempts == 1


class FailingStub:
    """A loopback HTTP endpoint that answers 500 while ``failing``, else 200; records request times."""

    def __init__(self) -> None:
        self.failing = True
        self.requests: list[float] = []
        stub = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                self.rfile.read(int(self.headers.get("content-length", "0")))
                stub.requests.append(time.monotonic())
                self.send_response(500 if stub.failing else 200)
                self.send_header("content-length", "2")
                self.end_headers()
                self.wfile.write(b"no" if stub.failing else b"ok")

            def log_message(self, *args: Any) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/charge"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()


def test_breaker_opens_on_failures_fails_fast_and_closes_after_probes(
    services: Any, app: Any, engine: sa.Engine, sqs: Any, queues: dict[str, str]
) -> None:
    """Breaker ``stub-api`` (3 failures → open 3 s → 2 successes close it), shared by
    ``limits.charge`` and ``limits.refund`` on two workers: after three 500s it opens, the
    stub gets no request while it is open, runs wait in the outbox with no attempt spent,
    and once the stub answers again the half-open probes close it and every run succeeds.

    A retry admitted while the breaker was still closed may reach the stub just after the
    third failure opened it (on a slow machine it did: a fourth request); so the count is
    read once such calls are done, and bounded: at most one more per failing run."""
    stub = FailingStub()
    try:
        services("relay")
        env = {"LIMITS_STUB_URL": stub.url, **FAST_THROTTLE}
        workers = [services("worker", **env), services("worker", **env)]
        failing = [dispatch(app, "limits.charge") for _ in range(3)]
        wait_for(lambda: any(w.actions("breaker.open") for w in workers), timeout=30)
        time.sleep(0.5)  # calls admitted before it opened finish (the stub answers at once)
        seen = len(stub.requests)
        assert len(failing) <= seen <= 2 * len(failing)
        waiting = [dispatch(app, "limits.charge"), dispatch(app, "limits.refund")]
        wait_for(lambda: all(deferrals(engine, r, "breaker-open") >= 1 for r in waiting), timeout=20)
        time.sleep(1.0)
        assert len(stub.requests) == seen  # open: the handler is not called, nothing hammers the API
        stub.failing = False
        wait_for(lambda: succeeded(engine, failing + waiting), timeout=60, interval=0.2)
        names = ("breaker.half_open", "breaker.closed")
        actions = {a["action"] for w in workers for name in names for a in w.actions(name)}
        assert actions == set(names)
        assert all(run_row(engine, r).attempts == 1 for r in waiting)  # fast fails spent no attempt
        # every request the stub refused was one failed attempt, then one success each; the
        # failures that found the breaker open (the one that opened it, any that ended after)
        # were the outage's: deferred without counting their attempt
        uncounted = sum(deferrals(engine, r, "breaker-outage") for r in failing)
        assert uncounted >= 1
        assert sum(run_row(engine, r).attempts for r in failing) == seen + len(failing) - uncounted
        assert no_dead_letters(sqs, queues)
    finally:
        stub.close()


def test_a_lone_run_rides_out_an_outage_shorter_than_the_breakers_horizon(
    services: Any, app: Any, engine: sa.Engine, sqs: Any, queues: dict[str, str]
) -> None:
    """``limits.lab_order`` (3 tries; breaker ``lab-api``: 3 failures open it for 1 s, 20 s
    of outage ridden out): the API is down for about 6 s. The run's third failure, which
    would have spent its last try, opens the breaker and is deferred without counting;
    each failed probe is too. Once the API answers the run succeeds on its third attempt,
    nothing reaches the DLQ, and the API saw 3 calls plus about one probe per open period."""
    stub = FailingStub()
    try:
        services("relay")
        worker = services("worker", LIMITS_STUB_URL=stub.url, **FAST_THROTTLE)
        run_id = dispatch(app, "limits.lab_order")
        wait_for(lambda: worker.actions("breaker.open"), timeout=30)
        opened = time.monotonic()
        wait_for(lambda: deferrals(engine, run_id, "breaker-outage") >= 3, timeout=30, interval=0.2)
        down_for = time.monotonic() - opened
        stub.failing = False
        wait_for(lambda: run_row(engine, run_id).status == "succeeded", timeout=30, interval=0.2)
        row = run_row(engine, run_id)
        assert row.attempts == 3  # two counted failures, then the success: the outage spent nothing
        assert no_dead_letters(sqs, queues)
        calls = len(stub.requests)
        open_periods = down_for / LAB.open_seconds
        assert 3 + 3 <= calls <= 3 + open_periods + 2, (calls, down_for)
        rows = trail(engine, run_id)
        outage = [r for r in rows if (r.detail or {}).get("deferred") == "breaker-outage"]
        assert all(r.status == "queued" and r.error_type == "RuntimeError" for r in outage)
        assert counted_failures(rows) == 2
        logged = worker.actions("worker.outage_deferred")
        assert len(logged) == len(outage) and all(a["run_id"] == str(run_id) for a in logged)
    finally:
        stub.close()


def test_an_outage_longer_than_the_horizon_still_ends_in_the_dlq(
    services: Any, app: Any, engine: sa.Engine, sqs: Any, queues: dict[str, str]
) -> None:
    """``limits.flaky`` always fails; its breaker opens on every failure for 3 s and rides
    out 4 s of outage. Within those 4 s its failures (the first, which opened it, and the
    first probe) are deferred without counting; after them they count again, and the run
    fails for good on its third counted attempt (``max_receives=3``) and only then reaches
    the DLQ. Attempts still bound the retries although every deferral restarts the receive
    count."""
    services("relay")
    services("worker", **FAST_THROTTLE)
    run_id = dispatch(app, "limits.flaky")
    wait_for(lambda: run_row(engine, run_id).status == "failed", timeout=90, interval=0.2)
    assert run_row(engine, run_id).attempts == 3
    rows = trail(engine, run_id)
    assert deferrals(engine, run_id, "breaker-outage") >= 2
    assert counted_failures(rows) == 2
    assert max(r.receive_count or 0 for r in rows) < 3  # receives alone never got there
    dead = receive_all(sqs, queues["default-dlq"], expect=1, timeout=20)
    assert len(dead) == 1 and str(run_id) in dead[0]["Body"]


def _valkey_on(port: int) -> subprocess.Popen[bytes]:
    server = shutil.which("valkey-server") or shutil.which("redis-server")
    assert server is not None, "valkey-server or redis-server is needed for this test"
    return subprocess.Popen(
        [server, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
        stdout=subprocess.DEVNULL,
    )


def test_a_valkey_outage_limits_per_process_and_shares_again_after(
    services: Any, app: Any, engine: sa.Engine, sqs: Any, queues: dict[str, str], tmp_path: Path
) -> None:
    """The worker's Valkey (a private server) is stopped while ``limits.single`` runs
    flow: runs keep succeeding, the cap holds per process (no two runs overlap on the one
    worker), the outage is logged once; a Valkey started again on the port is used again."""
    import redis

    port = free_port()
    url = f"redis://127.0.0.1:{port}/0"
    valkey = _valkey_on(port)
    try:
        wait_for(lambda: support._answers(redis, url), timeout=10)
        services("relay")
        worker = services(
            "worker",
            SQLA_OUTBOX_VALKEY_URL=url,
            SQLA_OUTBOX_LIMITS_VALKEY_RETRY_SECONDS="0.5",
            **FAST_THROTTLE,
        )
        before = [dispatch(app, "limits.single", {"sleep": 0.3}) for _ in range(3)]
        wait_for(lambda: succeeded(engine, before), timeout=30)
        valkey.kill()
        valkey.wait(10)
        during = [dispatch(app, "limits.single", {"sleep": 0.3}) for _ in range(4)]
        wait_for(lambda: succeeded(engine, during), timeout=60, interval=0.2)
        assert len(worker.actions("limits.valkey_lost")) == 1
        starts = [t for t, _ in effect_times(engine, "limits.single")]
        assert all(b - a >= 0.28 for a, b in itertools.pairwise(starts))  # never two at once
        valkey = _valkey_on(port)
        wait_for(lambda: support._answers(redis, url), timeout=10)
        after: list[uuid.UUID] = []

        def recovered() -> bool:  # runs keep coming; one of them finds Valkey again
            after.append(dispatch(app, "limits.single"))
            return bool(worker.actions("limits.valkey_recovered"))

        wait_for(recovered, timeout=30, interval=0.5)
        wait_for(lambda: succeeded(engine, after), timeout=30)
        hold = tmp_path / "hold"
        hold.write_text("")
        after.append(dispatch(app, "limits.single", {"hold_while": str(hold)}))
        wait_for(lambda: run_row(engine, after[-1]).status == "running", timeout=30)
        client = redis.Redis.from_url(url)
        slots = [client.zcard(key) for key in client.keys("sqla_outbox:limits:*slots:limits.single")]
        assert slots == [1]  # the shared state is in use again
        hold.unlink()
        wait_for(lambda: succeeded(engine, after), timeout=30)
        assert all(run_row(engine, r).attempts == 1 for r in before + during + after)
        assert no_dead_letters(sqs, queues)
    finally:
        valkey.kill()
        valkey.wait(10)
