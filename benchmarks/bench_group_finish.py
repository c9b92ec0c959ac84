"""Group finishing cost: what the group trigger adds to a member's finishing transaction.

One connection, one process. Each side writes ``--runs`` runs (not timed), then finishes
them one transaction each, as a worker does: take the lease (``attempts.take_lease``) and mark
the run succeeded (``attempts.mark_succeeded``) in one transaction. Timed: the finishing
transactions only. Sides, alternated ``--rounds`` times:

``plain``
    ordinary runs (no ``group_id``): the trigger's ``WHEN`` clause skips them.
``grouped``
    the same number of runs, members of groups of ``--group-size``: each finish also
    locks and updates its group row, and the last finish of each group writes the
    completion run and outbox row.

Judged by: ``grouped / plain`` finishes per second (no target: the figure tells what a
group member costs). PostgreSQL with its stock settings (a WAL flush per commit).
"""

from __future__ import annotations

import time
from typing import Any

import _common as common
import sqlalchemy as sa
from sqlalchemy.orm import sessionmaker


def _write(maker: Any, count: int, group_size: int | None) -> list[Any]:
    from sqla_outbox import Dispatch, Group

    ids: list[Any] = []
    with maker() as session, session.begin():
        if group_size is None:
            items = [Dispatch(common.TASK, common.PAYLOAD) for _ in range(count)]
            session.add_all(items)
            ids = [d.run_id for d in items]
        else:
            for _ in range(count // group_size):
                members = [Dispatch(common.TASK, common.PAYLOAD) for _ in range(group_size)]
                session.add(Group(members, on_complete=Dispatch(common.TASK, common.PAYLOAD)))
                ids.extend(d.run_id for d in members)
    return ids


def _finish(engine: sa.Engine, ids: list[Any]) -> float:
    from sqla_outbox.lifecycle import attempts

    started = time.perf_counter()
    with engine.connect() as conn:
        for run_id in ids:
            claim = attempts.take_lease(
                conn,
                run_id=run_id,
                task=common.TASK,
                tenant_id=None,
                worker_id="bench",
                lease_seconds=60,
                receive_count=1,
                honour_due_time=False,
            )
            attempts.mark_succeeded(conn, attempts.Attempt(run_id, claim.attempt, 1, "bench"))
            conn.commit()
    return len(ids) / (time.perf_counter() - started)


def main() -> None:
    p = common.parser(__doc__, rounds=5)
    p.add_argument("--runs", type=int, default=400, help="runs finished per side per round")
    p.add_argument("--group-size", type=int, default=10, help="members per group")
    args = p.parse_args()
    import sqla_outbox

    report = common.Report("group_finish", args, {"runs": args.runs, "group_size": args.group_size})
    with common.bench_database(args, "bench_group_finish") as db:
        engine = sa.create_engine(db.sa_url, pool_size=1, max_overflow=0)
        maker = sessionmaker(engine)
        sqla_outbox.install(maker, common.settings(db, None), catalog=common.catalog())

        def side(group_size: int | None) -> Any:
            def run() -> float:
                common.truncate_outbox(db.url)
                with engine.begin() as conn:
                    conn.execute(sa.text("TRUNCATE task_groups"))
                ids = _write(maker, args.runs, group_size)
                return _finish(engine, ids)

            return run

        results = common.alternate(args.rounds, {"plain": side(None), "grouped": side(args.group_size)})
        engine.dispose()
    report.results = results
    report.table(
        "Finishing transactions per second (median over rounds)",
        ["side", "finishes/s"],
        [[name, common.median(values)] for name, values in results.items()],
    )
    report.ratio("grouped / plain", common.paired_ratio(results, "grouped", "plain"), None)
    report.emit()


if __name__ == "__main__":
    main()
