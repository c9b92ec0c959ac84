"""Batched acknowledgements against a real SQS endpoint (moto)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
from typing import Any

from sqla_outbox.config import OutboxSettings
from sqla_outbox.sqs.client import QueueDirectory
from sqla_outbox.worker.acks import AckBatcher
from tests.support import receive_all


class CountingClient:
    """The real boto3 client, with its delete calls counted (observation, not a stand-in)."""

    def __init__(self, client: Any) -> None:
        self.client = client
        self.batches: list[int] = []

    def delete_message_batch(self, **kwargs: Any) -> Any:
        self.batches.append(len(kwargs["Entries"]))
        return self.client.delete_message_batch(**kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.client, name)


def test_deletes_go_out_in_batches_of_ten_and_remove_the_messages(
    sqs: Any, queues: dict[str, str], settings: OutboxSettings, sqs_endpoint: str
) -> None:
    for n in range(25):
        sqs.send_message(QueueUrl=queues["default"], MessageBody=f"m{n}")
    received = receive_all(sqs, queues["default"], expect=25, visibility=60)
    counting = CountingClient(sqs)
    directory = QueueDirectory(counting, settings.replace(sqs_endpoint_url=sqs_endpoint))
    pool = concurrent.futures.ThreadPoolExecutor(4)

    async def scenario() -> list[bool]:
        loop = asyncio.get_running_loop()

        async def run_blocking(fn: Any, *args: Any) -> Any:
            return await loop.run_in_executor(pool, functools.partial(fn, *args))

        batcher = AckBatcher(counting, directory, run_blocking)
        results = await asyncio.gather(*(batcher.ack("default", m["ReceiptHandle"]) for m in received))
        await batcher.close()
        return list(results)

    assert asyncio.run(scenario()) == [True] * 25
    assert sorted(counting.batches, reverse=True) == [10, 10, 5]
    attributes = sqs.get_queue_attributes(
        QueueUrl=queues["default"],
        AttributeNames=["ApproximateNumberOfMessages", "ApproximateNumberOfMessagesNotVisible"],
    )["Attributes"]
    assert attributes == {"ApproximateNumberOfMessages": "0", "ApproximateNumberOfMessagesNotVisible": "0"}


def test_a_lone_delete_waits_only_the_linger(
    sqs: Any, queues: dict[str, str], settings: OutboxSettings
) -> None:
    sqs.send_message(QueueUrl=queues["default"], MessageBody="alone")
    [message] = receive_all(sqs, queues["default"], expect=1, visibility=60)
    directory = QueueDirectory(sqs, settings)
    pool = concurrent.futures.ThreadPoolExecutor(1)

    async def scenario() -> tuple[bool, float]:
        loop = asyncio.get_running_loop()

        async def run_blocking(fn: Any, *args: Any) -> Any:
            return await loop.run_in_executor(pool, functools.partial(fn, *args))

        batcher = AckBatcher(sqs, directory, run_blocking, linger_seconds=0.005)
        started = loop.time()
        ok = await batcher.ack("default", message["ReceiptHandle"])
        return ok, loop.time() - started

    ok, elapsed = asyncio.run(scenario())
    assert ok and elapsed < 1.0


def test_the_heartbeat_never_asks_for_visibility_past_12_hours_after_the_first_receive(
    sqs: Any,
    queues: dict[str, str],
    settings: OutboxSettings,
    sqs_endpoint: str,
    engine: Any,
    catalog: Any,
) -> None:
    """A message first received almost 12 hours ago, 100 s left: the heartbeat asks for
    what is left (less a minute), not the queue's 120 s, which SQS would refuse."""
    import time

    from sqla_outbox.worker.consumer import visibility_ends_by
    from sqla_outbox.worker.flight import InFlight
    from sqla_outbox.worker.heartbeat import beat
    from sqla_outbox.worker.registry import Registry
    from sqla_outbox.worker.runtime import Runtime
    from tests.support import backdate_first_receive

    sqs.send_message(QueueUrl=queues["default"], MessageBody="long handler")
    [first] = sqs.receive_message(QueueUrl=queues["default"], VisibilityTimeout=1)["Messages"]
    backdate_first_receive(sqs_endpoint, first["MessageId"], time.time() - 43_100)
    time.sleep(1.2)
    [message] = sqs.receive_message(
        QueueUrl=queues["default"], AttributeNames=["ApproximateFirstReceiveTimestamp"], VisibilityTimeout=1
    )["Messages"]
    flight = InFlight(
        "default",
        message["MessageId"],
        message["ReceiptHandle"],
        2,
        message["Body"],
        {},
        visibility_ends_by=visibility_ends_by(message["Attributes"]["ApproximateFirstReceiveTimestamp"]),
    )
    flight.extended_at -= 60  # due for an extension
    runtime = Runtime(
        settings.replace(sqs_endpoint_url=sqs_endpoint),
        worker_id="test",
        registry=Registry(),
        catalog=catalog,
        engine=engine,
        client=sqs,
        io_threads=2,
    )
    runtime.visibility["default"] = 120

    async def scenario() -> None:
        await beat(runtime, [flight])
        await runtime.close()

    asyncio.run(scenario())
    assert time.monotonic() - flight.extended_at < 5  # the extension was accepted
    time.sleep(1.5)  # past the 1 s of the receive: still hidden by the extension (about 40 s)
    assert sqs.receive_message(QueueUrl=queues["default"]).get("Messages", []) == []


def test_hiding_a_message_through_a_stale_receipt_handle_says_so_instead_of_raising(
    sqs: Any, queues: dict[str, str], settings: OutboxSettings
) -> None:
    """A copy received again since (a duplicate after a relay was killed, a lease's copy)
    leaves the first handle stale; SQS refuses a visibility change through it. That is
    expected, not a failure of the message's handling: the worker is told (False) and picks
    another way (the outbox, or deleting a redundant copy), where it used to log an ERROR
    with a traceback."""
    import time

    from sqla_outbox.worker.outcome import Outcomes

    sqs.send_message(QueueUrl=queues["default"], MessageBody="{}")
    [first] = sqs.receive_message(QueueUrl=queues["default"], VisibilityTimeout=1)["Messages"]
    time.sleep(1.2)
    [second] = receive_all(sqs, queues["default"], expect=1, timeout=10)
    outcomes = Outcomes(sqs, QueueDirectory(sqs, settings), max_message_bytes=settings.max_message_bytes)
    assert outcomes.retry_after("default", first["ReceiptHandle"], 30) is False
    assert outcomes.retry_after("default", second["ReceiptHandle"], 30) is True
