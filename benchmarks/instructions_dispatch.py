"""Figure 1, noise-free: client-side CPU instructions per transaction, dispatch vs the floor.

    cd benchmarks && ../.venv/bin/python instructions_dispatch.py --txns 300
    # the baseline library: --pythonpath /tmp/snap (git archive main sqla_outbox | tar -x -C /tmp/snap)

On a shared 2-core machine the throughput of ``bench_dispatch.py`` moves by several per
cent from one round to the next, more than what separates dispatch from its floor. This
script counts instead: each side of ``bench_dispatch.py`` (``orm_plain``, ``orm``,
``orm+cte(floor)``, ``orm+dispatch(nowake)``) runs in its own process under Valgrind's callgrind, which counts
the instructions the process executes (this process only: PostgreSQL's work is not in
it). Each side runs twice, with ``--warm`` and with ``--warm + --txns`` transactions, and
the difference divided by ``--txns`` is its instructions per transaction (start-up,
imports and the database set-up cancel out). ``PYTHONHASHSEED=0`` keeps dict and set
layouts the same from run to run; what remains differs by up to about 0.5 % (some
8,000 instructions per transaction) between runs.

Printed: instructions per transaction per side, what the floor and the dispatch add to the
ORM-only transaction, and dispatch / floor in instructions. The wake is left out (its
thread's instructions depend on timing, not on the work); ``bench_dispatch.py`` measures
it. Needs ``valgrind`` on ``PATH``; takes about 45 s per run, two at a time.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import _common as common

SIDES = ("orm_plain", "orm", "orm+cte(floor)", "orm+dispatch(nowake)")


def run_side(side: str, txns: int) -> None:
    """Child mode: ``txns`` single-row transactions of ``side`` on one connection."""
    from bench_dispatch import _order, add_dispatch, floor_cte
    from sqlalchemy.orm import sessionmaker

    import sqla_outbox

    p = common.parser(None, rounds=1)
    args = p.parse_args([])
    with common.bench_database(args, "instructions_dispatch_" + re.sub(r"\W", "_", side)) as db:
        engine = common.one_connection_engine(db.url)
        plain = sessionmaker(engine)
        installed = sessionmaker(engine)
        sqla_outbox.install(installed, common.settings(db, None, wake_mode="none"), catalog=common.catalog())
        factory, extra = {
            "orm_plain": (plain, None),
            "orm": (installed, None),
            "orm+cte(floor)": (plain, floor_cte),
            "orm+dispatch(nowake)": (installed, add_dispatch),
        }[side]
        for i in range(txns):
            with factory() as session, session.begin():
                session.add(_order(i))
                if extra is not None:
                    extra(session, i)
        engine.dispose()


def count(side: str, txns: int, pythonpath: str | None) -> int:
    """Instructions callgrind counts for one child run of ``side``."""
    env = dict(os.environ, PYTHONHASHSEED="0")
    env.pop("PYTHONPATH", None)
    if pythonpath:
        env["PYTHONPATH"] = pythonpath
    done = subprocess.run(
        [
            "valgrind",
            "--tool=callgrind",
            "--callgrind-out-file=/dev/null",
            sys.executable,
            __file__,
            "--child",
            side,
            "--child-txns",
            str(txns),
        ],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    found = re.search(r"Collected\s*:\s*(\d+)", done.stderr)
    if found is None:
        raise RuntimeError(f"callgrind printed no count for {side}:\n{done.stderr[-2000:]}")
    return int(found.group(1))


def main() -> None:
    if "--child" in sys.argv:
        at = sys.argv.index("--child")
        run_side(sys.argv[at + 1], int(sys.argv[sys.argv.index("--child-txns") + 1]))
        return
    p = common.parser(__doc__, rounds=1)
    p.add_argument("--txns", type=int, default=300, help="measured transactions per side (default 300)")
    p.add_argument("--warm", type=int, default=100, help="transactions both runs of a side do (default 100)")
    p.add_argument("--pythonpath", help="import sqla_outbox from here (a baseline snapshot)")
    args = p.parse_args()
    if shutil.which("valgrind") is None:
        sys.exit("instructions_dispatch.py needs valgrind on PATH (apt-get install valgrind)")
    report = common.Report("instructions_dispatch", args, {"txns": args.txns, "warm": args.warm})
    jobs = [(side, n) for side in SIDES for n in (args.warm, args.warm + args.txns)]
    with ThreadPoolExecutor(max_workers=2) as pool:
        counts = list(pool.map(lambda job: count(job[0], job[1], args.pythonpath), jobs))
    total = dict(zip(jobs, counts, strict=True))
    per_txn = {
        side: (total[side, args.warm + args.txns] - total[side, args.warm]) / args.txns for side in SIDES
    }
    orm = per_txn["orm"]
    report.table(
        f"Client-side instructions per transaction ({args.txns} measured, callgrind)",
        ["side", "instructions/txn", "above orm"],
        [[side, per_txn[side], per_txn[side] - orm] for side in SIDES],
    )
    floor, dispatch = per_txn["orm+cte(floor)"], per_txn["orm+dispatch(nowake)"]
    results: dict[str, Any] = {"instructions_per_txn": per_txn}
    report.results = results
    report.ratio("instructions: floor / dispatch (higher is better)", floor / dispatch, None)
    report.ratio(
        "what dispatch adds / what the floor adds (instructions above orm)",
        (dispatch - orm) / (floor - orm),
        None,
        higher_is_better=False,
    )
    report.emit()


if __name__ == "__main__":
    main()
