"""Issue 13 — tenant rate limit accuracy: a tenant limited to N runs a minute under overload.

The relay and one worker run as real subprocesses against PostgreSQL, Valkey and moto
(default settings, queue ``default``). Tenant A (id 1) is limited to ``--limit`` runs a
minute (``python -m sqla_outbox flow tenant 1 --rate-limit N``: a ``tenant_flow``
override) and has ``--backlog`` due runs from the start, far more than it may be sent in
``--minutes`` minutes: a steady overload. Tenant B (id 2, no limit) commits one run a
second throughout, to show the other tenants keep flowing.

Measured on the database clock: A's handler starts (``task_runs.started_at``) per minute
from A's first start, for ``--minutes`` minutes; the total over the whole span against
``minutes x N`` (target: within 5 %), and B's commit → start latency.

What the relay does (docs/flow-control.md): it counts A's sends in a sliding 60 s window
and claims none of A's rows while the window holds N, so A's runs leave the outbox in
steps of up to N as the window frees; the excess waits in the outbox with no attempt spent.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import _common as common
from sqlalchemy.orm import sessionmaker

HERE = Path(__file__).resolve().parent
TENANT_A, TENANT_B = 1, 2


def service(module: str, env: dict[str, str], log: Path, *extra: str) -> subprocess.Popen[bytes]:
    with log.open("ab") as out:
        return subprocess.Popen(
            [sys.executable, "-m", module, "--log-format", "json", *extra],
            env=env,
            cwd=HERE,
            stdout=out,
            stderr=out,
        )


def main() -> None:
    p = common.parser(__doc__, rounds=1)
    p.add_argument("--limit", type=int, default=600, help="A's runs per minute (default 600)")
    p.add_argument("--backlog", type=int, default=5000, help="A's due runs at the start (default 5000)")
    p.add_argument("--minutes", type=int, default=3, help="measured minutes (default 3)")
    p.add_argument("--logs", help="directory for relay/worker logs (default: a temporary one)")
    args = p.parse_args()
    if args.backlog < args.limit * (args.minutes + 1):
        p.error("--backlog must exceed --limit x (--minutes + 1): the tenant must stay over its limit")
    logs = Path(args.logs) if args.logs else Path(tempfile.mkdtemp(prefix="bench_rate_limit_"))
    logs.mkdir(parents=True, exist_ok=True)
    print(f"relay and worker logs: {logs}", flush=True)

    import psycopg

    import sqla_outbox
    from sqla_outbox import Dispatch, flow

    report = common.Report(
        "bench_rate_limit",
        args,
        {"limit_per_minute": args.limit, "backlog": args.backlog, "minutes": args.minutes},
    )
    with common.moto_server() as server, common.bench_database(args, "bench_rate_limit") as db:
        st = common.settings(db, args.redis_url, sqs_endpoint_url=server.endpoint)
        client = common.sqs_client(server.endpoint)
        common.provision(client, st)
        env = {k: v for k, v in os.environ.items() if not k.startswith("SQLA_OUTBOX_")}
        env.update(common.AWS_ENV)
        env.update(
            {
                "SQLA_OUTBOX_DATABASE_URL": db.sa_url,
                "SQLA_OUTBOX_VALKEY_URL": args.redis_url,
                "SQLA_OUTBOX_WAKE_KEY": st.wake_key,
                "SQLA_OUTBOX_QUEUE_PREFIX": st.queue_prefix,
                "SQLA_OUTBOX_SQS_ENDPOINT_URL": server.endpoint,
                "SQLA_OUTBOX_CATALOG_PATH": st.catalog_path,
                "SQLA_OUTBOX_WORKER_QUEUES": "default",
                "PYTHONPATH": os.pathsep.join([str(HERE), env.get("PYTHONPATH", "")]).rstrip(os.pathsep),
            }
        )
        engine = common.one_connection_engine(db.url)
        sessions = sessionmaker(engine)
        sqla_outbox.install(sessions, st, catalog=common.catalog())
        with engine.begin() as conn:
            flow.set_tenant(conn, TENANT_A, rate_limit_per_minute=args.limit, by="bench")
        common.fill_backlog(db.url, args.backlog, only_tenant=TENANT_A)

        def query(sql: str, params: dict[str, Any] | None = None) -> Any:
            with psycopg.connect(common.libpq_url(db.url), autocommit=True) as conn:
                return conn.execute(sql, params or {}).fetchall()

        stop = threading.Event()
        b_runs: list[Any] = []

        def tenant_b() -> None:
            b_engine = common.one_connection_engine(db.url)
            b_sessions = sessionmaker(b_engine)
            sqla_outbox.install(b_sessions, st, catalog=common.catalog())
            while not stop.is_set():
                with b_sessions() as session, session.begin():
                    item = Dispatch(common.TENANT_TASK, common.PAYLOAD, tenant_id=TENANT_B)
                    session.add(item)
                b_runs.append(item.run_id)
                stop.wait(1.0)
            b_engine.dispose()

        relay = service("sqla_outbox.relay", env, logs / "relay.log")
        worker = service("sqla_outbox.worker", env, logs / "worker.log", "--imports", "_noop_tasks")
        feeder = threading.Thread(target=tenant_b, daemon=True)
        feeder.start()
        try:
            span = args.minutes * 60
            deadline = time.monotonic() + span + 30
            first = None
            while first is None and time.monotonic() < deadline:
                first = query(
                    "SELECT min(started_at) FROM task_runs WHERE tenant_id = %(a)s", {"a": TENANT_A}
                )[0][0]
                time.sleep(0.2)
            if first is None:
                raise RuntimeError(f"A's runs never started; see {logs}")
            print(f"A's first run started at {first.isoformat()}; measuring {span} s ...", flush=True)
            while True:
                now = query("SELECT clock_timestamp()")[0][0]
                if (now - first).total_seconds() >= span + 5:
                    break
                time.sleep(1.0)
        finally:
            stop.set()
            for process in (worker, relay):
                process.terminate()
                try:
                    process.wait(20)
                except subprocess.TimeoutExpired:
                    process.kill()
        per_minute = [
            int(
                query(
                    "SELECT count(*) FROM task_runs WHERE tenant_id = %(a)s AND started_at >= %(from)s "
                    "AND started_at < %(from)s + make_interval(secs => %(s)s) "
                    "AND started_at >= %(first)s + make_interval(mins => %(m)s)",
                    {"a": TENANT_A, "from": first, "s": (m + 1) * 60.0, "first": first, "m": m},
                )[0][0]
            )
            for m in range(args.minutes)
        ]
        total = sum(per_minute)
        expected = args.limit * args.minutes
        error = (total - expected) / expected
        b_latency = [
            float(r[0])
            for r in query(
                "SELECT EXTRACT(EPOCH FROM started_at - created_at)::float8 FROM task_runs "
                "WHERE tenant_id = %(b)s AND started_at IS NOT NULL",
                {"b": TENANT_B},
            )
        ]
        pending_a = int(
            query(
                "SELECT count(*) FROM outbox_messages WHERE tenant_id = %(a)s AND sent_at IS NULL",
                {"a": TENANT_A},
            )[0][0]
        )
        spent = query("SELECT max(attempts) FROM outbox_messages WHERE tenant_id = %(a)s", {"a": TENANT_A})[
            0
        ][0]
        report.table(
            f"Tenant A limited to {args.limit}/min, {args.backlog:,} runs due from the start",
            ["minute", "A handler starts", "target"],
            [[m + 1, n, args.limit] for m, n in enumerate(per_minute)] + [["total", total, expected]],
        )
        report.table(
            "Tenant B (no limit, 1 run/s) meanwhile",
            [
                "B runs started",
                "B p50 commit→start (s)",
                "B p99 (s)",
                "A still pending at the end",
                "A send attempts spent",
            ],
            [
                [
                    len(b_latency),
                    common.percentile(b_latency, 50),
                    common.percentile(b_latency, 99),
                    pending_a,
                    spent or 0,
                ]
            ],
        )
        report.results = {
            "per_minute": per_minute,
            "total": total,
            "expected": expected,
            "b_latency_s": b_latency,
        }
        report.ratio(f"A's runs over {args.minutes} min / ({args.minutes} x N)", total / expected, None)
        report.ratio("|error| (target <= 5 %)", abs(error), 0.05, higher_is_better=False)
        report.emit()


if __name__ == "__main__":
    main()
