"""What the AWS-strict SQS layer (tests/strict_sqs.py) costs, against plain moto.

Two moto servers run side by side: plain moto (``python -m sqla_outbox.moto_server``) and
moto behind the strict layer (``python -m tests.strict_sqs``), which every test, the chaos
run and the other benchmarks use. Each side runs ``--cycles`` cycles per round of what a
worker and a relay do to one queue: SendMessageBatch of 10 envelopes (the relay's bodies
and attributes), ReceiveMessage of up to 10 (with the attributes the worker asks for),
ChangeMessageVisibilityBatch of those (a heartbeat), DeleteMessageBatch of those (the acks).
Rounds alternate the sides.

Judged by: strict / plain >= 0.8 messages/s (the layer reads every request once and
parses receive answers; moto's own work dominates).
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

import _common as common

from tests.support import MotoServer


def main() -> None:
    p = common.parser(__doc__, rounds=5)
    p.add_argument("--cycles", type=int, default=60, help="send/receive/extend/delete cycles per round")
    args = p.parse_args()
    report = common.Report("bench_strict_sqs", args, {"rounds": args.rounds, "cycles": args.cycles})
    servers = {"strict": MotoServer.start(strict=True), "plain moto": MotoServer.start(strict=False)}
    try:
        clients = {name: common.sqs_client(server.endpoint) for name, server in servers.items()}
        urls = {
            name: client.create_queue(QueueName=f"bench-{uuid.uuid4().hex[:8]}")["QueueUrl"]
            for name, client in clients.items()
        }
        body = json.dumps({"v": 1, "run_id": str(uuid.uuid4()), "task": "bench_noop", "payload": '{"n":1}'})
        attributes = {
            "run_id": {"DataType": "String", "StringValue": str(uuid.uuid4())},
            "task": {"DataType": "String", "StringValue": "bench_noop"},
            "tenant_id": {"DataType": "Number", "StringValue": "3"},
        }
        batch = [{"Id": str(i), "MessageBody": body, "MessageAttributes": attributes} for i in range(10)]

        def side(name: str) -> float:
            client, url = clients[name], urls[name]
            moved = 0
            started = time.perf_counter()
            for _ in range(args.cycles):
                client.send_message_batch(QueueUrl=url, Entries=batch)
                messages = client.receive_message(
                    QueueUrl=url,
                    MaxNumberOfMessages=10,
                    AttributeNames=["ApproximateReceiveCount", "ApproximateFirstReceiveTimestamp"],
                    MessageAttributeNames=["All"],
                ).get("Messages", [])
                handles = [
                    {"Id": str(i), "ReceiptHandle": m["ReceiptHandle"]} for i, m in enumerate(messages)
                ]
                if handles:
                    client.change_message_visibility_batch(
                        QueueUrl=url, Entries=[{**h, "VisibilityTimeout": 60} for h in handles]
                    )
                    client.delete_message_batch(QueueUrl=url, Entries=handles)
                moved += len(messages)
            return moved / (time.perf_counter() - started)

        sides: dict[str, Any] = {name: (lambda name=name: side(name)) for name in servers}
        for run in sides.values():  # warm-up
            run()
        results = common.alternate(args.rounds, sides)
    finally:
        for server in servers.values():
            server.stop()
    med = {name: common.median(values) for name, values in results.items()}
    report.table(
        f"Messages/s through send, receive, extend, delete (median of {args.rounds}; "
        f"{args.cycles} cycles of 10)",
        ["side", "msgs/s (median)", "min", "max", "vs plain moto"],
        [
            [n, med[n], min(v), max(v), common.paired_ratio(results, n, "plain moto")]
            for n, v in results.items()
        ],
    )
    report.results = {"msgs_per_s": results, "medians": med}
    report.ratio("strict / plain moto", common.paired_ratio(results, "strict", "plain moto"), 0.8)
    report.emit()


if __name__ == "__main__":
    main()
