"""Flow-control overhead: worker throughput and relay drain with limits and a breaker configured, not hit.

Part A (worker, moto server, SQS protocol; as ``bench_worker.py`` part A). Before each
side the queues are emptied and ``--messages`` real envelopes are sent to ``default``
(not timed), each with its ``task_runs`` row. Sides, once per round in rotating order:

``no limits``
    :class:`~sqla_outbox.worker.consumer.Worker` (``worker_concurrency`` 8) with a no-op
    handler for ``bench_tenant`` declared plainly.
``limits (Valkey)``
    the same task declared with ``rate_limit="1000000/m"``, ``concurrency=1000`` and
    ``breaker="bench-api"``: none of them is ever hit, but every run goes through the
    admission gate (one Lua script on Valkey before the lease, one after the verdict).
``limits (Valkey down)``
    the same with ``valkey_url`` on a port where nothing listens: after the first refused
    connection the gate limits per process for ``limits_valkey_retry_seconds`` (what a
    Valkey outage costs).

Part B (relay, database side; as ``bench_relay_drain.py``): a backlog of ``--rows`` due
rows drained by :class:`~sqla_outbox.relay.Relay` with an accept-everything sender, with
and without the ``limits_*`` settings. The relay never consults per-task limits (they are
enforced where runs start, in the worker), so this shows that declaring them costs the
relay nothing, not a code path of its own.

Part C (the gate alone, one thread, no SQS or database): ``--gate-runs`` admit + release
pairs for the limited task against Valkey, and against the per-process fallback: the
cost per run that part A's ratio hides in the noise of a shared machine (moto's CPU per
message dwarfs it).

Judged by: each "limits" side / "no limits" >= 0.9 (issue 13).
"""

from __future__ import annotations

import threading
import time
from typing import Any

import _common as common
import psycopg


def main() -> None:
    p = common.parser(__doc__, rounds=3)
    p.add_argument(
        "--messages", type=int, default=300, help="pre-filled messages per worker side (default 300)"
    )
    p.add_argument("--rows", type=int, default=20_000, help="relay backlog rows (default 20,000)")
    p.add_argument("--gate-runs", type=int, default=2000, help="admit+release pairs in part C (default 2000)")
    args = p.parse_args()

    from sqla_outbox.relay import Relay
    from sqla_outbox.relay.claim import ClaimedRow
    from sqla_outbox.relay.send import build_entry
    from sqla_outbox.sqs.client import make_client
    from sqla_outbox.worker.consumer import Worker
    from sqla_outbox.worker.registry import Registry

    report = common.Report(
        "bench_limits_overhead",
        args,
        {"rounds": args.rounds, "messages": args.messages, "rows": args.rows},
    )
    plain = Registry()
    plain.task(common.TENANT_TASK, queue="default", scope="tenant")(lambda payload: None)
    limited = Registry()
    limited.task(
        common.TENANT_TASK,
        queue="default",
        scope="tenant",
        rate_limit="1000000/m",
        concurrency=1000,
        breaker="bench-api",
    )(lambda payload: None)

    with common.bench_database(args, "bench_limits_overhead") as db:
        with common.moto_server() as server:
            base = common.settings(
                db,
                args.redis_url,
                sqs_endpoint_url=server.endpoint,
                worker_queues=("default",),
                worker_wait_seconds=1,
                wake_mode="none",
            )
            client = make_client(base, max_pool_connections=30, read_timeout_seconds=20)
            plain_client = common.sqs_client(server.endpoint)

            def prefill() -> None:
                url = common.fresh_queues(server.endpoint, client, base)["default"]
                common.truncate_outbox(db.url)
                common.fill_backlog(db.url, args.messages)
                with psycopg.connect(db.url) as conn:
                    rows = conn.execute(
                        "SELECT id, run_id, queue, tenant_id, envelope, attempts, available_at "
                        "FROM outbox_messages ORDER BY id"
                    ).fetchall()
                entries = [build_entry(ClaimedRow("outbox_messages", *r)) for r in rows]
                for k in range(0, len(entries), 10):
                    plain_client.send_message_batch(
                        QueueUrl=url,
                        Entries=[
                            {"Id": str(i), "MessageBody": e.body, "MessageAttributes": e.attributes}
                            for i, e in enumerate(entries[k : k + 10])
                        ],
                    )
                if common.queue_depth(client, url) != args.messages:
                    raise RuntimeError("pre-fill incomplete")

            def worker_side(registry: Registry, valkey_url: str | None) -> float:
                prefill()
                counter = common.DeleteCounter(client, args.messages)
                settings = base.replace(valkey_url=valkey_url)
                worker = Worker(
                    settings, registry=registry, catalog=common.catalog(), client=counter, name="bench"
                )
                thread = threading.Thread(target=lambda: worker.run(handle_signals=False), daemon=True)
                started = time.perf_counter()
                thread.start()
                if not counter.done.wait(300):
                    raise RuntimeError(f"worker deleted {counter.deleted} of {args.messages} within 300 s")
                elapsed = time.perf_counter() - started
                worker.stop()
                thread.join(60)
                if worker.counters.succeeded != args.messages or worker.counters.deferred:
                    raise RuntimeError(
                        f"{worker.counters.succeeded} succeeded, {worker.counters.deferred} deferred: "
                        "a limit was hit"
                    )
                return args.messages / elapsed

            refused = f"redis://127.0.0.1:{_free_port()}/0"
            print("part A: worker runs/s through moto", flush=True)
            worker_results = common.alternate(
                args.rounds,
                {
                    "no limits": lambda: worker_side(plain, args.redis_url),
                    "limits (Valkey)": lambda: worker_side(limited, args.redis_url),
                    "limits (Valkey down)": lambda: worker_side(limited, refused),
                },
            )

        relay_settings = common.settings(db, None, relay_sweep_interval_seconds=5.0)

        def relay_side(settings: Any) -> float:
            common.truncate_outbox(db.url)
            common.fill_backlog(db.url, args.rows)
            sender = common.AcceptAllSender(target=args.rows, encode=True)
            engine = common.one_connection_engine(db.url)
            relay = Relay(settings, sender=sender, engine=engine, name="bench")
            started = time.perf_counter()
            relay.start_in_thread()
            if not sender.done.wait(600):
                raise RuntimeError("relay did not drain within 600 s")
            elapsed = time.perf_counter() - started
            relay.stop()
            relay.join(30)
            engine.dispose()
            return args.rows / elapsed

        print("part B: relay drain rows/s", flush=True)
        relay_results = common.alternate(
            args.rounds,
            {
                "relay": lambda: relay_side(relay_settings),
                "relay, limits settings": lambda: relay_side(
                    relay_settings.replace(limits_slot_lease_seconds=5, limits_throttle_delay_seconds=0.5)
                ),
            },
        )

    import uuid

    from sqla_outbox.worker.gate import Gate

    definition = limited.tasks[common.TENANT_TASK]

    def gate_side(valkey_url: str | None) -> float:
        gate = Gate(base.replace(valkey_url=valkey_url), breakers=limited.breakers, worker_id="bench")
        run_id = uuid.uuid4()
        started = time.perf_counter()
        for _ in range(args.gate_runs):
            verdict = gate.admit(common.TENANT_TASK, definition.limits, run_id)
            if verdict.admission is None:
                raise RuntimeError(f"gate refused: {verdict.reason}")
            gate.release(verdict.admission, "success")
        elapsed = time.perf_counter() - started
        gate.close()
        return 1000 * elapsed / args.gate_runs

    print("part C: ms per admit + release", flush=True)
    gate_results = common.alternate(
        args.rounds,
        {"gate (Valkey)": lambda: gate_side(args.redis_url), "gate (per process)": lambda: gate_side(None)},
    )
    report.table(
        f"Part C: the gate alone, ms per run (admit + release; {args.gate_runs} per side; "
        f"median of {args.rounds})",
        ["side", "ms/run (median)", "min", "max"],
        [[n, common.median(v), min(v), max(v)] for n, v in gate_results.items()],
    )
    report.results["gate_ms_per_run"] = gate_results

    for title, results, baseline in (
        (
            f"Part A: worker no-op runs/s, {args.messages} pre-filled (moto; median of {args.rounds})",
            worker_results,
            "no limits",
        ),
        (
            f"Part B: relay drain rows/s, {args.rows} rows (accept-all sender; median of {args.rounds})",
            relay_results,
            "relay",
        ),
    ):
        med = {n: common.median(v) for n, v in results.items()}
        report.table(
            title,
            ["side", "per s (median)", "min", "max", f"vs {baseline}"],
            [
                [n, med[n], min(v), max(v), common.paired_ratio(results, n, baseline)]
                for n, v in results.items()
            ],
        )
    for side in ("limits (Valkey)", "limits (Valkey down)"):
        report.ratio(
            f"worker {side} / no limits", common.paired_ratio(worker_results, side, "no limits"), 0.9
        )
    report.ratio(
        "relay with limits settings / without",
        common.paired_ratio(relay_results, "relay, limits settings", "relay"),
        0.9,
    )
    report.results["worker_runs_per_s"] = worker_results
    report.results["relay_rows_per_s"] = relay_results
    report.emit()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


if __name__ == "__main__":
    main()
