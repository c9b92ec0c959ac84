"""Figure 4 — relay drain, database side: rows/s of a backlog, vs a raw SKIP LOCKED loop.

Each side starts from a fresh backlog of ``--rows`` due rows in ``outbox_messages`` (plus
their ``task_runs`` rows), written set-based and VACUUM ANALYZEd before timing. Sides,
each once per round in rotating order:

``relay``
    :class:`~sqla_outbox.relay.Relay` ``.run()`` in a thread with an accept-everything
    sender (benchmark-only: SQS replaced by ``return everything sent``), from start
    until the sender has seen every row. One pass = claim up to ``relay_batch_size``
    rows per outbox table, "send", mark ``sent_at``, commit; a full pass starts the next
    one at once.
``relay+encode``
    the same, but the sender also builds each SQS entry (JSON body, message
    attributes, size) as ``SqsSender`` does, to show the CPU cost of message building.
``raw loop``
    the floor: one psycopg connection; per batch ``BEGIN; SELECT <same columns> ...
    WHERE sent_at IS NULL AND available_at <= clock_timestamp() ORDER BY available_at, id
    LIMIT <batch> FOR UPDATE SKIP LOCKED; UPDATE ... SET sent_at = clock_timestamp()
    WHERE id = ANY(...); COMMIT`` until nothing is left; same batch size, same database.
``pgqueuer bN``
    pgqueuer's burn-down: ``--pgq-jobs`` no-op jobs enqueued in bulk (not timed), then a
    QueueManager in drain mode (``batch_size=N``, asyncpg) until the queue is empty.
    Its jobs are executed and completed (logged), not just marked; that is its design.

Judged by: relay / raw loop >= 0.7, and relay above every pgqueuer figure.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import _common as common
import psycopg

_RAW_CLAIM = """
SELECT id, run_id, queue, tenant_id, envelope, attempts, available_at
FROM outbox_messages
WHERE sent_at IS NULL AND available_at <= clock_timestamp()
ORDER BY available_at, id
LIMIT %(limit)s
FOR UPDATE SKIP LOCKED
"""
_RAW_MARK = "UPDATE outbox_messages SET sent_at = clock_timestamp() WHERE id = ANY(%(ids)s)"


def main() -> None:
    p = common.parser(__doc__, rounds=3)
    p.add_argument("--rows", type=int, default=100_000, help="backlog rows (default 100,000)")
    p.add_argument("--batch", type=int, default=100, help="relay_batch_size and raw batch (default 100)")
    p.add_argument("--pgq-jobs", type=int, default=100_000, help="pgqueuer backlog (default 100,000)")
    p.add_argument(
        "--pgq-batch",
        type=int,
        action="append",
        help="pgqueuer batch_size; repeat for several (default 10 (its default) and 100)",
    )
    p.add_argument("--no-encode", action="store_true", help="skip the relay+encode side")
    p.add_argument("--no-peers", action="store_true", help="skip pgqueuer")
    args = p.parse_args()
    pgq_batches = args.pgq_batch or [10, 100]

    from sqla_outbox.relay import Relay

    report = common.Report(
        "bench_relay_drain",
        args,
        {"rounds": args.rounds, "rows": args.rows, "batch": args.batch, "pgq_jobs": args.pgq_jobs},
    )
    with common.bench_database(args, "bench_relay_drain") as db:
        st = common.settings(db, None, relay_batch_size=args.batch, relay_sweep_interval_seconds=5.0)

        def fresh() -> None:
            common.truncate_outbox(db.url)
            common.fill_backlog(db.url, args.rows)

        def relay_side(encode: bool) -> float:
            fresh()
            sender = common.AcceptAllSender(target=args.rows, encode=encode)
            engine = common.one_connection_engine(db.url)
            relay = Relay(st, sender=sender, engine=engine, name="bench")
            started = time.perf_counter()
            relay.start_in_thread()
            if not sender.done.wait(600):
                raise RuntimeError("relay did not drain within 600 s")
            elapsed = time.perf_counter() - started
            relay.stop()
            relay.join(30)
            engine.dispose()
            left = common.count(db.url, "SELECT count(*) FROM outbox_messages WHERE sent_at IS NULL")
            if left:
                raise RuntimeError(f"{left} rows left unsent")
            return args.rows / elapsed

        def raw_side() -> float:
            fresh()
            done = 0
            with psycopg.connect(db.url) as conn:
                started = time.perf_counter()
                while True:
                    with conn.transaction():
                        rows = conn.execute(_RAW_CLAIM, {"limit": args.batch}).fetchall()
                        if not rows:
                            break
                        conn.execute(_RAW_MARK, {"ids": [r[0] for r in rows]})
                    done += len(rows)
                elapsed = time.perf_counter() - started
            if done != args.rows:
                raise RuntimeError(f"raw loop marked {done} of {args.rows}")
            return done / elapsed

        sides: dict[str, Any] = {"relay": lambda: relay_side(False)}
        if not args.no_encode:
            sides["relay+encode"] = lambda: relay_side(True)
        sides["raw loop"] = raw_side
        if not args.no_peers:
            import _peers

            _peers.install_pgqueuer(db.url)

            def pgq_side(batch: int) -> float:
                with psycopg.connect(db.url, autocommit=True) as conn:
                    conn.execute("TRUNCATE pgqueuer, pgqueuer_log")
                _peers.pgqueuer_enqueue(db.url, args.pgq_jobs)
                common.vacuum(db.url, "pgqueuer")
                worker = _peers.PgqWorker(db.url, batch_size=batch, drain=True)
                result: dict[str, float] = {}

                def run() -> None:
                    result["elapsed"] = worker.run_here()

                thread = threading.Thread(target=run)
                thread.start()
                thread.join(900)
                left = common.count(db.url, "SELECT count(*) FROM pgqueuer")
                if left or worker.jobs != args.pgq_jobs:
                    raise RuntimeError(f"pgqueuer ran {worker.jobs} jobs, {left} left")
                return args.pgq_jobs / result["elapsed"]

            for b in pgq_batches:
                sides[f"pgqueuer b{b}"] = lambda b=b: pgq_side(b)

        results = common.alternate(args.rounds, sides)

    med = {name: common.median(values) for name, values in results.items()}
    report.table(
        f"Drain rate, rows/s (median of {args.rounds}; relay/raw backlog {args.rows:,}, "
        f"batch {args.batch}; pgqueuer backlog {args.pgq_jobs:,})",
        ["side", "rows/s (median)", "min", "max", "vs raw loop", "µs/row"],
        [
            [n, med[n], min(v), max(v), common.paired_ratio(results, n, "raw loop"), 1e6 / med[n]]
            for n, v in results.items()
        ],
    )
    report.results = {"rows_per_s": results, "medians": med}
    report.ratio("relay / raw loop", common.paired_ratio(results, "relay", "raw loop"), 0.7)
    pgq = [v for n, v in med.items() if n.startswith("pgqueuer")]
    if pgq:
        report.ratio("relay / best pgqueuer", med["relay"] / max(pgq), 1.0)
    if "relay+encode" in med:
        report.ratio(
            "relay+encode / raw loop", common.paired_ratio(results, "relay+encode", "raw loop"), None
        )
    report.emit()


if __name__ == "__main__":
    main()
