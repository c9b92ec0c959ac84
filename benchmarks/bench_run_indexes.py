"""Issue 16 — what the run-list indexes of ``sqlaob_0003`` cost the write path.

``sqlaob_0003`` adds three indexes to ``task_runs`` (``created_at``; ``task, created_at``;
``tenant_id, created_at``) so the dashboard's run lists read only the rows they show. Every
index costs every insert, and, because ``task_runs_status_idx`` covers ``status`` and
``updated_at`` (so no status change is a HOT update), every status change too. Sides, one
database connection, each once per round in rotating order:

``dispatch``
    ``--txns`` transactions each adding one ``Dispatch`` of a tenant task (the listeners
    write the ``task_runs`` and ``outbox_messages`` rows; no wake): transactions/s.
``worker``
    the worker's own statements for ``--txns`` queued runs, one transaction per step as
    the worker commits them: ``take_lease`` (queued → running, trail row) then
    ``mark_succeeded`` (running → succeeded, trail row): runs/s.

each with the indexes (``with``) and after ``DROP INDEX`` of the three (``without``; the
schema of ``sqlaob_0001``), on tables truncated before each side and holding
``--background`` older runs (so the indexes are not trivially small).

Judged by: with / without >= 0.9 for both (the indexes cost at most a tenth of the rate).
"""

from __future__ import annotations

import time
from typing import Any

import _common as common
import psycopg
import sqlalchemy as sa
from sqlalchemy.orm import sessionmaker

INDEXES = {
    "task_runs_created_at_idx": "(created_at)",
    "task_runs_task_created_at_idx": "(task, created_at)",
    "task_runs_tenant_id_created_at_idx": "(tenant_id, created_at)",
}


def main() -> None:
    p = common.parser(__doc__, rounds=7)
    p.add_argument(
        "--txns", type=int, default=300, help="transactions (runs) per side per round (default 300)"
    )
    p.add_argument(
        "--background", type=int, default=200_000, help="older runs in task_runs (default 200,000)"
    )
    args = p.parse_args()

    import sqla_outbox
    from sqla_outbox import Dispatch
    from sqla_outbox.lifecycle import attempts

    report = common.Report(
        "bench_run_indexes", args, {"rounds": args.rounds, "txns": args.txns, "background": args.background}
    )
    with common.bench_database(args, "bench_run_indexes") as db:
        engine = common.one_connection_engine(db.url)
        installed = sessionmaker(engine)
        sqla_outbox.install(installed, common.settings(db, None), catalog=common.catalog())

        def prepare(with_indexes: bool) -> None:
            with psycopg.connect(db.url, autocommit=True) as conn:
                conn.execute("TRUNCATE outbox_messages, platform_outbox_messages, task_runs, task_run_trail")
                for name in INDEXES:
                    conn.execute(f"DROP INDEX IF EXISTS {name}")
                conn.execute(
                    "INSERT INTO task_runs (run_id, task, queue, tenant_id, status, available_at, "
                    "created_at, finished_at) SELECT gen_random_uuid(), 'task_' || (g %% 20), 'default', "
                    "1 + g %% 20, "
                    "'succeeded', t, t, t FROM generate_series(1, %(n)s) g, "
                    "LATERAL (SELECT clock_timestamp() - g * interval '1 second' AS t) x",
                    {"n": args.background},
                )
                if with_indexes:
                    for name, columns in INDEXES.items():
                        conn.execute(f"CREATE INDEX {name} ON task_runs {columns}")
                conn.execute("VACUUM ANALYZE task_runs")

        def dispatch_side(with_indexes: bool) -> float:
            prepare(with_indexes)
            started = time.perf_counter()
            for i in range(args.txns):
                with installed() as session, session.begin():
                    session.add(Dispatch(common.TENANT_TASK, common.PAYLOAD, tenant_id=1 + i % 20))
            return args.txns / (time.perf_counter() - started)

        def worker_side(with_indexes: bool) -> float:
            prepare(with_indexes)
            with installed() as session, session.begin():
                for i in range(args.txns):
                    session.add(Dispatch(common.TENANT_TASK, common.PAYLOAD, tenant_id=1 + i % 20))
            with engine.connect() as conn:
                rows = conn.execute(
                    sa.text("SELECT run_id, tenant_id FROM task_runs WHERE status = 'queued'")
                )
                queued = [(r.run_id, r.tenant_id) for r in rows]
            started = time.perf_counter()
            for run_id, tenant_id in queued:
                with engine.begin() as conn:
                    claim = attempts.take_lease(
                        conn,
                        run_id=run_id,
                        task=common.TENANT_TASK,
                        tenant_id=tenant_id,
                        worker_id="bench:1",
                        lease_seconds=60,
                        receive_count=1,
                    )
                    assert claim.attempt is not None
                with engine.begin() as conn:
                    attempt = attempts.Attempt(run_id, claim.attempt, 1, "bench:1")
                    assert attempts.mark_succeeded(conn, attempt)
            return len(queued) / (time.perf_counter() - started)

        sides: dict[str, Any] = {
            "dispatch with": lambda: dispatch_side(True),
            "dispatch without": lambda: dispatch_side(False),
            "worker with": lambda: worker_side(True),
            "worker without": lambda: worker_side(False),
        }
        results = common.alternate(args.rounds, sides)
        engine.dispose()

    rows = [[name, round(common.median(values), 1)] for name, values in results.items()]
    report.table(f"Transactions (runs) per second, median of {args.rounds} rounds", ["side", "per s"], rows)
    report.results = {name: values for name, values in results.items()}
    for kind in ("dispatch", "worker"):
        ratio = common.paired_ratio(results, f"{kind} with", f"{kind} without")
        report.ratio(f"{kind}: with the sqlaob_0003 indexes / without", round(ratio, 3), 0.9)
    report.emit()


if __name__ == "__main__":
    main()
