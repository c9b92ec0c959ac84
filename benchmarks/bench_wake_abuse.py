"""Wake-key abuse (issue 12, item 3): a relay's memory, database passes and log lines while
someone with write access to Valkey abuses the wake key; this tree beside a baseline.

Each side is a real relay process (``python -m sqla_outbox.relay``, JSON logs, sweep every
5 s) on the script's own database, a moto server and a Valkey/Redis server of its own
(``redis-server`` on a free port, so the abuse touches nobody else). ``--baseline REF``
(default ``main``) is measured from ``git archive REF sqla_outbox`` put first on the
relay's ``PYTHONPATH``; ``--baseline ''`` measures only the working tree. Every scenario
starts a fresh relay and lasts ``--seconds`` (default 10):

``idle``
    nothing is pushed (the floor).
``wrong-type``
    ``SET <wake key> not-a-list`` before the relay starts.
``huge``
    one 64 MiB ``LPUSH`` (built by a Lua script inside the server, so the pusher holds
    nothing), one second after the relay became active.
``flood``
    ``LPUSH <wake key> 1`` from one client as fast as it goes, the whole time.

Figures: the relay's peak RSS (``VmHWM`` from ``/proc/<pid>/status``: the high-water
mark since the process started, read just before it is stopped), database transactions
per second (``pg_stat_database.xact_commit`` of the database over the scenario; a backend
reports its counts when it exits, so they are read after the relay stopped) and log lines
per second (from the moment the relay became active). Judged by: with the fix, ``huge``
peak RSS within 10 MiB of ``idle``; ``flood`` at most 45 transactions a second (20 empty
wake passes a second at most, each one transaction plus at most one due-time query);
``wrong-type`` at most 1 log line a second and no more transactions than ``idle`` (+0.5/s).

    cd benchmarks && ../.venv-bench/bin/python bench_wake_abuse.py --json results/wake_abuse.json
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import _common as common
import psycopg
import redis

from tests.support import private_valkey

SCENARIOS = ("idle", "wrong-type", "huge", "flood")
HUGE_BYTES = 64 * 1024 * 1024


@contextlib.contextmanager
def snapshot(ref: str) -> Iterator[Path]:
    """``sqla_outbox`` as of ``ref``, in a temporary directory."""
    with tempfile.TemporaryDirectory(prefix="sqla_outbox_baseline_") as directory:
        archive = subprocess.run(
            ["git", "-C", str(common.ROOT), "archive", ref, "sqla_outbox"], capture_output=True, check=True
        )
        subprocess.run(["tar", "-x", "-C", directory], input=archive.stdout, check=True)
        yield Path(directory)


def xact_commit(db: common.BenchDatabase) -> int:
    with psycopg.connect(db.server_url, autocommit=True) as conn:
        conn.execute("SELECT pg_stat_clear_snapshot()")
        row = conn.execute(
            "SELECT xact_commit FROM pg_stat_database WHERE datname = %s", (db.name,)
        ).fetchone()
    assert row is not None
    return int(row[0])


def peak_rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


class RelayProcess:
    """A relay subprocess whose stderr lines are counted as they come."""

    def __init__(self, env: dict[str, str], cwd: str) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-m", "sqla_outbox.relay", "--log-format", "json"],
            env=env,
            cwd=cwd,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.lines: list[tuple[float, str]] = []
        self.leader = threading.Event()
        self.active_at = 0.0
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.process.stderr is not None
        for line in self.process.stderr:
            self.lines.append((time.monotonic(), line))
            if '"relay.leader"' in line and not self.leader.is_set():
                self.active_at = time.monotonic()
                self.leader.set()

    def lines_between(self, start: float, end: float) -> int:
        return sum(1 for at, _ in list(self.lines) if start <= at <= end)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)
        self._reader.join(5)


def run_scenario(
    name: str,
    *,
    env: dict[str, str],
    cwd: str,
    valkey_url: str,
    key: str,
    db: common.BenchDatabase,
    seconds: float,
) -> dict[str, float]:
    client = redis.Redis.from_url(valkey_url)
    client.delete(key)
    if name == "wrong-type":
        client.set(key, "not-a-list")
    relay = RelayProcess(env, cwd)
    stop = threading.Event()
    pushes = 0

    def flood() -> None:
        nonlocal pushes
        pusher = redis.Redis.from_url(valkey_url)
        while not stop.is_set():
            pusher.lpush(key, 1)
            pushes += 1
        pusher.close()

    try:
        if not relay.leader.wait(60):
            raise RuntimeError(
                "the relay did not become active:\n" + "".join(line for _, line in relay.lines[-20:])
            )
        time.sleep(1.0)
        before = xact_commit(db)
        started = time.monotonic()
        flooder = threading.Thread(target=flood) if name == "flood" else None
        if flooder is not None:
            flooder.start()
        if name == "huge":
            client.eval(
                "return redis.call('LPUSH', KEYS[1], string.rep('x', tonumber(ARGV[1])))", 1, key, HUGE_BYTES
            )
        time.sleep(seconds)
        stop.set()
        if flooder is not None:
            flooder.join()
        ended = time.monotonic()
        peak = peak_rss_mib(relay.process.pid)
        active = relay.active_at
        lines = relay.lines_between(active, ended)
    finally:
        stop.set()
        relay.stop()
        client.delete(key)
        client.close()
    elapsed = ended - started
    transactions = xact_commit(db) - before
    return {
        "peak_rss_mib": round(peak, 1),
        "transactions_per_s": round(transactions / elapsed, 1),
        "log_lines_per_s": round(lines / (ended - active), 2),
        "pushes_per_s": round(pushes / elapsed, 1),
    }


def main() -> None:
    parser = common.parser(__doc__, rounds=1)
    parser.add_argument(
        "--baseline", default="main", help="git ref measured beside the working tree ('' = none)"
    )
    parser.add_argument("--seconds", type=float, default=10.0, help="length of each scenario")
    args = parser.parse_args()
    report = common.Report("wake_abuse", args, {"baseline": args.baseline, "seconds": args.seconds})
    sides: dict[str, list[dict[str, Any]]] = {}
    with (
        common.bench_database(args, "bench_wake_abuse") as db,
        common.moto_server() as moto,
        private_valkey() as valkey_url,
        contextlib.ExitStack() as stack,
    ):
        settings = common.settings(db, valkey_url, sqs_endpoint_url=moto.endpoint)
        common.provision(common.sqs_client(moto.endpoint), settings)
        env = {k: v for k, v in os.environ.items() if not k.startswith("SQLA_OUTBOX_")}
        env.update(common.AWS_ENV)
        env.update(
            {
                "SQLA_OUTBOX_DATABASE_URL": settings.database_url,
                "SQLA_OUTBOX_VALKEY_URL": valkey_url,
                "SQLA_OUTBOX_WAKE_KEY": settings.wake_key,
                "SQLA_OUTBOX_QUEUE_PREFIX": settings.queue_prefix,
                "SQLA_OUTBOX_SQS_ENDPOINT_URL": moto.endpoint,
                "SQLA_OUTBOX_CATALOG_PATH": settings.catalog_path,
            }
        )
        trees: dict[str, tuple[dict[str, str], str]] = {}
        if args.baseline:
            old = stack.enter_context(snapshot(args.baseline))
            trees[f"baseline ({args.baseline})"] = ({**env, "PYTHONPATH": str(old)}, str(old))
        trees["this tree"] = (
            {**env, "PYTHONPATH": str(common.ROOT)},
            str(Path(__file__).resolve().parent),
        )
        for side, (side_env, cwd) in trees.items():
            sides[side] = []
            for scenario in SCENARIOS:
                figures = run_scenario(
                    scenario,
                    env=side_env,
                    cwd=cwd,
                    valkey_url=valkey_url,
                    key=settings.wake_key,
                    db=db,
                    seconds=args.seconds,
                )
                print(f"  {side} {scenario}: {json.dumps(figures)}", flush=True)
                sides[side].append({"scenario": scenario, **figures})
    header = ["scenario"]
    for side in sides:
        header += [f"{side}: peak RSS MiB", "txn/s", "log lines/s"]
    rows = []
    for index, scenario in enumerate(SCENARIOS):
        row: list[Any] = [scenario]
        for figures in sides.values():
            row += [
                figures[index]["peak_rss_mib"],
                figures[index]["transactions_per_s"],
                figures[index]["log_lines_per_s"],
            ]
        rows.append(row)
    report.table("Relay under wake-key abuse (flood: pushes/s in the JSON)", header, rows)
    report.results = sides
    ours = {f["scenario"]: f for f in sides["this tree"]}
    report.ratio(
        "huge: peak RSS growth over idle, MiB",
        ours["huge"]["peak_rss_mib"] - ours["idle"]["peak_rss_mib"],
        10,
        higher_is_better=False,
    )
    flood = ours["flood"]["transactions_per_s"]
    report.ratio("flood: database transactions/s", flood, 45, higher_is_better=False)
    lines = ours["wrong-type"]["log_lines_per_s"]
    report.ratio("wrong-type: log lines/s since the relay became active", lines, 1, higher_is_better=False)
    extra = ours["wrong-type"]["transactions_per_s"] - ours["idle"]["transactions_per_s"]
    report.ratio("wrong-type: database transactions/s above idle", extra, 0.5, higher_is_better=False)
    report.emit()


if __name__ == "__main__":
    main()
