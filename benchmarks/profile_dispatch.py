"""cProfile of the dispatch path: where a one-dispatch transaction spends its Python time.

    cd benchmarks && ../.venv/bin/python profile_dispatch.py --txns 2000
    # the baseline library: PYTHONPATH=/tmp/snap ../.venv/bin/python profile_dispatch.py
    #   (git archive main sqla_outbox | tar -x -C /tmp/snap)

Runs ``bench_dispatch.py``'s ``orm+dispatch`` side (one ORM row + one ``Dispatch`` per
transaction, real Redis wake) and, with ``--batch``, its ``dispatch x100`` side, under
cProfile on one connection, and prints the functions of sqla_outbox, SQLAlchemy's ORM
events and psycopg that take the most time, with the per-transaction CPU
(``time.process_time``, all threads of this process: the waker's too).
"""

from __future__ import annotations

import cProfile
import io
import pstats
import time

import _common as common
from bench_dispatch import _TRUNCATE, _order
from sqlalchemy.orm import sessionmaker


def main() -> None:
    p = common.parser(__doc__, rounds=1)
    p.add_argument("--txns", type=int, default=2000)
    p.add_argument("--batch", action="store_true", help="profile 20 transactions of 100 dispatches instead")
    p.add_argument("--top", type=int, default=35)
    args = p.parse_args()

    import sqla_outbox
    from sqla_outbox import Dispatch

    with common.bench_database(args, "profile_dispatch") as db:
        engine = common.one_connection_engine(db.url)
        installed = sessionmaker(engine)
        sqla_outbox.install(installed, common.settings(db, args.redis_url), catalog=common.catalog())

        def loop(n: int) -> None:
            for i in range(n):
                with installed() as session, session.begin():
                    if args.batch:
                        for k in range(100):
                            session.add(Dispatch(common.TENANT_TASK, common.PAYLOAD, tenant_id=1 + k % 20))
                    else:
                        session.add(_order(i))
                        session.add(Dispatch(common.TENANT_TASK, common.PAYLOAD, tenant_id=1 + i % 20))

        n = 20 if args.batch else args.txns
        loop(n // 4)  # warm-up
        with engine.begin() as conn:
            conn.exec_driver_sql(_TRUNCATE + " RESTART IDENTITY CASCADE")
        cpu, wall = time.process_time(), time.perf_counter()
        loop(n)
        cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
        profile = cProfile.Profile()
        profile.enable()
        loop(n)
        profile.disable()
        engine.dispose()
    print(f"sqla_outbox from {sqla_outbox.__file__}")
    print(f"unprofiled: {1000 * cpu / n:.3f} ms CPU and {1000 * wall / n:.3f} ms wall per transaction")
    for order, restriction in (("tottime", None), ("cumulative", None), ("cumulative", "sqla_outbox")):
        out = io.StringIO()
        stats = pstats.Stats(profile, stream=out).sort_stats(order)
        if restriction:
            print(f"--- functions of {restriction}, by cumulative time")
            stats.print_stats(restriction, args.top)
        else:
            print(f"--- by {order}")
            stats.strip_dirs().print_stats(args.top)
        print(out.getvalue().split("\n", 6)[-1])


if __name__ == "__main__":
    main()
