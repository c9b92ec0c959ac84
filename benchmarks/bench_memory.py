"""Figure 7 — memory: relay and worker peak RSS while draining, at two backlog sizes.

Each measurement runs in a fresh child process (this script with ``--child``), so the
peak belongs to that drain alone. The child samples its RSS every 10 ms with psutil and
also reads ``ru_maxrss``; it reports the RSS just before draining (after imports,
connections and objects are set up: the baseline), the peak while draining, and the
growth (peak - baseline).

``relay``
    :class:`~sqla_outbox.relay.Relay` ``.run()`` with an accept-everything sender,
    draining a backlog of ``--relay-small`` and ``--relay-large`` due rows (default
    10,000 and 100,000), set-based filled beforehand.
``worker``
    :class:`~sqla_outbox.worker.consumer.Worker` ``.run()`` (sync no-op handler,
    concurrency 8) draining ``--worker-small`` and ``--worker-large`` messages (default
    200 and 1,000) from a moto server. The parent feeds the queue so that at most
    ``--window`` (default 200) messages are outstanding, keeping moto's queue small.

Sizes alternate over ``--rounds``; the figure is the median peak per size. Judged by:
peak(large) / peak(small) <= 1.10 for each component ("flat with backlog size").
"""

from __future__ import annotations

import json
import os
import resource
import signal
import subprocess
import sys
import threading
import time
from typing import Any

import _common as common


# --- child ----------------------------------------------------------------------------------------
class Sampler:
    def __init__(self) -> None:
        import psutil

        self.process = psutil.Process()
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def rss(self) -> int:
        return int(self.process.memory_info().rss)

    def start(self) -> int:
        baseline = self.rss()
        self.peak = baseline
        self._thread.start()
        return baseline

    def _run(self) -> None:
        while not self._stop.wait(0.01):
            self.peak = max(self.peak, self.rss())

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self.rss())
        return self.peak


def child_relay(args: Any) -> dict[str, Any]:
    from sqla_outbox.config import OutboxSettings
    from sqla_outbox.relay import Relay

    st = OutboxSettings(
        database_url=args.db_url, valkey_url=None, catalog_path=args.catalog, relay_sweep_interval_seconds=5
    )
    sender = common.AcceptAllSender(target=args.size)
    engine = common.one_connection_engine(args.db_url)
    with engine.connect() as conn:  # connect before the baseline
        conn.exec_driver_sql("SELECT 1")
    relay = Relay(st, sender=sender, engine=engine, name="bench")
    sampler = Sampler()
    baseline = sampler.start()
    started = time.perf_counter()
    relay.start_in_thread()
    if not sender.done.wait(600):
        raise RuntimeError("relay did not drain")
    elapsed = time.perf_counter() - started
    relay.stop()
    relay.join(30)
    peak = sampler.stop()
    return {"baseline": baseline, "peak": peak, "elapsed": elapsed, "sent": sender.sent}


def child_worker(args: Any) -> dict[str, Any]:
    from sqla_outbox.config import OutboxSettings
    from sqla_outbox.sqs.client import make_client
    from sqla_outbox.worker.consumer import Worker
    from sqla_outbox.worker.registry import Registry

    st = OutboxSettings(
        database_url=args.db_url,
        valkey_url=None,
        catalog_path=args.catalog,
        sqs_endpoint_url=args.endpoint,
        queue_prefix=args.prefix,
        worker_queues=("default",),
        worker_wait_seconds=1,
    )
    registry = Registry()
    registry.task(common.TENANT_TASK, queue="default", scope="tenant")(lambda payload: None)
    client = make_client(st, max_pool_connections=30, read_timeout_seconds=20)
    counter = common.DeleteCounter(client, args.size)
    worker = Worker(st, registry=registry, catalog=common.catalog(), client=counter, name="bench")
    done = counter.done
    signal.signal(signal.SIGUSR1, lambda *_: done.set())  # the parent saw moto lose messages
    sampler = Sampler()
    baseline = sampler.start()
    thread = threading.Thread(target=lambda: worker.run(handle_signals=False), daemon=True)
    started = time.perf_counter()
    thread.start()
    if not done.wait(600):
        raise RuntimeError(f"worker deleted {counter.deleted} of {args.size}")
    lost = args.size - counter.deleted
    elapsed = time.perf_counter() - started
    worker.stop()
    thread.join(60)
    peak = sampler.stop()
    return {"baseline": baseline, "peak": peak, "elapsed": elapsed, "deleted": counter.deleted, "lost": lost}


def child_main(args: Any) -> None:
    result = child_relay(args) if args.child == "relay" else child_worker(args)
    result["ru_maxrss"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print("RESULT " + json.dumps(result), flush=True)


# --- parent ---------------------------------------------------------------------------------------
def run_child(argv: list[str], feeder: Any = None) -> dict[str, Any]:
    process = subprocess.Popen(
        [sys.executable, os.path.abspath(__file__), *argv],
        stdout=subprocess.PIPE,
        text=True,
        env=dict(os.environ),
    )
    if feeder is not None:
        feeder(process)
    out, _ = process.communicate(timeout=900)
    if process.returncode != 0:
        raise RuntimeError(f"child {argv} failed ({process.returncode})")
    line = next(x for x in out.splitlines() if x.startswith("RESULT "))
    result: dict[str, Any] = json.loads(line.removeprefix("RESULT "))
    return result


def main() -> None:
    p = common.parser(__doc__, rounds=2)
    p.add_argument("--relay-small", type=int, default=10_000)
    p.add_argument("--relay-large", type=int, default=100_000)
    p.add_argument("--worker-small", type=int, default=200)
    p.add_argument("--worker-large", type=int, default=1_000)
    p.add_argument("--window", type=int, default=200, help="most messages outstanding in moto")
    p.add_argument("--no-worker", action="store_true")
    # child mode (internal)
    p.add_argument("--child", choices=["relay", "worker"], help=argparse_hidden())
    p.add_argument("--size", type=int, help=argparse_hidden())
    p.add_argument("--db-url", help=argparse_hidden())
    p.add_argument("--catalog", help=argparse_hidden())
    p.add_argument("--endpoint", help=argparse_hidden())
    p.add_argument("--prefix", help=argparse_hidden())
    args = p.parse_args()
    if args.child:
        child_main(args)
        return

    import psycopg

    from sqla_outbox.relay.claim import ClaimedRow
    from sqla_outbox.relay.send import build_entry

    report = common.Report(
        "bench_memory",
        args,
        {
            "rounds": args.rounds,
            "relay_sizes": [args.relay_small, args.relay_large],
            "worker_sizes": [args.worker_small, args.worker_large],
            "window": args.window,
        },
    )
    measurements: dict[str, list[dict[str, Any]]] = {}
    lost: list[int] = []
    with common.bench_database(args, "bench_memory") as db:
        st = common.settings(db, None)

        def relay(size: int) -> dict[str, Any]:
            common.truncate_outbox(db.url)
            common.fill_backlog(db.url, size)
            argv = [
                "--child",
                "relay",
                "--size",
                str(size),
                "--db-url",
                db.sa_url,
                "--catalog",
                st.catalog_path,
            ]
            return run_child(argv)

        sides: dict[str, Any] = {
            f"relay {args.relay_small:,}": lambda: relay(args.relay_small),
            f"relay {args.relay_large:,}": lambda: relay(args.relay_large),
        }
        server = None if args.no_worker else common.MotoServer.start()
        try:
            if server is not None:
                wst = st.replace(sqs_endpoint_url=server.endpoint)
                client = common.sqs_client(server.endpoint)

                def worker(size: int) -> dict[str, Any]:
                    assert server is not None
                    url = common.fresh_queues(server.endpoint, client, wst)["default"]
                    common.truncate_outbox(db.url)
                    common.fill_backlog(db.url, size)
                    with psycopg.connect(db.url) as conn:
                        rows = conn.execute(
                            "SELECT id, run_id, queue, tenant_id, envelope, attempts, available_at "
                            "FROM outbox_messages ORDER BY id"
                        ).fetchall()
                    entries = [build_entry(ClaimedRow("outbox_messages", *r)) for r in rows]
                    sent = [0]

                    def send_next(n: int) -> None:
                        chunk = entries[sent[0] : sent[0] + n]
                        for k in range(0, len(chunk), 10):
                            client.send_message_batch(
                                QueueUrl=url,
                                Entries=[
                                    {"Id": str(i), "MessageBody": e.body, "MessageAttributes": e.attributes}
                                    for i, e in enumerate(chunk[k : k + 10])
                                ],
                            )
                        sent[0] += len(chunk)

                    send_next(min(args.window, size))

                    def feeder(process: subprocess.Popen[str]) -> None:
                        """Keep <= window outstanding; end the child if moto lost messages.

                        moto's delete_message can lose a SendMessageBatch that lands during
                        it (see bench_pipeline.py); after 15 s without progress, runs still
                        untouched are counted lost and the child is told to report.
                        """
                        finished, moved_at = 0, time.monotonic()
                        with psycopg.connect(db.url, autocommit=True) as conn:
                            while process.poll() is None:
                                time.sleep(0.05)
                                row = conn.execute(
                                    "SELECT count(*) FILTER (WHERE status = 'succeeded'), "
                                    "count(*) FILTER (WHERE status = 'queued' AND attempts = 0) "
                                    "FROM task_runs"
                                ).fetchone()
                                now_finished, untouched = (int(row[0]), int(row[1])) if row else (0, 0)
                                if now_finished != finished:
                                    finished, moved_at = now_finished, time.monotonic()
                                room = args.window - (sent[0] - finished)
                                if sent[0] < size and room >= 10:
                                    send_next(min(room - room % 10, size - sent[0]))
                                elif sent[0] == size and time.monotonic() - moved_at > 15 and untouched:
                                    lost.append(untouched)
                                    process.send_signal(signal.SIGUSR1)
                                    return

                    argv = [
                        "--child",
                        "worker",
                        "--size",
                        str(size),
                        "--db-url",
                        db.sa_url,
                        "--catalog",
                        st.catalog_path,
                        "--endpoint",
                        server.endpoint,
                        "--prefix",
                        st.queue_prefix,
                    ]
                    return run_child(argv, feeder)

                sides[f"worker {args.worker_small:,}"] = lambda: worker(args.worker_small)
                sides[f"worker {args.worker_large:,}"] = lambda: worker(args.worker_large)
            measurements = common.alternate(args.rounds, sides, log=False)
        finally:
            if server is not None:
                server.stop()

    mb = 1024 * 1024
    rows = []
    peaks: dict[str, float] = {}
    for name, values in measurements.items():
        peak = common.median([v["peak"] for v in values]) / mb
        baseline = common.median([v["baseline"] for v in values]) / mb
        maxrss = common.median([v["ru_maxrss"] for v in values]) / mb
        elapsed = common.median([v["elapsed"] for v in values])
        peaks[name] = peak
        rows.append([name, baseline, peak, peak - baseline, maxrss, elapsed])
        print(f"  {name}: baseline {baseline:.1f} MB, peak {peak:.1f} MB", flush=True)
    report.table(
        f"Resident memory while draining (MB, median of {args.rounds})",
        ["component / backlog", "RSS before", "peak RSS", "growth", "ru_maxrss", "drain s"],
        rows,
    )
    report.results = {"measurements": measurements, "lost_in_moto": lost}
    if lost:
        report.note(f"messages moto lost (delete_message race), per affected drain: {lost}")
    small, large = f"relay {args.relay_small:,}", f"relay {args.relay_large:,}"
    report.ratio(
        "relay peak: large / small backlog", peaks[large] / peaks[small], 1.10, higher_is_better=False
    )
    if not args.no_worker:
        small, large = f"worker {args.worker_small:,}", f"worker {args.worker_large:,}"
        report.ratio(
            "worker peak: large / small backlog", peaks[large] / peaks[small], 1.10, higher_is_better=False
        )
    report.emit()


def argparse_hidden() -> str:
    import argparse

    return argparse.SUPPRESS


if __name__ == "__main__":
    main()
