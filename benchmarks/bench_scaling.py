"""Section 8 input — how relay and worker throughput scale with concurrency at SQS-like latency.

moto answers in about a millisecond and is CPU-bound itself, so it cannot show what
concurrency buys against real SQS, whose calls take tens of milliseconds (the AWS
guide's own example: 20 ms average from EC2 in the same region, hence "50 TPS from a
single thread over a single connection"). This script replaces the boto3 client by an
in-memory fake that sleeps ``--latency-ms`` per call (the sleep releases the GIL, as
network I/O does) and otherwise does nothing, and drives the real relay and worker code
against the real PostgreSQL. boto3's own CPU per call is not included here; it is
measured through moto by ``bench_relay_sqs.py`` and ``bench_worker.py``.

``relay``
    ``Relay.run()`` with the real ``SqsSender`` on the fake client, draining
    ``--relay-rows`` rows, for each ``relay_batch_size`` x ``relay_send_concurrency``
    in ``--relay-grid``. rows/s.
``relays``
    1, 2, 3 (``--relays``) relay *processes* at once (``benchmarks/_relay_process.py``: the
    real ``Relay.run()``, each with a fake SQS of its own, as real SQS scales out), on one
    database with ``relay_partitions`` = ``--partitions`` (12 splits evenly over 1, 2 and 3):
    a backlog of ``--relays-rows`` rows over 240 tenants is made due in one statement once
    the relays have split the partitions, and timed until every row is sent. rows/s.
``worker``
    ``Worker.run()`` (sync no-op handler) on the fake client, draining ``--worker-runs``
    pre-filled messages (their ``task_runs`` rows queued in PostgreSQL), for each
    ``worker_concurrency`` in ``--worker-concurrency``. runs/s, and the process CPU per run.

Each configuration runs ``--rounds`` times (configurations alternate); medians reported.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import _common as common
import psycopg


class FakeSqs:
    """Just enough of the boto3 SQS client for the relay and the worker, with latency."""

    def __init__(self, latency_s: float) -> None:
        self.latency_s = latency_s
        self.messages: list[dict[str, Any]] = []
        self.cond = threading.Condition()
        self.calls = 0
        self.sent = 0
        self.deleted = 0

    def _call(self) -> None:
        with self.cond:
            self.calls += 1
        time.sleep(self.latency_s)

    def get_queue_url(self, QueueName: str) -> dict[str, str]:
        return {"QueueUrl": f"https://sqs.fake/{QueueName}"}

    def get_queue_attributes(self, QueueUrl: str, AttributeNames: list[str]) -> dict[str, Any]:
        return {"Attributes": {"VisibilityTimeout": "120"}}

    def send_message_batch(self, QueueUrl: str, Entries: list[dict[str, Any]]) -> dict[str, Any]:
        self._call()
        with self.cond:
            self.sent += len(Entries)
        return {
            "Successful": [{"Id": e["Id"], "MessageId": str(uuid.uuid4())} for e in Entries],
            "Failed": [],
        }

    def put(self, body: str, attributes: dict[str, Any]) -> None:
        with self.cond:
            handle = uuid.uuid4().hex
            self.messages.append(
                {
                    "MessageId": handle,
                    "ReceiptHandle": handle,
                    "Body": body,
                    "Attributes": {"ApproximateReceiveCount": "1", "SentTimestamp": "0"},
                    "MessageAttributes": attributes,
                }
            )
            self.cond.notify_all()

    def receive_message(
        self, QueueUrl: str, MaxNumberOfMessages: int = 1, WaitTimeSeconds: int = 0, **_: Any
    ) -> Any:
        self._call()
        deadline = time.monotonic() + WaitTimeSeconds
        with self.cond:
            while not self.messages and time.monotonic() < deadline:
                self.cond.wait(deadline - time.monotonic())
            taken, self.messages = self.messages[:MaxNumberOfMessages], self.messages[MaxNumberOfMessages:]
        return {"Messages": taken} if taken else {}

    def delete_message(self, QueueUrl: str, ReceiptHandle: str) -> dict[str, Any]:
        self._call()
        with self.cond:
            self.deleted += 1
        return {}

    def delete_message_batch(self, QueueUrl: str, Entries: list[dict[str, Any]]) -> dict[str, Any]:
        self._call()
        with self.cond:
            self.deleted += len(Entries)
        return {"Successful": [{"Id": e["Id"]} for e in Entries], "Failed": []}

    def change_message_visibility(self, **_: Any) -> dict[str, Any]:
        self._call()
        return {}

    def change_message_visibility_batch(self, QueueUrl: str, Entries: list[Any]) -> dict[str, Any]:
        self._call()
        return {"Successful": [{"Id": e["Id"]} for e in Entries], "Failed": []}

    def send_message(self, **_: Any) -> dict[str, Any]:
        self._call()
        return {"MessageId": str(uuid.uuid4())}


def _grid(text: str) -> list[tuple[int, int]]:
    out = []
    for item in filter(None, text.split(",")):  # "" measures no relay configuration
        batch, _, conc = item.partition("x")
        out.append((int(batch), int(conc)))
    return out


def main() -> None:
    p = common.parser(__doc__, rounds=2)
    p.add_argument("--latency-ms", type=float, default=20.0, help="fake SQS latency per call (default 20)")
    p.add_argument("--relay-rows", type=int, default=10_000, help="backlog per relay configuration")
    p.add_argument(
        "--relay-grid",
        default="100x1,100x4,100x10,500x16,500x50",
        help="relay_batch_size x relay_send_concurrency pairs (default 100x1,100x4,100x10,500x16,500x50)",
    )
    p.add_argument("--relays", default="1,2,3", help="relay process counts (default 1,2,3; '' for none)")
    p.add_argument("--relays-rows", type=int, default=9000, help="backlog per relay-process count")
    p.add_argument("--partitions", type=int, default=12, help="relay_partitions for --relays (default 12)")
    p.add_argument("--worker-runs", type=int, default=600, help="messages per worker configuration")
    p.add_argument(
        "--worker-concurrency", default="1,8,32", help="worker_concurrency values (default 1,8,32)"
    )
    args = p.parse_args()

    from sqla_outbox.relay import Relay
    from sqla_outbox.relay.claim import ClaimedRow
    from sqla_outbox.relay.send import SqsSender, build_entry
    from sqla_outbox.sqs.client import QueueDirectory
    from sqla_outbox.worker.consumer import Worker
    from sqla_outbox.worker.registry import Registry

    latency = args.latency_ms / 1000
    grid = _grid(args.relay_grid)
    concurrencies = [int(x) for x in args.worker_concurrency.split(",") if x]
    relay_counts = [int(x) for x in args.relays.split(",") if x]
    report = common.Report(
        "bench_scaling",
        args,
        {
            "rounds": args.rounds,
            "latency_ms": args.latency_ms,
            "relay_rows": args.relay_rows,
            "relay_grid": args.relay_grid,
            "worker_runs": args.worker_runs,
            "worker_concurrency": concurrencies,
            "relays": relay_counts,
            "relays_rows": args.relays_rows,
            "partitions": args.partitions,
        },
    )
    registry = Registry()
    registry.task(common.TENANT_TASK, queue="default", scope="tenant")(lambda payload: None)
    cpu: dict[str, list[float]] = {}
    with common.bench_database(args, "bench_scaling") as db:
        base = common.settings(db, None, relay_sweep_interval_seconds=5.0)

        def relay_side(batch: int, concurrency: int) -> float:
            common.truncate_outbox(db.url)
            common.fill_backlog(db.url, args.relay_rows)
            st = base.replace(relay_batch_size=batch, relay_send_concurrency=concurrency)
            client = FakeSqs(latency)
            sender = common.CountingSender(SqsSender(client, QueueDirectory(client, st), st), args.relay_rows)
            engine = common.one_connection_engine(db.url)
            relay = Relay(st, sender=sender, engine=engine, name="bench")
            started = time.perf_counter()
            cpu0 = time.process_time()
            relay.start_in_thread()
            if not sender.done.wait(600):
                raise RuntimeError("relay did not drain")
            elapsed = time.perf_counter() - started
            cpu.setdefault(f"relay b{batch} c{concurrency}", []).append(
                (time.process_time() - cpu0) / args.relay_rows
            )
            relay.stop()
            relay.join(30)
            engine.dispose()
            return args.relay_rows / elapsed

        def worker_side(concurrency: int) -> float:
            common.truncate_outbox(db.url)
            common.fill_backlog(db.url, args.worker_runs)
            with psycopg.connect(db.url) as conn:
                rows = conn.execute(
                    "SELECT id, run_id, queue, tenant_id, envelope, attempts, available_at "
                    "FROM outbox_messages ORDER BY id"
                ).fetchall()
            client = FakeSqs(latency)
            for r in rows:
                entry = build_entry(ClaimedRow("outbox_messages", *r))
                client.put(entry.body, entry.attributes)
            st = base.replace(
                worker_queues=("default",), worker_wait_seconds=1, worker_concurrency=concurrency
            )
            worker = Worker(st, registry=registry, catalog=common.catalog(), client=client, name="bench")
            thread = threading.Thread(target=lambda: worker.run(handle_signals=False), daemon=True)
            started = time.perf_counter()
            cpu0 = time.process_time()
            thread.start()
            deadline = time.monotonic() + 600
            while client.deleted < args.worker_runs:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"worker deleted {client.deleted} of {args.worker_runs}")
                time.sleep(0.01)
            elapsed = time.perf_counter() - started
            cpu.setdefault(f"worker c{concurrency}", []).append(
                (time.process_time() - cpu0) / args.worker_runs
            )
            worker.stop()
            thread.join(60)
            return args.worker_runs / elapsed

        def relays_side(count: int) -> float:
            common.truncate_outbox(db.url)
            common.fill_backlog(db.url, args.relays_rows, tenants=240)
            with psycopg.connect(db.url, autocommit=True) as conn:  # not due until the split is done
                conn.execute(
                    "UPDATE outbox_messages SET available_at = clock_timestamp() + interval '1 hour'"
                )
            env = {k: v for k, v in os.environ.items() if not k.startswith("SQLA_OUTBOX_")}
            env.update(
                {
                    "SQLA_OUTBOX_DATABASE_URL": db.sa_url,
                    "SQLA_OUTBOX_VALKEY_URL": "none",
                    "SQLA_OUTBOX_WAKE_MODE": "none",
                    "SQLA_OUTBOX_QUEUE_PREFIX": base.queue_prefix,
                    "SQLA_OUTBOX_CATALOG_PATH": base.catalog_path,
                    "SQLA_OUTBOX_RELAY_PARTITIONS": str(args.partitions),
                    "SQLA_OUTBOX_RELAY_STANDBY_POLL_SECONDS": "0.2",
                    "SQLA_OUTBOX_RELAY_HOLD_UNSERVED": "false",
                    "SQLA_OUTBOX_RELAY_SCHEDULER": "false",
                }
            )
            script = Path(__file__).resolve().parent / "_relay_process.py"
            procs = [
                subprocess.Popen(
                    [sys.executable, str(script), "--latency-ms", str(args.latency_ms), "--name", f"r{n}"],
                    env=env,
                    stdout=subprocess.DEVNULL,
                )
                for n in range(count)
            ]
            try:
                share = args.partitions // count
                deadline = time.monotonic() + 120
                with psycopg.connect(db.url, autocommit=True) as conn:
                    while True:  # every relay owns its share of the partitions
                        owners = conn.execute(
                            "SELECT pid, count(*) FROM pg_locks WHERE locktype = 'advisory' AND granted "
                            "AND objsubid = 2 AND objid < 1048576 GROUP BY pid"
                        ).fetchall()
                        if len(owners) == count and all(n >= share for _, n in owners):
                            break
                        if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
                            raise RuntimeError(f"relays did not split the partitions: {owners}")
                        time.sleep(0.05)
                    started = time.perf_counter()
                    conn.execute(
                        "UPDATE outbox_messages SET available_at = clock_timestamp() - interval '1 second'"
                    )
                    while conn.execute(
                        "SELECT count(*) FROM outbox_messages WHERE sent_at IS NULL"
                    ).fetchone()[0]:
                        if time.monotonic() > deadline + 600:
                            raise RuntimeError("relays did not drain")
                        time.sleep(0.02)
                    elapsed = time.perf_counter() - started
            finally:
                for proc in procs:
                    proc.terminate()
                for proc in procs:
                    proc.wait(60)
            return args.relays_rows / elapsed

        sides: dict[str, Any] = {}
        for count in relay_counts:
            sides[f"relays x{count}"] = lambda c=count: relays_side(c)
        for batch, conc in grid:
            sides[f"relay b{batch} c{conc}"] = lambda b=batch, c=conc: relay_side(b, c)
        for conc in concurrencies:
            sides[f"worker c{conc}"] = lambda c=conc: worker_side(c)
        results = common.alternate(args.rounds, sides)

    med = {n: common.median(v) for n, v in results.items()}
    rows = []
    for n, v in results.items():
        rows.append([n, med[n], min(v), max(v), 1000 * common.median(cpu[n]) if n in cpu else None])
    report.table(
        f"Throughput with a fake SQS of {args.latency_ms:g} ms per call (median of {args.rounds})",
        ["configuration", "per s (median)", "min", "max", "process CPU ms per row/run"],
        rows,
    )
    report.results = {"per_s": results, "medians": med, "cpu_s_per_item": cpu}
    first_relay = f"relay b{grid[0][0]} c{grid[0][1]}" if grid else ""
    for batch, conc in grid[1:]:
        name = f"relay b{batch} c{conc}"
        report.ratio(f"{name} / {first_relay}", common.paired_ratio(results, name, first_relay), None)
    for conc in concurrencies:
        name = f"worker c{conc}"
        report.ratio(f"{name}: process CPU per run, ms (fake SQS)", 1000 * common.median(cpu[name]), None)
    for count in relay_counts[1:]:
        name, first = f"relays x{count}", f"relays x{relay_counts[0]}"
        target = 2.5 if (count, relay_counts[0]) == (3, 1) else None  # the scale-out issue's target
        report.ratio(
            f"{name} / {first} (processes, one database)", common.paired_ratio(results, name, first), target
        )
    first_worker = f"worker c{concurrencies[0]}" if concurrencies else ""
    for conc in concurrencies[1:]:
        name = f"worker c{conc}"
        report.ratio(f"{name} / {first_worker}", common.paired_ratio(results, name, first_worker), None)
    report.emit()


if __name__ == "__main__":
    main()
