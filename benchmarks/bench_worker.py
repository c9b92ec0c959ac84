"""Figure 6 — worker: no-op runs/s from a pre-filled queue vs a plain receive + delete loop.

Part A (moto server, SQS protocol). Before each side the queues are emptied (moto reset,
queues created again) and ``--messages`` real envelopes are sent to the ``default``
queue (not timed); each of them has its ``task_runs`` row (``queued``) in PostgreSQL.
Sides, once per round in rotating order:

``worker (sync)``
    :class:`~sqla_outbox.worker.consumer.Worker` ``.run()`` in a thread (default
    ``worker_concurrency`` 8, consuming only ``default``, 1 s long polls) with a no-op
    ``def`` handler: per message decode, take the run's lease (+ trail row), run the
    handler on its own thread, ``running → succeeded`` (+ trail) in the handler's
    session, DeleteMessage. Timed from start until the last DeleteMessage returned.
``worker (async)``
    the same with an ``async def`` no-op handler (runs on the worker's loop, its
    session on an async engine).

Both are timed from start until SQS confirmed the last deletion (counted at the client,
so one DeleteMessage per run and DeleteMessageBatch acknowledgements both count).
``plain loop``
    the floor: one thread, ``receive_message`` (10 per call) then ``delete_message``
    for each message, until all are deleted. No database.
``plain loop (batch delete)``
    the same with one ``delete_message_batch`` per receive: the floor if acks were
    batched.

Judged by: worker (sync) / plain loop >= 0.8.

Part B (database only, one thread, one connection). Per run, the worker's own SQL:
``take_lease`` (one statement: lock, ``running``, trail row) in one transaction, then
``mark_succeeded`` (one statement: ``succeeded``, trail row) in a second, as the worker
does, on an engine made by ``sqla_outbox.relay.make_engine`` (the worker's: it has
``pool_pre_ping=True``, so every checkout first runs a ping); the same on a plain engine
without pre-ping; the same without comparing the received envelope with the outbox row's
(``document=None``: the cost of that check); and a floor of two one-row
``UPDATE task_runs`` transactions per run without trail rows. ``--db-runs`` queued runs per side per round.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import _common as common
import psycopg


def main() -> None:
    p = common.parser(__doc__, rounds=5)
    p.add_argument("--messages", type=int, default=300, help="pre-filled messages per side (default 300)")
    p.add_argument("--concurrency", type=int, default=8, help="worker_concurrency (default 8)")
    p.add_argument("--db-runs", type=int, default=2000, help="runs per side in part B (default 2000)")
    p.add_argument("--no-async", action="store_true", help="skip the async-handler side")
    p.add_argument("--skip-sqs", action="store_true", help="only part B")
    p.add_argument("--skip-db", action="store_true", help="only part A")
    args = p.parse_args()

    from sqlalchemy.orm import Session

    from sqla_outbox.lifecycle import attempts
    from sqla_outbox.relay.claim import ClaimedRow
    from sqla_outbox.relay.send import build_entry
    from sqla_outbox.sqs.client import make_client
    from sqla_outbox.worker.consumer import Worker
    from sqla_outbox.worker.registry import Registry

    report = common.Report(
        "bench_worker",
        args,
        {
            "rounds": args.rounds,
            "messages": args.messages,
            "concurrency": args.concurrency,
            "db_runs": args.db_runs,
        },
    )
    sync_registry = Registry()
    sync_registry.task(common.TENANT_TASK, queue="default", scope="tenant")(lambda payload: None)
    async_registry = Registry()

    async def noop(payload: Any) -> None:
        return None

    async_registry.task(common.TENANT_TASK, queue="default", scope="tenant")(noop)

    with common.bench_database(args, "bench_worker") as db:
        results: dict[str, list[float]] = {}
        if not args.skip_sqs:
            with common.moto_server() as server:
                st = common.settings(
                    db,
                    None,
                    sqs_endpoint_url=server.endpoint,
                    worker_queues=("default",),
                    worker_wait_seconds=1,
                    worker_concurrency=args.concurrency,
                )
                client = make_client(st, max_pool_connections=30, read_timeout_seconds=20)
                plain_client = common.sqs_client(server.endpoint)

                def prefill() -> str:
                    url = common.fresh_queues(server.endpoint, client, st)["default"]
                    common.truncate_outbox(db.url)
                    common.fill_backlog(db.url, args.messages)
                    with psycopg.connect(db.url) as conn:
                        rows = conn.execute(
                            "SELECT id, run_id, queue, tenant_id, envelope, attempts, available_at "
                            "FROM outbox_messages ORDER BY id"
                        ).fetchall()
                    entries = [build_entry(ClaimedRow("outbox_messages", *r)) for r in rows]
                    for k in range(0, len(entries), 10):
                        chunk = entries[k : k + 10]
                        plain_client.send_message_batch(
                            QueueUrl=url,
                            Entries=[
                                {"Id": str(i), "MessageBody": e.body, "MessageAttributes": e.attributes}
                                for i, e in enumerate(chunk)
                            ],
                        )
                    if common.queue_depth(client, url) != args.messages:
                        raise RuntimeError("pre-fill incomplete")
                    return url

                worker_cpu: dict[bool, list[float]] = {}

                def worker_side(registry: Registry) -> float:
                    prefill()
                    counter = common.DeleteCounter(client, args.messages)
                    worker = Worker(
                        st, registry=registry, catalog=common.catalog(), client=counter, name="bench"
                    )
                    thread = threading.Thread(target=lambda: worker.run(handle_signals=False), daemon=True)
                    started = time.perf_counter()
                    cpu = time.process_time()  # this process: the worker's threads (moto runs apart)
                    thread.start()
                    if not counter.done.wait(300):
                        raise RuntimeError(
                            f"worker deleted {counter.deleted} of {args.messages} within 300 s"
                        )
                    elapsed = time.perf_counter() - started
                    worker_cpu.setdefault(registry is sync_registry, []).append(
                        (time.process_time() - cpu) / args.messages
                    )
                    worker.stop()
                    thread.join(60)
                    succeeded = common.count(
                        db.url, "SELECT count(*) FROM task_runs WHERE status = 'succeeded'"
                    )
                    if succeeded != args.messages or worker.counters.succeeded != args.messages:
                        raise RuntimeError(f"{succeeded} runs succeeded, expected {args.messages}")
                    return args.messages / elapsed

                plain_cpu: list[float] = []

                def plain_side(batch_delete: bool) -> float:
                    url = prefill()
                    deleted = 0
                    started = time.perf_counter()
                    cpu = time.process_time()
                    while deleted < args.messages:
                        messages = plain_client.receive_message(
                            QueueUrl=url, MaxNumberOfMessages=10, WaitTimeSeconds=1
                        ).get("Messages", [])
                        if batch_delete and messages:
                            plain_client.delete_message_batch(
                                QueueUrl=url,
                                Entries=[
                                    {"Id": str(i), "ReceiptHandle": m["ReceiptHandle"]}
                                    for i, m in enumerate(messages)
                                ],
                            )
                        else:
                            for m in messages:
                                plain_client.delete_message(QueueUrl=url, ReceiptHandle=m["ReceiptHandle"])
                        deleted += len(messages)
                    elapsed = time.perf_counter() - started
                    if not batch_delete:
                        plain_cpu.append((time.process_time() - cpu) / args.messages)
                    return args.messages / elapsed

                sides: dict[str, Any] = {"worker (sync)": lambda: worker_side(sync_registry)}
                if not args.no_async:
                    sides["worker (async)"] = lambda: worker_side(async_registry)
                sides["plain loop"] = lambda: plain_side(False)
                sides["plain loop (batch delete)"] = lambda: plain_side(True)
                print("part A: runs/s through moto", flush=True)
                results = common.alternate(args.rounds, sides)

        db_results: dict[str, list[float]] = {}
        if args.skip_db:
            args.db_runs = 0
        # --- part B: the worker's database work alone ---------------------------------------
        from sqla_outbox.relay import make_engine

        worker_engine = make_engine(common.settings(db, None), pool_size=1)  # what Worker uses
        bare_engine = common.one_connection_engine(db.url)

        def queued_runs() -> list[tuple[Any, str, int, str]]:
            common.truncate_outbox(db.url)
            common.fill_backlog(db.url, args.db_runs)
            with psycopg.connect(db.url) as conn:
                return conn.execute(
                    "SELECT r.run_id, r.task, r.tenant_id, COALESCE(o.envelope, p.envelope)::text "
                    "FROM task_runs r LEFT JOIN outbox_messages o USING (run_id) "
                    "LEFT JOIN platform_outbox_messages p USING (run_id)"
                ).fetchall()

        def worker_db(engine: Any, check_envelope: bool = True) -> float:
            todo = queued_runs()
            started = time.perf_counter()
            for run_id, task, tenant_id, document in todo:
                with engine.begin() as conn:
                    claim = attempts.take_lease(
                        conn,
                        run_id=run_id,
                        task=task,
                        tenant_id=tenant_id,
                        worker_id="bench",
                        lease_seconds=120,
                        receive_count=1,
                        document=document if check_envelope else None,
                    )
                    if claim.status is not attempts.ClaimStatus.CLAIMED:
                        raise RuntimeError(f"take_lease: {claim.status}")
                with Session(engine) as session:
                    if not attempts.mark_succeeded(
                        session.connection(), attempts.Attempt(run_id, claim.attempt, 1, "bench")
                    ):
                        raise RuntimeError("mark_succeeded matched nothing")
                    session.commit()
            return len(todo) / (time.perf_counter() - started)

        def floor_db() -> float:
            todo = queued_runs()
            with psycopg.connect(db.url) as conn:
                started = time.perf_counter()
                for run_id, _task, _tenant, _document in todo:
                    with conn.transaction():
                        conn.execute(
                            "UPDATE task_runs SET status = 'running', attempts = attempts + 1 "
                            "WHERE run_id = %s",
                            (run_id,),
                        )
                    with conn.transaction():
                        conn.execute("UPDATE task_runs SET status = 'succeeded' WHERE run_id = %s", (run_id,))
                return len(todo) / (time.perf_counter() - started)

        print("part B: the worker's SQL alone, runs/s", flush=True)
        db_results = (
            {}
            if args.skip_db
            else common.alternate(
                args.rounds,
                {
                    "take_lease + mark_succeeded": lambda: worker_db(worker_engine),
                    "the same, no pool pre-ping": lambda: worker_db(bare_engine),
                    "the same, no envelope check": lambda: worker_db(worker_engine, check_envelope=False),
                    "floor: 2 bare UPDATE txns": floor_db,
                },
            )
        )
        worker_engine.dispose()
        bare_engine.dispose()

    if results:
        med = {n: common.median(v) for n, v in results.items()}
        report.table(
            f"Part A: no-op runs/s from a pre-filled queue of {args.messages} "
            f"(moto; median of {args.rounds})",
            ["side", "runs/s (median)", "min", "max", "vs plain loop", "ms/run"],
            [
                [n, med[n], min(v), max(v), common.paired_ratio(results, n, "plain loop"), 1000 / med[n]]
                for n, v in results.items()
            ],
        )
        report.ratio(
            "worker (sync) / plain receive+delete",
            common.paired_ratio(results, "worker (sync)", "plain loop"),
            0.8,
        )
        if "worker (async)" in med:
            report.ratio(
                "worker (async) / plain receive+delete",
                common.paired_ratio(results, "worker (async)", "plain loop"),
                0.8,
            )
        report.results["sqs_runs_per_s"] = results
        report.results["worker_cpu_ms_per_run"] = {
            ("sync" if sync else "async"): [1000 * v for v in values] for sync, values in worker_cpu.items()
        }
        report.ratio(
            "worker (sync): process CPU per run, ms (boto3 included, moto apart)",
            1000 * common.median(worker_cpu[True]),
            2.0,
            higher_is_better=False,
        )
        report.results["plain_client_cpu_ms_per_message"] = 1000 * common.median(plain_cpu)
        report.note(
            "boto3 client CPU per message in the plain loop (1/10 receive + 1 delete): "
            f"{1000 * common.median(plain_cpu):.2f} ms"
        )
    if not db_results:
        report.emit()
        return
    dmed = {n: common.median(v) for n, v in db_results.items()}
    report.table(
        f"Part B: the worker's database work per run ({args.db_runs} runs; median of {args.rounds})",
        ["side", "runs/s (median)", "min", "max", "vs floor", "ms/run"],
        [
            [
                n,
                dmed[n],
                min(v),
                max(v),
                common.paired_ratio(db_results, n, "floor: 2 bare UPDATE txns"),
                1000 / dmed[n],
            ]
            for n, v in db_results.items()
        ],
    )
    report.ratio(
        "worker DB work / bare 2-UPDATE floor",
        common.paired_ratio(db_results, "take_lease + mark_succeeded", "floor: 2 bare UPDATE txns"),
        None,
    )
    report.results["db_runs_per_s"] = db_results
    report.emit()


if __name__ == "__main__":
    main()
