"""Figure 2 — wake latency: commit → SendMessageBatch issued by the relay, p50/p99.

One process. A :class:`~sqla_outbox.relay.Relay` runs in a thread (real wake listener
on Redis BLPOP, real claim SQL on PostgreSQL, ``relay_sweep_interval_seconds=5``); the
main thread commits single-dispatch transactions one at a time with ``--gap-ms`` of
idle time between them (so the relay is idle and waiting when each commit lands) and
waits for the relay to send that run.

``t0`` is taken just before ``session.commit()`` (the COMMIT round trip and the after-
commit LPUSH are inside the measured time; the commit's own duration is reported
separately). The end is:

``outbox (accept-all)``
    entry into the relay's ``Sender.send`` (an accept-everything sender): the moment the
    relay would issue SendMessageBatch.
``outbox (moto)``
    botocore's ``before-send`` event of the SendMessageBatch HTTP request from the real
    ``SqsSender`` to a moto server (issue 3 (a)); moto is reset every 50 messages.
    ``accepted`` is when that call returned.
``pgqueuer``
    entry into a no-op pgqueuer entrypoint (QueueManager with LISTEN/NOTIFY, asyncpg, in
    its own thread); ``t0`` before ``Queries.enqueue`` on an autocommit connection
    (pgqueuer cannot join an application transaction).
``procrastinate``
    entry into a no-op procrastinate task (async worker, LISTEN/NOTIFY, in its own
    thread); ``t0`` before ``commit()`` of a SQLAlchemy transaction that deferred the job
    on the Session's connection.

Sides alternate in blocks of ``txns / rounds``; every side gets ``--txns`` samples.
Judged by: outbox p50 <= 3 ms and p99 <= 20 ms, and below the peers' commit → handler
start (which includes their fetch, where ours stops at the send).
"""

from __future__ import annotations

import random
import threading
import time
from typing import Any

import _common as common
from sqlalchemy.orm import sessionmaker


class Recorder:
    """Collects the end timestamp of the one run in flight."""

    def __init__(self) -> None:
        self.event = threading.Event()
        self.t_end = 0.0
        self.t_accepted = 0.0
        self.armed = False

    def arm(self) -> None:
        self.event.clear()
        self.t_end = self.t_accepted = 0.0
        self.armed = True

    def hit(self, t: float | None = None) -> None:
        if self.armed and not self.t_end:
            self.t_end = time.perf_counter() if t is None else t
            self.event.set()


class SwitchSender:
    """Relay sender that either accepts everything (timestamp at entry) or sends to moto."""

    def __init__(self, recorder: Recorder, sqs_sender: Any) -> None:
        self.recorder = recorder
        self.sqs_sender = sqs_sender
        self.mode = "accept"
        self.sent_to_moto = 0

    def send(self, rows: Any) -> Any:
        if self.mode == "accept":
            self.recorder.hit()
            from sqla_outbox.relay.send import SendResult

            return SendResult(sent=list(rows))
        result = self.sqs_sender.send(rows)
        self.recorder.t_accepted = time.perf_counter()
        self.sent_to_moto += len(result.sent)
        return result

    def close(self) -> None:
        self.sqs_sender.close()


def main() -> None:
    p = common.parser(__doc__, rounds=5)
    p.add_argument("--txns", type=int, default=250, help="samples per side (default 250; >= 200)")
    p.add_argument("--gap-ms", type=float, default=15.0, help="idle time between transactions")
    p.add_argument("--no-peers", action="store_true", help="skip pgqueuer and procrastinate")
    p.add_argument("--no-moto", action="store_true", help="skip the moto side")
    args = p.parse_args()

    import sqla_outbox
    from sqla_outbox import Dispatch
    from sqla_outbox.relay import Relay
    from sqla_outbox.relay.send import SqsSender
    from sqla_outbox.sqs.client import QueueDirectory, make_client

    report = common.Report(
        "bench_wake", args, {"txns": args.txns, "rounds": args.rounds, "gap_ms": args.gap_ms}
    )
    server = None if args.no_moto else common.MotoServer.start()
    try:
        with common.bench_database(args, "bench_wake") as db:
            endpoint = server.endpoint if server else None
            st = common.settings(
                db, args.redis_url, relay_sweep_interval_seconds=5.0, sqs_endpoint_url=endpoint
            )
            engine = common.one_connection_engine(db.url)
            app_sessions = sessionmaker(engine)
            sqla_outbox.install(app_sessions, st, catalog=common.catalog())
            recorder = Recorder()
            sqs_sender = None
            queue_url = None
            client = None
            if server:
                client = make_client(st, max_pool_connections=10)
                queue_url = common.provision(client, st)["default"]

                def before_send(**_: Any) -> None:
                    recorder.hit()

                client.meta.events.register("before-send.sqs.SendMessageBatch", before_send)
                sqs_sender = SqsSender(client, QueueDirectory(client, st), st)
                sqs_sender.directory.url("default")
            sender = SwitchSender(recorder, sqs_sender)
            relay = Relay(st, sender=sender, engine=common.one_connection_engine(db.url), name="bench")
            relay.start_in_thread()
            _wait(lambda: relay.is_leader, 10)
            time.sleep(0.3)

            samples: dict[str, list[float]] = {}
            after_commit: dict[str, list[float]] = {}
            commit_ms: dict[str, list[float]] = {}
            accepted: list[float] = []

            def outbox_one(mode: str) -> None:
                sender.mode = mode
                recorder.arm()
                with app_sessions() as session:
                    session.begin()
                    session.add(Dispatch(common.TASK, common.PAYLOAD))
                    session.flush()
                    t0 = time.perf_counter()
                    session.commit()
                    t1 = time.perf_counter()
                if not recorder.event.wait(10):
                    raise RuntimeError("relay did not send within 10 s")
                name = f"outbox ({'accept-all' if mode == 'accept' else 'moto'})"
                samples.setdefault(name, []).append(recorder.t_end - t0)
                after_commit.setdefault(name, []).append(recorder.t_end - t1)
                commit_ms.setdefault(name, []).append(t1 - t0)
                if mode == "moto":
                    _wait(lambda: recorder.t_accepted > 0, 10)
                    accepted.append(recorder.t_accepted - t0)
                    assert client is not None and queue_url is not None
                    if sender.sent_to_moto % 50 == 0:
                        common.fresh_queues(endpoint, client, st)

            sides: dict[str, Any] = {"outbox (accept-all)": lambda: outbox_one("accept")}
            if server:
                sides["outbox (moto)"] = lambda: outbox_one("moto")

            stoppers: list[Any] = []
            if not args.no_peers:
                import _peers

                _peers.install_pgqueuer(db.url)
                _peers.install_procrastinate(db.url)
                pgq = _peers.PgqWorker(db.url, on_job=lambda: recorder.hit()).start()
                stoppers.append(pgq.stop)
                enqueuer = _peers.PgqEnqueuer(db.url)
                stoppers.append(enqueuer.close)
                proc_worker = _peers.ProcrastinateWorker(db.url, on_job=lambda _kw: recorder.hit()).start()
                stoppers.append(proc_worker.stop)
                proc_app = _peers.procrastinate_app(db.url)
                plain_sessions = sessionmaker(engine)

                def pgq_one() -> None:
                    recorder.arm()
                    t0 = time.perf_counter()
                    enqueuer.enqueue()
                    t1 = time.perf_counter()
                    if not recorder.event.wait(10):
                        raise RuntimeError("pgqueuer did not start the job within 10 s")
                    samples.setdefault("pgqueuer", []).append(recorder.t_end - t0)
                    after_commit.setdefault("pgqueuer", []).append(recorder.t_end - t1)
                    commit_ms.setdefault("pgqueuer", []).append(t1 - t0)

                def procrastinate_one() -> None:
                    recorder.arm()
                    with plain_sessions() as session:
                        session.begin()
                        raw = session.connection().connection.driver_connection
                        _peers.procrastinate_defer(proc_app, raw, **common.PAYLOAD)
                        t0 = time.perf_counter()
                        session.commit()
                        t1 = time.perf_counter()
                    if not recorder.event.wait(10):
                        raise RuntimeError("procrastinate did not start the job within 10 s")
                    samples.setdefault("procrastinate", []).append(recorder.t_end - t0)
                    after_commit.setdefault("procrastinate", []).append(recorder.t_end - t1)
                    commit_ms.setdefault("procrastinate", []).append(t1 - t0)

                sides["pgqueuer"] = pgq_one
                sides["procrastinate"] = procrastinate_one

            try:
                rng = random.Random(8)
                gap = args.gap_ms / 1000
                for side in sides.values():  # warm-up, not recorded below
                    for _ in range(5):
                        side()
                        time.sleep(gap)
                samples.clear()
                after_commit.clear()
                commit_ms.clear()
                accepted.clear()
                per_block = max(1, args.txns // args.rounds)
                names = list(sides)
                block = 0
                while min((len(samples.get(n, [])) for n in names), default=0) < args.txns:
                    order = names[block % len(names) :] + names[: block % len(names)]
                    for name in order:
                        for _ in range(min(per_block, args.txns - len(samples.get(name, [])))):
                            sides[name]()
                            time.sleep(gap * rng.uniform(0.8, 1.2))
                    block += 1
                    print(f"  block {block}: " + ", ".join(f"{n}={len(samples.get(n, []))}" for n in names))
            finally:
                relay.stop()
                relay.join(15)
                for stop in stoppers:
                    stop()
                engine.dispose()
    finally:
        if server:
            server.stop()

    rows = []
    for name, values in samples.items():
        s = common.summary_ms(values)
        a = common.summary_ms(after_commit[name])
        c = common.summary_ms(commit_ms[name])
        rows.append(
            [name, s["n"], s["p50_ms"], s["p90_ms"], s["p99_ms"], s["max_ms"], a["p50_ms"], c["p50_ms"]]
        )
        report.results[name] = {"from_commit_start": s, "from_commit_return": a, "commit": c}
    if accepted:
        report.results["outbox (moto)"]["accepted"] = common.summary_ms(accepted)
        s = common.summary_ms(accepted)
        rows.append(
            [
                "outbox (moto), call returned",
                s["n"],
                s["p50_ms"],
                s["p90_ms"],
                s["p99_ms"],
                s["max_ms"],
                None,
                None,
            ]
        )
    report.table(
        "Commit → send issued (outbox) / handler start (peers), ms",
        ["side", "n", "p50", "p90", "p99", "max", "p50 after commit returned", "commit p50"],
        rows,
    )
    ours = report.results["outbox (accept-all)"]["from_commit_start"]
    report.ratio("wake p50 ms (accept-all)", ours["p50_ms"], 3.0, higher_is_better=False)
    report.ratio("wake p99 ms (accept-all)", ours["p99_ms"], 20.0, higher_is_better=False)
    if "outbox (moto)" in report.results:
        moto = report.results["outbox (moto)"]["from_commit_start"]
        report.ratio("wake p50 ms (moto, issued)", moto["p50_ms"], 3.0, higher_is_better=False)
        report.ratio("wake p99 ms (moto, issued)", moto["p99_ms"], 20.0, higher_is_better=False)
    for peer in ("pgqueuer", "procrastinate"):
        if peer in report.results:
            theirs = report.results[peer]["from_commit_start"]["p50_ms"]
            report.ratio(f"p50 outbox / {peer}", ours["p50_ms"] / theirs, 1.0, higher_is_better=False)
    report.emit()


def _wait(predicate: Any, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise RuntimeError("timed out waiting")
        time.sleep(0.001)


if __name__ == "__main__":
    main()
