"""Cancel — what a ``Cancel`` costs the application's transaction, on a table with a backlog.

One database holds ``--backlog`` pending runs (``task_runs`` plus outbox rows, filled with
set-based SQL) so the statements run against realistic indexes. One connection, one
process, sides alternating per round (``--rounds``), ``--txns`` transactions per side:

``dispatch``
    one ``Dispatch`` per transaction (the reference).
``cancel by run_id``
    one ``Cancel(run_id)`` of a just-dispatched, unsent run per transaction (the run
    becomes ``cancelled``, its outbox row is deleted, a trail row is written).
``cancel by key``
    one ``Cancel(task=..., tenant_id=..., idempotency_key=...)`` per transaction.
``cancel check (8 runs)``
    the worker heartbeat's query for cancel requests of 8 running runs
    (:func:`sqla_outbox.lifecycle.attempts.cancel_requests`), one per call.

Figures: transactions (or calls) per second, median over rounds, and the per-transaction
latency percentiles of the last round.
"""

from __future__ import annotations

import time
import uuid

import _common as common
import sqlalchemy as sa
from sqlalchemy.orm import sessionmaker

import sqla_outbox
from sqla_outbox import Cancel, Dispatch
from sqla_outbox.lifecycle import attempts


def main() -> None:
    p = common.parser(__doc__, rounds=5)
    p.add_argument("--txns", type=int, default=200, help="transactions per side per round")
    p.add_argument("--backlog", type=int, default=100_000, help="pending runs in the tables")
    args = p.parse_args()
    report = common.Report(
        "bench_cancel", args, {"rounds": args.rounds, "txns": args.txns, "backlog": args.backlog}
    )
    with common.bench_database(args, "bench_cancel") as db:
        common.fill_backlog(db.url, args.backlog)
        st = common.settings(db, None)
        engine = common.one_connection_engine(db.url)
        sessions = sessionmaker(engine)
        sqla_outbox.install(sessions, st, catalog=common.catalog())
        latencies: dict[str, list[float]] = {}
        counter = iter(range(10**9))

        def timed(name: str, work: object) -> float:
            started = time.perf_counter()
            samples = []
            for _ in range(args.txns):
                t0 = time.perf_counter()
                work()  # type: ignore[operator]
                samples.append(time.perf_counter() - t0)
            latencies[name] = samples
            return args.txns / (time.perf_counter() - started)

        def dispatch(**options: object) -> uuid.UUID:
            with sessions() as session, session.begin():
                item = Dispatch(common.TENANT_TASK, common.PAYLOAD, tenant_id=1, delay=3600, **options)  # type: ignore[arg-type]
                session.add(item)
            return item.run_id

        def side_dispatch() -> float:
            return timed("dispatch", dispatch)

        def side_cancel_id() -> float:
            ids = [dispatch() for _ in range(args.txns)]
            it = iter(ids)

            def one() -> None:
                with sessions() as session, session.begin():
                    session.add(Cancel(next(it)))

            return timed("cancel by run_id", one)

        def side_cancel_key() -> float:
            keys = [f"reminder:{next(counter)}" for _ in range(args.txns)]
            for key in keys:
                dispatch(idempotency_key=key)
            it = iter(keys)

            def one() -> None:
                with sessions() as session, session.begin():
                    session.add(Cancel(task=common.TENANT_TASK, tenant_id=1, idempotency_key=next(it)))

            return timed("cancel by key", one)

        def side_check() -> float:
            held = [dispatch() for _ in range(8)]

            def one() -> None:
                with engine.begin() as connection:
                    attempts.cancel_requests(connection, held)

            return timed("cancel check (8 runs)", one)

        results = common.alternate(
            args.rounds,
            {
                "dispatch": side_dispatch,
                "cancel by run_id": side_cancel_id,
                "cancel by key": side_cancel_key,
                "cancel check (8 runs)": side_check,
            },
        )
        rows = []
        for name, per_round in results.items():
            summary = common.summary_ms(latencies[name])
            rows.append(
                [
                    name,
                    round(common.median(per_round)),
                    summary["p50_ms"],
                    summary["p90_ms"],
                    summary["p99_ms"],
                ]
            )
        report.table(
            f"Per transaction, {args.backlog} pending runs in the tables",
            ["side", "txn/s (median)", "p50 ms", "p90 ms", "p99 ms"],
            rows,
        )
        with engine.connect() as connection:
            cancelled = connection.execute(
                sa.text("SELECT count(*) FROM task_runs WHERE status = 'cancelled'")
            ).scalar()
        report.note(
            f"{cancelled} runs cancelled in total; every cancelled run's outbox row deleted in its statement"
        )
        engine.dispose()
    report.emit()


if __name__ == "__main__":
    main()
