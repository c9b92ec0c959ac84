"""The three wakes side by side: Valkey, PostgreSQL LISTEN/NOTIFY, the sweep alone.

One process, one run. For each ``wake_mode`` (``valkey``, ``postgres``, ``none``) the
application installs a sessionmaker with that mode and a :class:`~sqla_outbox.relay.Relay`
with the same mode runs in a thread (real listeners, real claim SQL, the real
``SqsSender`` to a moto server, the default ``relay_sweep_interval_seconds`` of 5 s).

Latency (commit → SendMessageBatch)
    ``t0`` just before ``session.commit()`` of a one-dispatch transaction; the end is
    botocore's ``before-send`` event of the relay's SendMessageBatch request. Transactions
    go one at a time with ``--gap-ms`` of idle time between them, so the relay is idle and
    waiting when each lands. The sweep alone gets ``--sweep-txns`` samples (each waits for
    the sweep: about 2.5 s on average).

Dispatch overhead
    Wall time of ``session.add(Dispatch(...))`` + ``commit()`` (flush + the write
    statement + COMMIT; the Valkey LPUSH happens on the waker's thread, after the commit),
    ``--overhead-txns`` per mode, in alternating blocks, with a relay in ``both`` mode
    listening (so the NOTIFY has a listener to signal). The figure is the median and p99
    per mode and the difference to ``none``.

Judged by: the PostgreSQL wake's p50 within 2x of Valkey's and p99 <= 50 ms; its commit
overhead under 0.5 ms at the median.
"""

from __future__ import annotations

import random
import threading
import time
from typing import Any

import _common as common
from sqlalchemy.orm import sessionmaker

MODES = ("valkey", "postgres", "none")


def main() -> None:
    p = common.parser(__doc__, rounds=10)
    p.add_argument("--txns", type=int, default=200, help="latency samples for valkey and postgres")
    p.add_argument("--sweep-txns", type=int, default=20, help="latency samples for the sweep alone")
    p.add_argument("--gap-ms", type=float, default=15.0, help="idle time between transactions")
    p.add_argument("--overhead-txns", type=int, default=2000, help="overhead samples per mode")
    args = p.parse_args()

    import sqla_outbox
    from sqla_outbox import Dispatch
    from sqla_outbox.relay import Relay
    from sqla_outbox.relay.send import SqsSender
    from sqla_outbox.sqs.client import QueueDirectory, make_client

    report = common.Report(
        "bench_wake_modes",
        args,
        {"txns": args.txns, "sweep_txns": args.sweep_txns, "overhead_txns": args.overhead_txns},
    )
    latency: dict[str, list[float]] = {}
    overhead: dict[str, list[float]] = {}
    block_p50: dict[str, list[float]] = {}
    server = common.MotoServer.start()
    try:
        with common.bench_database(args, "bench_wake_modes") as db:
            base = common.settings(db, args.redis_url, sqs_endpoint_url=server.endpoint)
            client = make_client(base, max_pool_connections=10)
            common.provision(client, base)
            hit = threading.Event()
            t_end = [0.0]

            def before_send(**_: Any) -> None:
                if not hit.is_set():
                    t_end[0] = time.perf_counter()
                    hit.set()

            client.meta.events.register("before-send.sqs.SendMessageBatch", before_send)
            engine = common.one_connection_engine(db.url)

            def start_relay(mode: str) -> Relay:
                settings = base.replace(wake_mode=mode)
                sender = SqsSender(client, QueueDirectory(client, settings), settings)
                relay = Relay(settings, sender=sender, engine=common.one_connection_engine(db.url), name=mode)
                relay.start_in_thread()
                _wait(lambda: relay.is_leader, 10)
                time.sleep(1.0)  # first pass over, listeners connected
                return relay

            def sessions(mode: str) -> Any:
                maker = sessionmaker(engine)
                sqla_outbox.install(maker, base.replace(wake_mode=mode), catalog=common.catalog())
                return maker

            # --- latency ---------------------------------------------------------------------
            rng = random.Random(5)
            for mode in MODES:
                maker = sessions(mode)
                relay = start_relay(mode)
                samples = latency.setdefault(mode, [])
                want = args.sweep_txns if mode == "none" else args.txns
                sent_before = relay.counters.sent
                try:
                    for n in range(want + 3):
                        hit.clear()
                        with maker() as session:
                            session.begin()
                            session.add(Dispatch(common.TASK, common.PAYLOAD))
                            session.flush()
                            t0 = time.perf_counter()
                            session.commit()
                        if not hit.wait(15):
                            raise RuntimeError(f"{mode}: the relay did not send within 15 s")
                        if n >= 3:  # warm-up
                            samples.append(t_end[0] - t0)
                        # the pass is over (row marked sent) before the next commit, so a
                        # commit never lands while the relay is still busy with the last one
                        _wait_sent(relay, sent_before + 1)
                        sent_before = relay.counters.sent
                        time.sleep(args.gap_ms / 1000 * rng.uniform(0.8, 1.2))
                    print(f"  latency {mode}: {len(samples)} samples")
                finally:
                    relay.stop()
                    relay.join(15)
                    sqla_outbox.uninstall(maker)

            # --- overhead --------------------------------------------------------------------
            relay = start_relay("both")
            makers = {mode: sessions(mode) for mode in MODES}
            try:
                for mode in MODES:  # warm-up
                    for _ in range(50):
                        _commit_one(makers[mode], Dispatch)
                per_block = max(1, args.overhead_txns // args.rounds)
                for block in range(args.rounds):
                    order = MODES[block % 3 :] + MODES[: block % 3]
                    for mode in order:
                        values = [_commit_one(makers[mode], Dispatch) for _ in range(per_block)]
                        overhead.setdefault(mode, []).extend(values)
                        block_p50.setdefault(mode, []).append(common.median(values) * 1000)
                    print(f"  overhead block {block + 1}/{args.rounds}")
            finally:
                relay.stop()
                relay.join(15)
                for maker in makers.values():
                    sqla_outbox.uninstall(maker)
                engine.dispose()
    finally:
        server.stop()

    rows = []
    for mode in MODES:
        s = common.summary_ms(latency[mode])
        rows.append([mode, s["n"], s["p50_ms"], s["p90_ms"], s["p99_ms"], s["max_ms"]])
        report.results.setdefault(mode, {})["latency"] = s
    report.table(
        "Commit → SendMessageBatch issued by the relay, ms", ["wake", "n", "p50", "p90", "p99", "max"], rows
    )
    rows = []
    for mode in MODES:
        s = common.summary_ms(overhead[mode])
        paired = [a - b for a, b in zip(block_p50[mode], block_p50["none"], strict=True)]
        s["minus_none_p50_ms"] = common.median(paired)
        rows.append([mode, s["n"], s["p50_ms"], s["p99_ms"], s["minus_none_p50_ms"]])
        report.results[mode]["dispatch"] = s
    report.table(
        "Dispatch overhead: add + commit of a one-dispatch transaction, ms "
        "(last column: median over rounds of the round's p50 minus none's)",
        ["wake", "n", "p50", "p99", "p50 - none"],
        rows,
    )
    pg, valkey = report.results["postgres"]["latency"], report.results["valkey"]["latency"]
    ratio = pg["p50_ms"] / valkey["p50_ms"]
    report.ratio("postgres / valkey latency p50", ratio, 2.0, higher_is_better=False)
    report.ratio("postgres latency p99 ms", pg["p99_ms"], 50.0, higher_is_better=False)
    extra = report.results["postgres"]["dispatch"]["minus_none_p50_ms"]
    report.ratio("postgres commit overhead p50 ms", extra, 0.5, higher_is_better=False)
    report.emit()


def _commit_one(maker: Any, dispatch: Any) -> float:
    started = time.perf_counter()
    with maker() as session, session.begin():
        session.add(dispatch(common.TASK, common.PAYLOAD))
    return time.perf_counter() - started


def _wait_sent(relay: Any, total: int) -> None:
    _wait(lambda: relay.counters.sent >= total, 15)


def _wait(predicate: Any, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise RuntimeError("timed out waiting")
        time.sleep(0.001)


if __name__ == "__main__":
    main()
