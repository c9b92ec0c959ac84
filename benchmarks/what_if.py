"""What-if: the changes issue 8's findings recommended, measured before they existed.

The findings (D1-W4) are in ``docs/benchmarks.md`` at commit bc6b34f; most have landed since.

Each experiment monkeypatches ONE instance (never the library's files) with the change
a finding recommends and runs it beside the unchanged library in the same run,
alternating, several rounds; ratios are medians of per-round ratios. Once a change is
adopted, the matching ``bench_*.py`` script measures the real thing and the experiment
can go. The patches reach into internals (``Installation._write_deferred``,
``Waker.wake``, ``relay.claim.claim``, ``Outcomes.ack``); an experiment whose internals
moved reports that and is skipped.

``dispatch``  (findings D1, D2; figure 1)
    ``current`` vs ``fastpath`` (one run per flush written by a scalar-parameter CTE that
    names its outbox table, instead of the 9-array ``unnest`` statement) vs
    ``fastpath+ffwake`` (plus a wake that sends a pre-encoded LPUSH+LTRIM and reads the
    replies at the next wake instead of waiting for them) vs ``fastpath+nowake``, beside
    ``orm`` and ``procrastinate``. Single-row transactions, one connection. On a library
    that already writes single runs with a scalar statement and wakes from its own thread
    (fde225d, 0923fc1): ``current`` vs ``current+prepacked`` (that thread sends the
    pre-encoded commands) vs ``current+ffwake`` (the committing thread sends them, no
    wait, no thread) vs ``current+nowake``.
``relay``  (finding R1; figure 4)
    ``Relay.run()`` draining a backlog with the claim reading rows by ``fetchone`` one at
    a time (current: iterating the Result) vs ``.all()`` (one ``fetchall``), beside the
    raw loop.
``delayed``  (finding R2; figure 3)
    lateness after ``available_at`` of runs delayed 1-5 s, with the relay waiting
    ``max(due, 0.02)`` s for the next due row (current) vs exactly ``due`` s when it is
    positive and no wait when a row became due since the last claim (emulated: the
    next-due query sleeps ``due`` itself, then sets the wake).
``worker``  (findings W1, W1b; figure 6)
    ``Worker.run()`` acknowledging each message with DeleteMessage (current) vs
    DeleteMessageBatch of up to 10 handles flushed every 20 ms, beside the plain
    receive + delete loop, through moto. On a library that batches acknowledgements
    itself (``worker/acks.py``, 5 ms linger), its linger vs 20 ms instead.
"""

from __future__ import annotations

import json
import threading
import time
from typing import Any

import _common as common
import psycopg
import sqlalchemy as sa
from sqlalchemy.orm import sessionmaker


# --- dispatch -------------------------------------------------------------------------------------
def _one_run_sql(table: str) -> Any:
    from sqlalchemy.dialects.postgresql import UUID

    tenant_col = "tenant_id, " if table == "outbox_messages" else ""
    tenant_val = ":tenant_id, " if table == "outbox_messages" else ""
    return sa.text(
        f"""
WITH runs AS (
    INSERT INTO task_runs (run_id, task, event, queue, tenant_id, idempotency_key, available_at)
    VALUES (:run_id, :task, :event, :queue, :tenant_id, :key,
            COALESCE(CAST(:available_at AS timestamptz), clock_timestamp() + CAST(:delay AS interval)))
    ON CONFLICT DO NOTHING
    RETURNING run_id, available_at
)
INSERT INTO {table} ({tenant_col}run_id, queue, envelope, available_at)
SELECT {tenant_val}run_id, :queue, CAST(:envelope AS jsonb), available_at FROM runs
RETURNING run_id
"""
    ).bindparams(
        sa.bindparam("run_id", type_=UUID(as_uuid=True)),
        sa.bindparam("available_at", type_=sa.DateTime(timezone=True)),
        sa.bindparam("delay", type_=sa.Interval),
    )


def patch_fastpath(installation: Any) -> None:
    """D1: one run per flush → a scalar CTE naming its table; anything else → the library."""
    statements = {t: _one_run_sql(t) for t in ("outbox_messages", "platform_outbox_messages")}
    general = installation._write_deferred

    def write_deferred(session: Any, state: Any) -> None:
        if len(state.deferred) != 1:
            general(session, state)
            return
        run = state.deferred[0]
        table = "outbox_messages" if run.tenant_id is not None else "platform_outbox_messages"
        row = (
            session.connection()
            .execute(
                statements[table],
                {
                    "run_id": run.run_id,
                    "task": run.task,
                    "event": run.event,
                    "queue": run.queue,
                    "tenant_id": run.tenant_id,
                    "key": run.idempotency_key,
                    "available_at": run.available_at,
                    "delay": run.delay,
                    "envelope": json.dumps(run.envelope, separators=(",", ":")),
                },
            )
            .first()
        )
        if row is None:  # a conflict: the general path resolves it
            general(session, state)
            return
        state.deferred = []
        run.resolved_run_id, run.deduplicated = run.run_id, False
        if hasattr(run, "source"):  # libraries before the runs stopped pointing back
            run.source.record_resolution(run)
        owner = session.get_nested_transaction() or session.get_transaction()
        state.written[owner] = state.written.get(owner, 0) + 1

    installation._write_deferred = write_deferred


def patch_ffwake(installation: Any) -> None:
    """D2: pre-encoded LPUSH+LTRIM; do not wait for the replies (read them next time)."""
    waker = installation.waker
    connection = waker._client.connection_pool.get_connection()
    packed = connection.pack_commands([("LPUSH", waker.key, 1), ("LTRIM", waker.key, 0, waker.list_max - 1)])
    unread = [0]

    def wake() -> bool:
        while unread[0]:
            connection.read_response()
            unread[0] -= 1
        connection.send_packed_command(packed, check_health=False)
        unread[0] += 2
        return True

    waker.wake = wake


def patch_prepacked_push(installation: Any) -> None:
    """D2 for a library whose waker pushes from its own thread (``Waker._push``, 0923fc1):
    the same pre-encoded send there, replies read at the next push."""
    waker = installation.waker
    connection = waker._client.connection_pool.get_connection()
    packed = connection.pack_commands([("LPUSH", waker.key, 1), ("LTRIM", waker.key, 0, waker.list_max - 1)])
    unread = [0]

    def push(count: int) -> None:
        while unread[0]:
            connection.read_response()
            unread[0] -= 1
        connection.send_packed_command(packed, check_health=False)
        unread[0] += 2
        waker.stats.sent += count

    waker._push = push


def dispatch_experiment(args: Any, report: common.Report) -> None:
    import _peers
    from bench_dispatch import _order

    import sqla_outbox
    from sqla_outbox import Dispatch

    with common.bench_database(args, "bench_what_if") as db:
        engine = common.one_connection_engine(db.url)
        cat = common.catalog()
        from sqla_outbox import wakeup

        if hasattr(wakeup.Waker, "_push"):  # 0923fc1 moved the wake to a thread; fde225d did D1
            variants = ["orm", "current", "current+prepacked", "current+ffwake", "current+nowake"]
        else:
            variants = ["orm", "current", "fastpath", "fastpath+ffwake", "fastpath+nowake"]
        makers: dict[str, Any] = {}
        for name in variants:
            maker = sessionmaker(engine)
            redis_url = None if name.endswith("nowake") else args.redis_url
            installation = sqla_outbox.install(maker, common.settings(db, redis_url), catalog=cat)
            if name.startswith("fastpath"):
                patch_fastpath(installation)
            if name.endswith("ffwake"):
                patch_ffwake(installation)
            if name.endswith("prepacked"):
                patch_prepacked_push(installation)
            makers[name] = maker
        _peers.install_procrastinate(db.url)
        app = _peers.procrastinate_app(db.url)

        def side(name: str) -> float:
            maker = makers["orm" if name == "procrastinate" else name]
            with engine.begin() as conn:
                conn.exec_driver_sql(
                    "TRUNCATE bench_orders, outbox_messages, platform_outbox_messages, task_runs, "
                    "task_run_trail, procrastinate_jobs RESTART IDENTITY CASCADE"
                )
            started = time.perf_counter()
            for i in range(args.txns):
                with maker() as session, session.begin():
                    session.add(_order(i))
                    if name == "procrastinate":
                        raw = session.connection().connection.driver_connection
                        _peers.procrastinate_defer(app, raw, **common.PAYLOAD)
                    elif name != "orm":
                        session.add(Dispatch(common.TENANT_TASK, common.PAYLOAD, tenant_id=1 + i % 20))
            if name not in ("orm", "procrastinate"):
                written = common.count(db.url, "SELECT count(*) FROM outbox_messages")
                if written != args.txns:
                    raise RuntimeError(f"{name} wrote {written} outbox rows, expected {args.txns}")
            return args.txns / (time.perf_counter() - started)

        names = [*variants, "procrastinate"]
        for name in names:
            side(name)
        results = common.alternate(args.rounds * 2, {n: (lambda n=n: side(n)) for n in names}, log=False)
        engine.dispose()
    med = {n: common.median(v) for n, v in results.items()}
    pr = common.paired_ratio
    report.table(
        f"dispatch: single-row transactions, one connection ({args.txns} txns/side/round)",
        ["side", "txn/s (median)", "vs orm", "vs current", "vs procrastinate"],
        [
            [n, med[n], pr(results, n, "orm"), pr(results, n, "current"), pr(results, n, "procrastinate")]
            for n in names
        ],
    )
    report.results["dispatch"] = results
    best = "current+ffwake" if "current+ffwake" in results else "fastpath+ffwake"
    report.ratio(f"dispatch {best} / orm", pr(results, best, "orm"), 0.70)
    report.ratio(f"dispatch {best} / procrastinate", pr(results, best, "procrastinate"), 1.25)


# --- relay ----------------------------------------------------------------------------------------
def relay_experiment(args: Any, report: common.Report) -> None:
    from sqla_outbox.relay import Relay, claim

    original = claim.claim

    def claim_all(connection: Any, table: str, *, limit: int) -> list[Any]:
        rows = connection.execute(claim._CLAIM[table], {"limit": limit}).all()
        return [claim.ClaimedRow(table, *row) for row in rows]

    with common.bench_database(args, "bench_what_if") as db:
        st = common.settings(db, None)

        def relay_side(patched: bool) -> float:
            common.truncate_outbox(db.url)
            common.fill_backlog(db.url, args.rows)
            claim.claim = claim_all if patched else original  # type: ignore[assignment]
            try:
                sender = common.AcceptAllSender(target=args.rows)
                engine = common.one_connection_engine(db.url)
                relay = Relay(st, sender=sender, engine=engine, name="bench")
                started = time.perf_counter()
                relay.start_in_thread()
                if not sender.done.wait(600):
                    raise RuntimeError("relay did not drain")
                elapsed = time.perf_counter() - started
                relay.stop()
                relay.join(30)
                engine.dispose()
            finally:
                claim.claim = original  # type: ignore[assignment]
            return args.rows / elapsed

        def raw_side() -> float:
            common.truncate_outbox(db.url)
            common.fill_backlog(db.url, args.rows)
            done = 0
            with psycopg.connect(db.url) as conn:
                started = time.perf_counter()
                while True:
                    with conn.transaction():
                        rows = conn.execute(
                            "SELECT id, run_id, queue, tenant_id, envelope, attempts, available_at "
                            "FROM outbox_messages "
                            "WHERE sent_at IS NULL AND available_at <= clock_timestamp() "
                            "ORDER BY available_at, id LIMIT 100 FOR UPDATE SKIP LOCKED"
                        ).fetchall()
                        if not rows:
                            break
                        conn.execute(
                            "UPDATE outbox_messages SET sent_at = clock_timestamp() WHERE id = ANY(%s)",
                            ([r[0] for r in rows],),
                        )
                    done += len(rows)
                return done / (time.perf_counter() - started)

        results = common.alternate(
            args.rounds,
            {
                "relay (current)": lambda: relay_side(False),
                "relay claim .all()": lambda: relay_side(True),
                "raw loop": raw_side,
            },
            log=False,
        )
    med = {n: common.median(v) for n, v in results.items()}
    report.table(
        f"relay drain, {args.rows:,} rows, accept-all sender",
        ["side", "rows/s (median)", "vs raw loop", "vs current"],
        [
            [
                n,
                med[n],
                common.paired_ratio(results, n, "raw loop"),
                common.paired_ratio(results, n, "relay (current)"),
            ]
            for n in results
        ],
    )
    report.results["relay"] = results
    report.ratio(
        "relay claim .all() / raw loop", common.paired_ratio(results, "relay claim .all()", "raw loop"), 0.7
    )


# --- delayed --------------------------------------------------------------------------------------
def delayed_experiment(args: Any, report: common.Report) -> None:
    import random

    import sqla_outbox
    from sqla_outbox import Dispatch
    from sqla_outbox.relay import Relay, claim

    original = claim.seconds_until_next_due
    lateness: dict[str, list[float]] = {"relay (current)": [], "relay waits exactly due": []}
    rng = random.Random(5)
    with common.bench_database(args, "bench_what_if") as db:
        st = common.settings(db, args.redis_url, relay_sweep_interval_seconds=5.0)
        engine = common.one_connection_engine(db.url)
        sessions = sessionmaker(engine)
        sqla_outbox.install(sessions, st, catalog=common.catalog())
        for r in range(args.rounds * 2):
            name = list(lateness)[r % 2]
            sender = common.AcceptAllSender(record=True)
            relay = Relay(st, sender=sender, engine=common.one_connection_engine(db.url), name="bench")

            def exactly(connection: Any, relay: Any = relay) -> float | None:
                due = original(connection)
                if due is not None and due < 0.02:
                    if due > 0:
                        time.sleep(due)
                    relay.wake()  # pass now (the experiment has no rows locked elsewhere)
                return due

            claim.seconds_until_next_due = exactly if name != "relay (current)" else original  # type: ignore[assignment]
            relay.start_in_thread()
            try:
                wanted: set[str] = set()
                with sessions() as session:
                    for _ in range(args.delayed):
                        with session.begin():
                            d = Dispatch(common.TASK, common.PAYLOAD, delay=rng.uniform(1, 5))
                            session.add(d)
                        wanted.add(str(d.run_id))
                deadline = time.monotonic() + 30
                seen: dict[str, float] = {}
                while len(seen) < len(wanted) and time.monotonic() < deadline:
                    time.sleep(0.2)
                    for _t, wall, rows in list(sender.calls):
                        for row in rows:
                            if str(row.run_id) in wanted:
                                seen.setdefault(str(row.run_id), wall - row.available_at.timestamp())
                lateness[name].extend(seen.values())
            finally:
                relay.stop()
                relay.join(15)
                claim.seconds_until_next_due = original  # type: ignore[assignment]
        engine.dispose()
    rows = []
    for name, values in lateness.items():
        s = common.summary_ms(values)
        rows.append([name, s["n"], s["p50_ms"], s["p90_ms"], s["p99_ms"], s["max_ms"]])
        report.results[f"delayed {name}"] = s
    report.table(
        "delayed runs: lateness after available_at (ms)", ["side", "n", "p50", "p90", "p99", "max"], rows
    )
    report.ratio(
        "delayed p99 ms, relay waits exactly due",
        report.results["delayed relay waits exactly due"]["p99_ms"],
        100.0,
        higher_is_better=False,
    )


# --- worker ---------------------------------------------------------------------------------------
class BatchAcker:
    """W1: collect receipt handles; DeleteMessageBatch at 10 handles or 20 ms after the first."""

    def __init__(self, worker: Any, on_deleted: Any) -> None:
        self.worker = worker
        self.on_deleted = on_deleted
        self.lock = threading.Lock()
        self.pending: dict[str, list[str]] = {}
        self.kick = threading.Event()
        threading.Thread(target=self._loop, daemon=True).start()

    def ack(self, queue: str, receipt_handle: str) -> None:
        with self.lock:
            handles = self.pending.setdefault(queue, [])
            handles.append(receipt_handle)
            full = len(handles) >= 10
        if full:
            self.flush(queue)
        else:
            self.kick.set()

    def _loop(self) -> None:
        while True:
            self.kick.wait()
            time.sleep(0.02)
            self.kick.clear()
            for queue in list(self.pending):
                self.flush(queue)

    def flush(self, queue: str) -> None:
        with self.lock:
            handles = self.pending.get(queue, [])
            batch, self.pending[queue] = handles[:10], handles[10:]
        if batch:
            self.worker.client.delete_message_batch(
                QueueUrl=self.worker.directory.url(queue),
                Entries=[{"Id": str(i), "ReceiptHandle": h} for i, h in enumerate(batch)],
            )
            self.on_deleted(len(batch))


def worker_experiment(args: Any, report: common.Report) -> None:
    """W1: without batched acks in the library, patch them in (20 ms linger); with them
    (``worker/acks.py``, since 2515c12), compare its linger with a 20 ms one (W1b)."""
    import importlib.util

    from sqla_outbox.relay.claim import ClaimedRow
    from sqla_outbox.relay.send import build_entry
    from sqla_outbox.sqs.client import make_client
    from sqla_outbox.worker.consumer import Worker
    from sqla_outbox.worker.registry import Registry

    library_batches = importlib.util.find_spec("sqla_outbox.worker.acks") is not None
    registry = Registry()
    registry.task(common.TENANT_TASK, queue="default", scope="tenant")(lambda payload: None)
    with common.moto_server() as server, common.bench_database(args, "bench_what_if") as db:
        st = common.settings(
            db, None, sqs_endpoint_url=server.endpoint, worker_queues=("default",), worker_wait_seconds=1
        )
        client = make_client(st, max_pool_connections=30, read_timeout_seconds=20)
        plain = common.sqs_client(server.endpoint)

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
                plain.send_message_batch(
                    QueueUrl=url,
                    Entries=[
                        {"Id": str(i), "MessageBody": e.body, "MessageAttributes": e.attributes}
                        for i, e in enumerate(entries[k : k + 10])
                    ],
                )
            return url

        def worker_side(batched: bool) -> float:
            prefill()
            counter = common.DeleteCounter(client, args.messages)
            worker = Worker(st, registry=registry, catalog=common.catalog(), client=counter, name="bench")
            if batched and library_batches:
                worker.acks.linger_seconds = 0.02  # type: ignore[attr-defined]
            elif batched:
                worker.outcomes.ack = BatchAcker(worker, lambda n: None).ack  # type: ignore[method-assign]
            thread = threading.Thread(target=lambda: worker.run(handle_signals=False), daemon=True)
            started = time.perf_counter()
            thread.start()
            if not counter.done.wait(300):
                raise RuntimeError(f"worker deleted {counter.deleted} of {args.messages}")
            elapsed = time.perf_counter() - started
            worker.stop()
            thread.join(60)
            return args.messages / elapsed

        def plain_side() -> float:
            url = prefill()
            deleted = 0
            started = time.perf_counter()
            while deleted < args.messages:
                for m in plain.receive_message(QueueUrl=url, MaxNumberOfMessages=10, WaitTimeSeconds=1).get(
                    "Messages", []
                ):
                    plain.delete_message(QueueUrl=url, ReceiptHandle=m["ReceiptHandle"])
                    deleted += 1
            return args.messages / (time.perf_counter() - started)

        changed = "worker acks linger 20 ms" if library_batches else "worker batched acks"
        results = common.alternate(
            args.rounds,
            {
                "worker (current)": lambda: worker_side(False),
                changed: lambda: worker_side(True),
                "plain loop": plain_side,
            },
            log=False,
        )
    med = {n: common.median(v) for n, v in results.items()}
    report.table(
        f"worker, {args.messages} pre-filled messages through moto",
        ["side", "runs/s (median)", "vs plain loop", "vs current"],
        [
            [
                n,
                med[n],
                common.paired_ratio(results, n, "plain loop"),
                common.paired_ratio(results, n, "worker (current)"),
            ]
            for n in results
        ],
    )
    report.results["worker"] = results
    report.ratio(f"{changed} / plain loop", common.paired_ratio(results, changed, "plain loop"), 0.8)


def main() -> None:
    p = common.parser(__doc__, rounds=5)
    p.add_argument("experiments", nargs="*", default=["dispatch", "relay", "delayed", "worker"])
    p.add_argument("--delayed", type=int, default=100, help="delayed: runs per round")
    p.add_argument("--txns", type=int, default=200, help="dispatch: transactions per side per round")
    p.add_argument("--rows", type=int, default=50_000, help="relay: backlog rows")
    p.add_argument("--messages", type=int, default=300, help="worker: pre-filled messages")
    args = p.parse_args()
    report = common.Report(
        "what_if",
        args,
        {
            "experiments": args.experiments,
            "rounds": args.rounds,
            "txns": args.txns,
            "rows": args.rows,
            "messages": args.messages,
        },
    )
    runners = {
        "dispatch": dispatch_experiment,
        "relay": relay_experiment,
        "delayed": delayed_experiment,
        "worker": worker_experiment,
    }
    for name in args.experiments:
        print(f"experiment {name}", flush=True)
        try:
            runners[name](args, report)
        except AttributeError as exc:  # an internal the patch needs has moved
            report.note(f"experiment {name} skipped: {exc}")
    report.emit()


if __name__ == "__main__":
    main()
