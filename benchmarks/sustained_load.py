"""Sustained load: the highest steady rate this machine holds, for minutes, without drift.

An in-process application commits one dispatch per transaction at a fixed rate while one
relay and two workers (real subprocesses, 8 handler slots each, handlers write one row
through their session) drain through a moto SQS server. Every ``--sample`` seconds it
records dispatched/sent/finished per second, the relay's lag (age of the oldest due unsent
row) and the RSS of the relay and the workers. A steady rate shows flat lag and flat memory.

    .venv/bin/python benchmarks/sustained_load.py --find-rate            # ramp to find the rate
    .venv/bin/python benchmarks/sustained_load.py --rate 120 --duration 300 --json out.json

Needs PostgreSQL (DATABASE_URL server, default postgresql://postgres@127.0.0.1:5432/postgres)
and Redis (REDIS_URL); creates and drops its own database. moto is the ceiling here: its
receive+delete rate is about 250 messages/s on this kind of machine.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import sqlalchemy as sa  # noqa: E402
from sqlalchemy.orm import sessionmaker  # noqa: E402

from tests import support  # noqa: E402


def rss_mib(pid: int) -> float:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return float("nan")


class Rig:
    """Database, queues, relay and workers for one measurement."""

    def __init__(self, workers: int = 2, concurrency: int = 8) -> None:
        import psycopg

        self.server = os.environ.get("DATABASE_URL", "postgresql://postgres@127.0.0.1:5432/postgres")
        self.db_name = f"load_{uuid.uuid4().hex[:8]}"
        support.create_database(self.server, self.db_name)
        url = support.database_url(self.server, self.db_name)
        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute("CREATE TABLE tenants (id bigint PRIMARY KEY)")
            conn.execute(
                "CREATE TABLE effects (id bigserial PRIMARY KEY, run_id uuid NOT NULL, task text NOT NULL, "
                "attempt int, worker text, note text, at timestamptz DEFAULT clock_timestamp())"
            )
        from sqla_outbox import migrations

        self.url = url.replace("postgresql://", "postgresql+psycopg://")
        migrations.upgrade(self.url)
        self.moto = support.MotoServer.start()
        import tests.chaos.tasks  # noqa: F401 - handlers
        from sqla_outbox.config import OutboxSettings
        from sqla_outbox.sqs.provision import provision
        from sqla_outbox.worker.registry import registry

        self.catalog_path = Path(f"/tmp/{self.db_name}-tasks.json")
        self.catalog_path.write_text(registry.catalog().to_json())
        self.settings = OutboxSettings(
            database_url=self.url,
            valkey_url=os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0"),
            wake_key=f"load:{self.db_name}:wake",
            queue_prefix=f"{self.db_name}-",
            catalog_path=str(self.catalog_path),
            sqs_endpoint_url=self.moto.endpoint,
        )
        for key, value in support.AWS_ENV.items():
            os.environ.setdefault(key, value)
        provision(support.sqs_client(self.moto.endpoint), self.settings)
        extra = {"SQLA_OUTBOX_WORKER_CONCURRENCY": str(concurrency), "SQLA_OUTBOX_WORKER_WAIT_SECONDS": "2"}
        self.relay = support.start_relay(self.settings, self.moto.endpoint)
        self.workers = [
            support.start_worker(
                self.settings, self.moto.endpoint, name=f"w{i}", imports="tests.chaos.tasks", **extra
            )
            for i in range(workers)
        ]
        for worker in self.workers:
            worker.wait_for_action("worker.started")
        self.relay.wait_for_action("relay.leader")
        self.engine = sa.create_engine(self.url, pool_size=8)

    def close(self) -> None:
        for process in (self.relay, *self.workers):
            process.kill()
        self.engine.dispose()
        self.moto.stop()
        support.drop_database(self.server, self.db_name)
        self.catalog_path.unlink(missing_ok=True)

    def counts(self) -> dict[str, float]:
        with self.engine.connect() as conn:
            row = conn.execute(
                sa.text(
                    "SELECT (SELECT count(*) FROM platform_outbox_messages"
                    "  WHERE sent_at IS NOT NULL) AS sent,"
                    " (SELECT count(*) FROM task_runs WHERE status IN ('succeeded', 'failed')) AS finished,"
                    " COALESCE((SELECT EXTRACT(EPOCH FROM clock_timestamp() - min(available_at))"
                    "  FROM platform_outbox_messages"
                    "  WHERE sent_at IS NULL AND available_at <= clock_timestamp()), 0)::float8 AS lag"
                )
            ).one()
        return {"sent": row.sent, "finished": row.finished, "lag": row.lag}


def drive(rig: Rig, rate: float, duration: float, sample: float, verbose: bool = True) -> dict[str, Any]:
    """Dispatch at ``rate`` per second for ``duration`` seconds; sample as we go."""
    import sqla_outbox
    from sqla_outbox import Dispatch

    maker = sessionmaker(rig.engine)
    sqla_outbox.install(maker, rig.settings)
    dispatched = [0]
    stop = threading.Event()

    def producer(share: float) -> None:
        interval = 1.0 / share
        next_at = time.monotonic()
        while not stop.is_set():
            with maker() as session, session.begin():
                session.add(Dispatch("chaos.default", {"n": dispatched[0]}))
            dispatched[0] += 1
            next_at += interval
            time.sleep(max(0.0, next_at - time.monotonic()))

    threads = [threading.Thread(target=producer, args=(rate / 4,), daemon=True) for _ in range(4)]
    for thread in threads:
        thread.start()
    samples: list[dict[str, float]] = []
    started = time.monotonic()
    last = {"t": 0.0, "dispatched": 0.0, **rig.counts()}
    try:
        while time.monotonic() - started < duration:
            time.sleep(sample)
            now = {"t": time.monotonic() - started, "dispatched": float(dispatched[0]), **rig.counts()}
            span = now["t"] - last["t"]
            point = {
                "t_s": round(now["t"], 1),
                "dispatched_per_s": round((now["dispatched"] - last["dispatched"]) / span, 1),
                "sent_per_s": round((now["sent"] - last["sent"]) / span, 1),
                "finished_per_s": round((now["finished"] - last["finished"]) / span, 1),
                "lag_s": round(now["lag"], 3),
                "relay_rss_mib": round(rss_mib(rig.relay.process.pid), 1),
                "worker_rss_mib": round(max(rss_mib(w.process.pid) for w in rig.workers), 1),
            }
            samples.append(point)
            if verbose:
                print("  " + "  ".join(f"{k}={v}" for k, v in point.items()), flush=True)
            last = now
    finally:
        stop.set()
        for thread in threads:
            thread.join(5)
        sqla_outbox.uninstall(maker)
    return {"rate": rate, "duration_s": duration, "samples": samples, "summary": summarise(samples)}


def summarise(samples: list[dict[str, float]]) -> dict[str, Any]:
    steady = samples[len(samples) // 5 :] or samples  # skip the warm-up fifth
    first, last = steady[: max(1, len(steady) // 4)], steady[-max(1, len(steady) // 4) :]

    def mean(points: list[dict[str, float]], key: str) -> float:
        return round(statistics.fmean(p[key] for p in points), 2)

    return {
        "dispatched_per_s": mean(steady, "dispatched_per_s"),
        "sent_per_s": mean(steady, "sent_per_s"),
        "finished_per_s": mean(steady, "finished_per_s"),
        "lag_s_median": round(statistics.median(p["lag_s"] for p in steady), 3),
        "lag_s_max": max(p["lag_s"] for p in steady),
        "lag_s_first_quarter": mean(first, "lag_s"),
        "lag_s_last_quarter": mean(last, "lag_s"),
        "worker_rss_mib_first_quarter": mean(first, "worker_rss_mib"),
        "worker_rss_mib_last_quarter": mean(last, "worker_rss_mib"),
        "relay_rss_mib_first_quarter": mean(first, "relay_rss_mib"),
        "relay_rss_mib_last_quarter": mean(last, "relay_rss_mib"),
    }


def steady(result: dict[str, Any]) -> bool:
    s = result["summary"]
    return s["finished_per_s"] >= 0.95 * s["dispatched_per_s"] and s["lag_s_last_quarter"] < 1.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rate", type=float, default=100, help="transactions (= runs) per second")
    parser.add_argument("--duration", type=float, default=300, help="seconds")
    parser.add_argument("--sample", type=float, default=5, help="seconds between samples")
    parser.add_argument("--find-rate", action="store_true", help="ramp 40, 80, 120, ... for 30 s each")
    parser.add_argument("--json", dest="json_path")
    args = parser.parse_args()
    rig = Rig()
    try:
        if args.find_rate:
            best = 0.0
            for rate in (40, 80, 120, 160, 200, 240):
                print(f"ramp: {rate}/s for 30 s", flush=True)
                result = drive(rig, rate, 30, 5, verbose=False)
                print(f"  {result['summary']}", flush=True)
                if not steady(result):
                    break
                best = rate
                time.sleep(10)  # let the backlog clear
            print(f"highest steady rate: {best}/s")
            return
        print(f"sustained: {args.rate}/s for {args.duration:.0f} s", flush=True)
        result = drive(rig, args.rate, args.duration, args.sample)
        print(json.dumps(result["summary"], indent=2))
        print("steady:", steady(result))
        if args.json_path:
            Path(args.json_path).write_text(json.dumps(result, indent=2))
    finally:
        rig.close()


if __name__ == "__main__":
    main()
