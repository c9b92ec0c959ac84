"""The wake's cost in the application process: one-dispatch transactions with the old and
the new ``Waker`` side by side in one process (issue 17, part 4).

    cd benchmarks && ../.venv/bin/python bench_wake_cost.py --baseline main --rounds 12 --txns 300

Sides, alternating each round (order rotating), ``--txns`` transactions each, one
connection, each transaction one ORM row + one ``Dispatch``:

``orm``                the ORM row alone (listeners installed): the denominator;
``dispatch, wake (this tree)``   the real Valkey wake with this tree's ``Waker``;
``dispatch, wake (baseline)``    the same with ``sqla_outbox/wakeup.py`` of ``--baseline``
                                 (loaded from ``git show``), everything else identical;
``dispatch, no wake``            ``valkey_url=None`` and ``wake_mode="none"`` (no LPUSH, no NOTIFY);
``floor``              the same two rows by one hand-written statement (``bench_dispatch.py``).

Reported: each side's txn/s, and per round ((no wake) - (wake)) / orm for both wakers:
the share of the ORM-only rate the wake costs, and dispatch / floor.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import _common as common
from bench_dispatch import _TRUNCATE, _order, add_dispatch, floor_cte
from sqlalchemy.orm import sessionmaker


def _baseline_wakeup(ref: str) -> Any:
    source = subprocess.run(
        ["git", "show", f"{ref}:sqla_outbox/wakeup.py"],
        cwd=common.ROOT,
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    path = Path(tempfile.mkdtemp()) / "baseline_wakeup.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("baseline_wakeup", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["baseline_wakeup"] = module
    spec.loader.exec_module(module)
    return module


def main() -> None:
    p = common.parser(__doc__, rounds=12)
    p.add_argument("--txns", type=int, default=300)
    p.add_argument("--baseline", default="main")
    args = p.parse_args()

    import sqla_outbox

    old = _baseline_wakeup(args.baseline)
    report = common.Report(
        "bench_wake_cost", args, {"rounds": args.rounds, "txns": args.txns, "baseline": args.baseline}
    )
    with common.bench_database(args, "bench_wake_cost") as db:
        engine = common.one_connection_engine(db.url)
        cat = common.catalog()
        new_wake, old_wake, no_wake, plain = (sessionmaker(engine) for _ in range(4))
        sqla_outbox.install(new_wake, common.settings(db, args.redis_url), catalog=cat)
        installation = sqla_outbox.install(old_wake, common.settings(db, args.redis_url), catalog=cat)
        installation.waker.close()
        installation.waker = old.Waker(installation.settings)
        sqla_outbox.install(no_wake, common.settings(db, None, wake_mode="none"), catalog=cat)

        def single(factory: Any, dispatch: bool = True, floor: bool = False) -> float:
            with engine.begin() as conn:
                conn.exec_driver_sql(_TRUNCATE + " RESTART IDENTITY CASCADE")
            started = time.perf_counter()
            for i in range(args.txns):
                with factory() as session, session.begin():
                    session.add(_order(i))
                    if dispatch:
                        add_dispatch(session, i)
                    if floor:
                        floor_cte(session, i)
            return args.txns / (time.perf_counter() - started)

        sides = {
            "orm": lambda: single(new_wake, dispatch=False),
            "dispatch, wake (this tree)": lambda: single(new_wake),
            "dispatch, wake (baseline)": lambda: single(old_wake),
            "dispatch, no wake": lambda: single(no_wake),
            "floor": lambda: single(plain, dispatch=False, floor=True),
        }
        for side in sides.values():
            side()
        results = common.alternate(args.rounds, sides)
        engine.dispose()
    med = {n: common.median(v) for n, v in results.items()}
    report.table(
        f"one-dispatch transactions, txn/s (median of {args.rounds})",
        ["side", "txn/s", "min", "max", "vs orm"],
        [[n, med[n], min(v), max(v), common.paired_ratio(results, n, "orm")] for n, v in results.items()],
    )

    def share(wake: str) -> float:
        return common.median(
            [
                (n - w) / o
                for n, w, o in zip(results["dispatch, no wake"], results[wake], results["orm"], strict=True)
            ]
        )

    report.ratio(
        "the wake's cost / orm, this tree", share("dispatch, wake (this tree)"), None, higher_is_better=False
    )
    report.ratio(
        "the wake's cost / orm, baseline", share("dispatch, wake (baseline)"), None, higher_is_better=False
    )
    report.ratio(
        "dispatch / floor, this tree's wake",
        common.paired_ratio(results, "dispatch, wake (this tree)", "floor"),
        0.95,
    )
    report.ratio(
        "dispatch / floor, baseline's wake",
        common.paired_ratio(results, "dispatch, wake (baseline)", "floor"),
        None,
    )
    report.ratio(
        "dispatch without wake / floor", common.paired_ratio(results, "dispatch, no wake", "floor"), None
    )
    report.results = {"txn_per_s": results}
    report.emit()


if __name__ == "__main__":
    main()
