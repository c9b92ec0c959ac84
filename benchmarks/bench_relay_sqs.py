"""Figure 5 — relay drain through SQS (moto server): relay vs a plain boto3 loop.

One moto server (``python -m moto.server``) serves both sides; its queues are emptied
before each side (moto slows down as a queue deepens, so each side sends into an empty
queue and ends with ``--rows`` messages in it). moto refuses a second PurgeQueue within
60 s, as SQS does, so emptying means a moto reset and the same queues created again.
Each side sends the same ``--rows`` messages (the same envelopes and message
attributes), once per round, rotating order:

``relay``
    :class:`~sqla_outbox.relay.Relay` ``.run()`` in a thread with the real ``SqsSender``
    (SendMessageBatch of 10, ``relay_send_concurrency`` calls in flight, default 4) over
    a fresh backlog of ``--rows`` due rows; from start until SQS accepted every row.
``relay c1``
    the same with ``relay_send_concurrency=1`` (sequential calls, like the plain loop).
``plain loop``
    ``boto3`` ``send_message_batch`` of the same messages, 10 per call, one after the
    other, no database: the floor.

Judged by: relay / plain loop >= 0.9 (issue 3 (b)). The messages in moto are counted
after each side (must equal ``--rows``).
"""

from __future__ import annotations

import time
from typing import Any

import _common as common
import psycopg


def main() -> None:
    p = common.parser(__doc__, rounds=7)
    p.add_argument("--rows", type=int, default=500, help="backlog per side (default 500; keep it small)")
    p.add_argument("--concurrency", type=int, default=4, help="relay_send_concurrency of the relay side")
    p.add_argument("--no-c1", action="store_true", help="skip the relay c1 side")
    args = p.parse_args()

    from sqla_outbox.relay import Relay
    from sqla_outbox.relay.claim import ClaimedRow
    from sqla_outbox.relay.send import SqsSender, build_entry
    from sqla_outbox.sqs.client import QueueDirectory, make_client

    report = common.Report(
        "bench_relay_sqs",
        args,
        {"rounds": args.rounds, "rows": args.rows, "concurrency": args.concurrency},
    )
    with common.moto_server() as server, common.bench_database(args, "bench_relay_sqs") as db:
        st = common.settings(db, None, sqs_endpoint_url=server.endpoint, relay_sweep_interval_seconds=5.0)
        client = make_client(st, max_pool_connections=20)
        plain_client = common.sqs_client(server.endpoint)
        url = common.provision(client, st)["default"]

        # the messages both sides send: built from the backlog's own rows
        common.fill_backlog(db.url, args.rows)
        with psycopg.connect(db.url) as conn:
            rows = conn.execute(
                "SELECT id, run_id, queue, tenant_id, envelope, attempts, available_at "
                "FROM outbox_messages ORDER BY id"
            ).fetchall()
        entries = [build_entry(ClaimedRow("outbox_messages", *r)) for r in rows]
        batches = [
            [
                {"Id": str(i), "MessageBody": e.body, "MessageAttributes": e.attributes}
                for i, e in enumerate(entries[k : k + 10])
            ]
            for k in range(0, len(entries), 10)
        ]

        def check_and_empty() -> None:
            depth = common.queue_depth(client, url)
            if depth != args.rows:
                raise RuntimeError(f"{depth} messages in the queue, expected {args.rows}")
            common.fresh_queues(server.endpoint, client, st)

        def relay_side(concurrency: int) -> float:
            common.truncate_outbox(db.url)
            common.fill_backlog(db.url, args.rows)
            side_settings = st.replace(relay_send_concurrency=concurrency)
            sqs_sender = SqsSender(client, QueueDirectory(client, side_settings), side_settings)
            sqs_sender.directory.url("default")
            sender = common.CountingSender(sqs_sender, args.rows)
            engine = common.one_connection_engine(db.url)
            relay = Relay(side_settings, sender=sender, engine=engine, name="bench")
            started = time.perf_counter()
            relay.start_in_thread()
            if not sender.done.wait(300):
                raise RuntimeError("relay did not drain within 300 s")
            elapsed = time.perf_counter() - started
            relay.stop()
            relay.join(30)
            engine.dispose()
            check_and_empty()
            return args.rows / elapsed

        cpu_per_call: list[float] = []

        def plain_side() -> float:
            started = time.perf_counter()
            cpu = time.process_time()
            for batch in batches:
                response = plain_client.send_message_batch(QueueUrl=url, Entries=batch)
                if response.get("Failed"):
                    raise RuntimeError(f"moto refused {response['Failed']}")
            elapsed = time.perf_counter() - started
            cpu_per_call.append((time.process_time() - cpu) / len(batches))
            check_and_empty()
            return args.rows / elapsed

        sides: dict[str, Any] = {"relay": lambda: relay_side(args.concurrency)}
        if not args.no_c1:
            sides["relay c1"] = lambda: relay_side(1)
        sides["plain loop"] = plain_side
        for side in sides.values():  # warm-up: connections, moto's first requests
            side()
        results = common.alternate(args.rounds, sides)

    med = {name: common.median(values) for name, values in results.items()}
    report.table(
        f"Messages/s into moto (median of {args.rounds}; {args.rows} messages per side per round)",
        ["side", "msgs/s (median)", "min", "max", "vs plain loop"],
        [
            [n, med[n], min(v), max(v), common.paired_ratio(results, n, "plain loop")]
            for n, v in results.items()
        ],
    )
    report.results = {
        "msgs_per_s": results,
        "medians": med,
        "client_cpu_ms_per_send_message_batch": 1000 * common.median(cpu_per_call),
    }
    report.note(
        f"boto3 client CPU per SendMessageBatch call of 10 (plain loop): "
        f"{1000 * common.median(cpu_per_call):.2f} ms"
    )
    report.ratio("relay / plain boto3 loop", common.paired_ratio(results, "relay", "plain loop"), 0.9)
    if "relay c1" in med:
        report.ratio(
            "relay c1 / plain boto3 loop", common.paired_ratio(results, "relay c1", "plain loop"), None
        )
    report.emit()


if __name__ == "__main__":
    main()
