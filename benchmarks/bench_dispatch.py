"""Figure 1 — dispatch overhead: what a ``Dispatch`` adds to the application's transaction.

Everything runs on ONE database connection (an engine with a pool of one), in one
process, each side once per round in rotating order (without ``--block``; see below),
``--rounds`` rounds (short sides,
many rounds: a load burst from other work then hits few rounds). A side's figure is the
median over rounds of its transactions per second; a ratio is the median over rounds of
the ratio within each round.

Single-row sides (``--txns`` transactions each, one ``session.begin()`` ... commit each):

``orm_plain``
    one application ORM row (``bench_orders``), on a sessionmaker WITHOUT sqla_outbox
    listeners: the floor.
``orm``
    the same on the sessionmaker WITH the listeners installed (what every transaction of
    an installed application pays, dispatch or not). This is the figure's denominator.
``orm+dispatch``
    the ORM row plus ``session.add(Dispatch(tenant task, payload, tenant_id=...))``:
    the listeners write the ``task_runs`` row and the ``outbox_messages`` row in one
    statement at flush, and after commit one LPUSH wakes the relay (real Redis).
``orm+dispatch(nowake)``
    the same with ``valkey_url=None`` and ``wake_mode="none"`` (no LPUSH, no NOTIFY), to
    separate the wake's share. (Before, ``wake_mode`` stayed ``auto``, which without a
    Valkey URL is the PostgreSQL wake: this side carried a NOTIFY.)
``orm+cte(floor)``
    the ORM row plus the same two rows (``task_runs`` and ``outbox_messages``, the same
    envelope) written by ONE hand-written scalar statement (``WITH runs AS (INSERT ...
    RETURNING ...) INSERT ...``) on the Session's connection, no listeners, no wake: the
    physical floor of "one extra statement writing both rows".
``orm+procrastinate``
    the ORM row plus procrastinate's ``defer`` of a no-op task on the Session's own
    psycopg connection (``task.configure(connection=...).defer(...)``), so the job row
    commits with the ORM row.

Judged by: ``orm+dispatch / orm >= 0.70`` and ``orm+dispatch / orm+procrastinate >= 1.25``.

Batch sides (``--batch-txns`` transactions of ``--batch`` runs each):

``dispatch x100``
    one transaction adding 100 ``Dispatch`` objects (one multi-row statement at flush).
``executemany x100``
    one transaction inserting the same 100 ``task_runs`` rows and 100 ``outbox_messages``
    rows (envelopes built with ``json.dumps``) by hand with two ``executemany`` calls:
    the floor for writing those rows. Reported as runs/s; ratio dispatch / executemany.

Without ``--block``, each side starts from truncated tables (not timed). PostgreSQL runs
with its stock settings (``synchronous_commit=on``), so every commit waits for a WAL flush.

``--block N`` interleaves the single-row sides more finely: a round truncates once, then
runs every side ``N`` transactions at a time until each has run ``--txns``; a side's
figure is its transactions over the time its own blocks took. The side that starts a
cycle of blocks moves on by one at every cycle, across rounds, so every side starts
equally often over the run (within a round only when the number of blocks is a multiple
of the number of sides). After each block the waker's pending push is waited for, untimed
(as the truncate between whole sides does), so a dispatch block's last wake is not charged
to the side after it. On a machine whose commit time wanders from one second to the next,
a side measured in one piece of half a second to a second meets a slow or a fast stretch
alone: the medians of 5 per-round ratios scattered from 0.73 to 1.12 for the same code
(an A/B run of 2026-12-02, ``benchmarks/results/issue17/ab_dispatch_floor_10.json`` at
commit bc6b34f); in blocks of 10 every stretch is shared by all sides. The default, 0, runs
each side in one piece, as before. ``N`` larger than ``--txns`` is taken as ``--txns`` (and
recorded so).

With ``--block``, a side whose block follows an idle gap (the round's truncate, or the
wait for the waker's last push after a dispatch block, 10 ms or more) first runs
``--warm`` untimed transactions (default 5). On this 2-vCPU virtual machine the
transactions after an idle gap of some milliseconds run slow, the first up to three times
the rest, over about four transactions (per-position medians over the 400 blocks of
each side in 20 rounds: docs/benchmarks.md#dispatch). Without the warm-up, that cost fell on
the side after the dispatch side, always ``orm+dispatch(nowake)``: it read 5 to 10 %
slower than the side with the wake, and the wake's cost came out negative.
``--positions`` prints each side's median time of the first, second, ... transaction of
its blocks, which shows both effects.

With ``--block`` of 3 or more, ``dispatch / floor`` is also reported over each block
from its third transaction on (every side alike). A block of dispatches begins a burst of
the waker (its thread wakes from its queue, the first commit is pushed at once), which
costs the block's first two transactions about 0.2 ms each here; a sustained stream of
dispatches is one burst, pushed once per 10 ms, so blocks of 10 charge dispatch a burst
start that sustained dispatching pays once (docs/benchmarks.md#dispatch).
"""

from __future__ import annotations

import json
import time
import uuid
from itertools import zip_longest
from typing import Any

import _common as common
import sqlalchemy as sa
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column, sessionmaker

from sqla_outbox import Dispatch

_TRUNCATE = "TRUNCATE bench_orders, outbox_messages, platform_outbox_messages, task_runs, task_run_trail"


class Base(DeclarativeBase):
    pass


class Order(Base):
    __tablename__ = "bench_orders"
    id: Mapped[int] = mapped_column(sa.BigInteger, sa.Identity(always=True), primary_key=True)
    tenant_id: Mapped[int] = mapped_column(sa.BigInteger)
    customer: Mapped[str] = mapped_column(sa.Text)
    amount: Mapped[float] = mapped_column(sa.Numeric(12, 2))


def _order(i: int) -> Order:
    return Order(tenant_id=1 + i % common.TENANTS, customer=f"customer {i}", amount=12.5)


_FLOOR_CTE = sa.text(
    "WITH runs AS (INSERT INTO task_runs (run_id, task, queue, tenant_id, available_at) "
    "VALUES (:run_id, :task, 'default', :tenant_id, clock_timestamp()) RETURNING run_id, available_at) "
    "INSERT INTO outbox_messages (tenant_id, run_id, queue, envelope, available_at) "
    "SELECT :tenant_id, run_id, 'default', CAST(:envelope AS jsonb), available_at FROM runs"
)
_RUN_INSERT = sa.text(
    "INSERT INTO task_runs (run_id, task, queue, tenant_id, available_at) "
    "VALUES (:run_id, :task, 'default', :tenant_id, clock_timestamp())"
)
_OUTBOX_INSERT = sa.text(
    "INSERT INTO outbox_messages (tenant_id, run_id, queue, envelope, available_at) "
    "VALUES (:tenant_id, :run_id, 'default', CAST(:envelope AS jsonb), clock_timestamp())"
)


_PAYLOAD_JSON = json.dumps(common.PAYLOAD, separators=(",", ":"))


def _floor_row(run_id: uuid.UUID, tenant: int) -> dict[str, Any]:
    """The floor's parameters for one run: the same envelope a dispatch stores."""
    envelope = {
        "v": 1,
        "run_id": str(run_id),
        "task": common.TENANT_TASK,
        "queue": "default",
        "tenant_id": tenant,
        "event": None,
        "idempotency_key": None,
        "payload": _PAYLOAD_JSON,
    }
    return {
        "run_id": run_id,
        "task": common.TENANT_TASK,
        "tenant_id": tenant,
        "envelope": json.dumps(envelope, separators=(",", ":")),
    }


def floor_cte(session: Session, i: int) -> None:
    """The floor: the run and outbox rows by one hand-written statement on the session's
    connection (no listeners, no wake)."""
    session.connection().execute(_FLOOR_CTE, _floor_row(uuid.uuid4(), 1 + i % common.TENANTS))


def add_dispatch(session: Session, i: int) -> None:
    """What the dispatch sides add to the ORM row: one tenant ``Dispatch``."""
    session.add(Dispatch(common.TENANT_TASK, common.PAYLOAD, tenant_id=1 + i % common.TENANTS))


Blocks = list[list[float]]
"""One side's blocks of one round: the seconds of each transaction of each block."""


def _rate(blocks: Blocks) -> float:
    """Transactions per second over ``blocks``."""
    return sum(map(len, blocks)) / sum(map(sum, blocks))


def _by_position(rounds: list[Blocks]) -> list[list[float]]:
    """The seconds of the 1st, 2nd, ... transaction of every block of every round."""
    every = (block for blocks in rounds for block in blocks)
    return [[t for t in seconds if t is not None] for seconds in zip_longest(*every)]


def main() -> None:
    p = common.parser(__doc__, rounds=11)
    p.add_argument(
        "--txns", type=common.positive_int, default=200, help="transactions per side per round (default 200)"
    )
    p.add_argument(
        "--batch", type=common.positive_int, default=100, help="runs per batch transaction (default 100)"
    )
    p.add_argument(
        "--batch-txns",
        type=common.positive_int,
        default=10,
        help="batch transactions per side per round (default 10)",
    )
    p.add_argument("--no-peers", action="store_true", help="skip procrastinate")
    p.add_argument(
        "--block",
        type=int,
        default=0,
        help="interleave the single-row sides N transactions at a time (default 0: each side in one piece)",
    )
    p.add_argument(
        "--positions",
        action="store_true",
        help="with --block: also print the median time of the 1st, 2nd, ... transaction of a side's blocks",
    )
    p.add_argument(
        "--warm",
        type=int,
        default=5,
        help="with --block: untimed transactions a side runs first after an idle gap (default 5)",
    )
    args = p.parse_args()
    if args.block < 0:
        p.error("--block must be 0 (whole sides) or a number of transactions")
    if args.warm < 0:
        p.error("--warm must be 0 or more")
    if not args.block and args.positions:
        p.error("--positions needs --block (it reports the n-th transaction of each block)")
    if not args.block:
        args.warm = 0  # whole sides start after a truncate, as before; recorded so
    args.block = min(args.block, args.txns)

    import sqla_outbox

    report = common.Report(
        "bench_dispatch",
        args,
        {
            "rounds": args.rounds,
            "txns": args.txns,
            "batch": args.batch,
            "batch_txns": args.batch_txns,
            "block": args.block,
            "warm": args.warm,
        },
    )
    with common.bench_database(args, "bench_dispatch") as db:
        engine = common.one_connection_engine(db.url)
        plain = sessionmaker(engine)
        installed = sessionmaker(engine)
        nowake = sessionmaker(engine)
        cat = common.catalog()
        sqla_outbox.install(installed, common.settings(db, args.redis_url), catalog=cat)
        sqla_outbox.install(nowake, common.settings(db, None, wake_mode="none"), catalog=cat)
        installation = sqla_outbox.installation_for(installed)
        assert installation is not None
        waker = installation.waker
        peers = not args.no_peers
        app: Any = None
        if peers:
            import _peers

            _peers.install_procrastinate(db.url)
            app = _peers.procrastinate_app(db.url)

        def truncate() -> None:
            with engine.begin() as conn:
                conn.exec_driver_sql(
                    _TRUNCATE + (", procrastinate_jobs" if peers else "") + " RESTART IDENTITY CASCADE"
                )

        def txns(factory: sessionmaker[Session], extra: Any, first: int, n: int) -> list[float]:
            """Run ``n`` single-row transactions; the seconds each took."""
            took = []
            last = time.perf_counter()
            for i in range(first, first + n):
                with factory() as session, session.begin():
                    session.add(_order(i))
                    if extra is not None:
                        extra(session, i)
                now = time.perf_counter()
                took.append(now - last)
                last = now
            return took

        def single(factory: sessionmaker[Session], extra: Any = None) -> float:
            truncate()
            return args.txns / sum(txns(factory, extra, 0, args.txns))

        def defer(session: Session, i: int) -> None:
            raw = session.connection().connection.driver_connection
            _peers.procrastinate_defer(app, raw, **common.PAYLOAD)

        def dispatch_batch() -> float:
            truncate()
            started = time.perf_counter()
            for t in range(args.batch_txns):
                with installed() as session, session.begin():
                    for i in range(args.batch):
                        session.add(
                            Dispatch(
                                common.TENANT_TASK, common.PAYLOAD, tenant_id=1 + (t + i) % common.TENANTS
                            )
                        )
            return args.batch * args.batch_txns / (time.perf_counter() - started)

        def executemany_batch() -> float:
            truncate()
            started = time.perf_counter()
            for t in range(args.batch_txns):
                rows = []
                for i in range(args.batch):
                    run_id = uuid.uuid4()
                    tenant = 1 + (t + i) % common.TENANTS
                    rows.append(_floor_row(run_id, tenant))
                with engine.begin() as conn:
                    conn.execute(_RUN_INSERT, rows)
                    conn.execute(_OUTBOX_INSERT, rows)
            return args.batch * args.batch_txns / (time.perf_counter() - started)

        def interleaved(steps: dict[str, tuple[sessionmaker[Session], Any]]) -> dict[str, list[Blocks]]:
            """``--block``: each round, every side ``args.block`` transactions at a time.
            Returns per side, per round, the seconds of each transaction of each block."""
            names = list(steps)
            out: dict[str, list[Blocks]] = {name: [] for name in names}
            cycle = 0  # which side starts: moves on by one per cycle, across rounds
            for r in range(args.rounds):
                truncate()
                idle = True  # the truncate waited on PostgreSQL
                blocks: dict[str, Blocks] = {name: [] for name in names}
                done = 0
                while done < args.txns:
                    n = min(args.block, args.txns - done)
                    k = cycle % len(names)
                    cycle += 1
                    for name in names[k:] + names[:k]:
                        if idle and args.warm:  # untimed: the machine comes out of an idle gap
                            txns(*steps[name], args.txns + done, args.warm)
                        blocks[name].append(txns(*steps[name], done, n))
                        waited = time.perf_counter()
                        waker.drain(1.0)  # untimed: the block's last wake is its own
                        idle = time.perf_counter() - waited > 0.002
                    done += n
                for name in names:
                    out[name].append(blocks[name])
                    print(f"  round {r + 1}/{args.rounds} {name}: {_rate(blocks[name]):,.1f}", flush=True)
            return out

        steps: dict[str, tuple[sessionmaker[Session], Any]] = {
            "orm_plain": (plain, None),
            "orm": (installed, None),
            "orm+dispatch": (installed, add_dispatch),
            "orm+dispatch(nowake)": (nowake, add_dispatch),
            "orm+cte(floor)": (plain, floor_cte),
        }
        if peers:
            steps["orm+procrastinate"] = (plain, defer)
        # warm-up (connection, statement caches, JIT-free but cache-warm)
        for factory, extra in steps.values():
            single(factory, extra)
        print("single-row transactions (txn/s):", flush=True)
        timed: dict[str, list[Blocks]] = {}
        if args.block > 0:
            timed = interleaved(steps)
            singles = {name: [_rate(blocks) for blocks in rounds] for name, rounds in timed.items()}
        else:
            singles = common.alternate(
                args.rounds, {name: (lambda step=step: single(*step)) for name, step in steps.items()}
            )
        print("batches (runs/s):", flush=True)
        dispatch_batch()
        executemany_batch()
        batches = common.alternate(
            args.rounds, {"dispatch x100": dispatch_batch, "executemany x100": executemany_batch}
        )

        # sanity: the last dispatch side really wrote its rows
        with engine.connect() as conn:
            outbox = conn.exec_driver_sql("SELECT count(*) FROM outbox_messages").scalar_one()
        report.note(f"rows in outbox_messages after the last batch side: {outbox}")
        engine.dispose()

    med = {name: common.median(values) for name, values in singles.items()}
    rows = [
        [
            name,
            med[name],
            min(values),
            max(values),
            common.paired_ratio(singles, name, "orm"),
            1000 / med[name],
        ]
        for name, values in singles.items()
    ]
    report.table(
        f"Single-row transactions, one connection ({args.txns} txns/side/round"
        + (f" in blocks of {args.block}" if args.block else "")
        + f", median of {args.rounds})",
        ["side", "txn/s (median)", "min", "max", "vs orm", "ms/txn"],
        rows,
    )
    # each block from its third transaction on (--block 3 or more): past the burst start
    steady = {
        name: [_rate([block[2:] for block in blocks]) for blocks in rounds]
        for name, rounds in timed.items()
        if args.block >= 3
    }
    if args.positions:
        report.table(
            "Median microseconds of the n-th transaction of a block (--positions)",
            ["side", *(str(n + 1) for n in range(args.block))],
            [
                [name, *(common.median(seconds) * 1e6 for seconds in _by_position(rounds))]
                for name, rounds in timed.items()
            ],
        )
    bmed = {name: common.median(values) for name, values in batches.items()}
    report.table(
        f"{args.batch} runs per transaction ({args.batch_txns} txns/side/round)",
        ["side", "runs/s (median)", "min", "max", "txn/s"],
        [[n, bmed[n], min(v), max(v), bmed[n] / args.batch] for n, v in batches.items()],
    )
    report.results = {
        "single_txn_per_s": singles,
        "batch_runs_per_s": batches,
        "medians": med | bmed,
        "single_txn_per_s_from_3rd": steady,
    }
    pr = common.paired_ratio
    report.ratio("dispatch: (orm+dispatch) / orm", pr(singles, "orm+dispatch", "orm"), 0.70)
    if "orm+procrastinate" in med:
        report.ratio(
            "dispatch vs procrastinate defer", pr(singles, "orm+dispatch", "orm+procrastinate"), 1.25
        )
    report.ratio("floor: (orm+cte) / orm", pr(singles, "orm+cte(floor)", "orm"), None)
    report.ratio(
        "dispatch / floor: (orm+dispatch) / (orm+cte)", pr(singles, "orm+dispatch", "orm+cte(floor)"), 0.95
    )
    report.ratio(
        "dispatch without a wake / floor: (orm+dispatch nowake) / (orm+cte)",
        pr(singles, "orm+dispatch(nowake)", "orm+cte(floor)"),
        None,
    )
    if steady:
        report.ratio(
            "dispatch / floor, each block from its 3rd transaction on",
            pr(steady, "orm+dispatch", "orm+cte(floor)"),
            None,
            note="a block of dispatches starts a burst of the waker; sustained dispatching is one burst",
        )
        report.ratio(
            "dispatch without a wake / floor, each block from its 3rd transaction on",
            pr(steady, "orm+dispatch(nowake)", "orm+cte(floor)"),
            None,
        )
    report.ratio(
        "the wake's cost: ((orm+dispatch nowake) - (orm+dispatch)) / orm",
        common.median(
            [
                (w - d) / o
                for w, d, o in zip(
                    singles["orm+dispatch(nowake)"], singles["orm+dispatch"], singles["orm"], strict=True
                )
            ]
        ),
        None,
        higher_is_better=False,
    )
    report.ratio("listeners installed, no dispatch: orm / orm_plain", pr(singles, "orm", "orm_plain"), None)
    report.ratio("dispatch x100 / executemany x100", pr(batches, "dispatch x100", "executemany x100"), 0.85)
    report.emit()


if __name__ == "__main__":
    main()
