"""Webhook deliveries through the real pipeline: app transaction → relay → SQS → worker →
a real HTTP receiver on loopback (allowed by ``webhook_allowed_hosts``)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
import sqlalchemy as sa
import standardwebhooks
from sqlalchemy.orm import Session, sessionmaker

from sqla_outbox import Dispatch, Publish, webhooks
from sqla_outbox.catalog import Catalog
from sqla_outbox.config import OutboxSettings
from tests import support
from tests.support import receive_all, run_row, start_relay, start_worker, trail, wait_for
from tests.webhook_receiver import Receiver, Reply

pytestmark = pytest.mark.e2e


@pytest.fixture
def catalog() -> Catalog:
    return Catalog.from_dict(support.WEBHOOK_CATALOG)


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    server = Receiver()
    yield server
    server.close()


def test_a_published_event_is_delivered_signed_retried_and_refused_by_real_processes(
    app: sessionmaker[Session],
    engine: sa.Engine,
    settings: OutboxSettings,
    sqs_endpoint: str,
    queues: dict[str, str],
    sqs: Any,
    receiver: Receiver,
) -> None:
    with app() as session, session.begin():
        good = webhooks.new_endpoint(tenant_id=1, url=receiver.url("/in"), events=["order.paid"])
        # another loopback address, not in the allow-list (127.0.0.1 is)
        refused_url = receiver.url(host="127.0.0.2")
        refused = webhooks.new_endpoint(tenant_id=1, url=refused_url, events=["order.paid"])
        session.add_all([good, refused])
        session.flush()
        good_id, refused_id, secret = good.id, refused.id, webhooks.signing_secret(good)
    receiver.script(Reply(503, headers={"retry-after": "1"}, body=b"maintenance"))
    processes = [
        start_relay(settings, sqs_endpoint),
        start_worker(
            settings,
            sqs_endpoint,
            imports="tests.e2e.webhook_tasks",
            SQLA_OUTBOX_WEBHOOK_ALLOWED_HOSTS=f"127.0.0.1:{receiver.port}",
            SQLA_OUTBOX_WEBHOOK_TIMEOUT_SECONDS="5",
            SQLA_OUTBOX_WEBHOOK_RESPONSE_EXCERPT="always",  # the test's own receiver
        ),
    ]
    try:
        processes[1].wait_for_action("worker.started")
        with app() as session, session.begin():
            event = Publish("order.paid", {"order_id": 7, "mode": "ok"}, tenant_id=1)
            session.add(event)
            session.flush()
            deliveries = event.webhook_deliveries
        delivered, blocked = deliveries[good_id], deliveries[refused_id]
        wait_for(lambda: run_row(engine, delivered).status == "succeeded", timeout=60)
        wait_for(lambda: run_row(engine, blocked).dead_lettered_at is not None, timeout=60)
        wait_for(
            lambda: run_row(engine, event.resolved_run_ids["send_welcome"]).status == "succeeded", timeout=60
        )
    finally:
        for process in processes:
            process.kill()
            print(f"--- {process.name} ---\n" + "".join(process.raw[-30:]))

    # delivered on the second attempt, after the Retry-After the receiver asked for
    first, second = receiver.requests
    assert [r.headers["webhook-id"] for r in (first, second)] == [str(delivered)] * 2
    assert [r.headers["webhook-attempt"] for r in (first, second)] == ["1", "2"]
    assert standardwebhooks.Webhook(secret).verify(second.body, second.headers)["data"] == {
        "order_id": 7,
        "mode": "ok",
    }
    assert second.at - first.at >= 0.9
    run = run_row(engine, delivered)
    assert (run.status, run.attempts) == ("succeeded", 2)
    steps = trail(engine, delivered)
    retry = next(t for t in steps if t.status == "retrying")
    assert retry.detail["backoff_seconds"] == 1
    assert retry.detail["webhook"]["response"] == {
        "status": 503,
        "latency_ms": retry.detail["webhook"]["response"]["latency_ms"],
        "content_type": "",
        "body": "maintenance",
        "body_truncated": False,
    }
    assert steps[-1].detail["webhook"]["response"]["status"] == 200

    # refused by the SSRF guard at the first attempt: DLQ with the reason, nothing sent
    run = run_row(engine, blocked)
    assert (run.status, run.attempts) == ("failed", 1)
    assert run.last_error_type == "sqla_outbox.errors.WebhookRefused"
    assert "127.0.0.2 is 127.0.0.2 (loopback)" in run.last_error
    [message] = receive_all(sqs, queues["default-dlq"], expect=1, timeout=10)
    attributes = {k: v["StringValue"] for k, v in message["MessageAttributes"].items()}
    assert (attributes["reason"], attributes["run_id"]) == ("permanent-error", str(blocked))
    assert "loopback" in attributes["error_message"]
    body = json.loads(message["Body"])
    assert json.loads(body["payload"])["endpoint_id"] == refused_id
    assert "127.0.0.2" not in message["Body"] and "whsec_" not in message["Body"]
    assert len(receiver.requests) == 2


def test_a_receiver_answering_410_has_its_endpoint_disabled_by_the_worker_process(
    app: sessionmaker[Session],
    engine: sa.Engine,
    settings: OutboxSettings,
    sqs_endpoint: str,
    queues: dict[str, str],
    receiver: Receiver,
) -> None:
    with app() as session, session.begin():
        gone = webhooks.new_endpoint(tenant_id=1, url=receiver.url("/unsubscribed"), events=["order.paid"])
        session.add(gone)
        session.flush()
        gone_id = gone.id
    receiver.script(Reply(410), Reply(410), Reply(410))
    processes = [
        start_relay(settings, sqs_endpoint),
        start_worker(
            settings,
            sqs_endpoint,
            imports="tests.e2e.webhook_tasks",
            SQLA_OUTBOX_WEBHOOK_ALLOWED_HOSTS=f"127.0.0.1:{receiver.port}",
            SQLA_OUTBOX_WEBHOOK_TIMEOUT_SECONDS="5",
        ),
    ]
    try:
        processes[1].wait_for_action("worker.started")
        with app() as session, session.begin():
            first = Publish("order.paid", {"order_id": 1, "mode": "ok"}, tenant_id=1)
            session.add(first)
            session.flush()
            delivery = first.webhook_deliveries[gone_id]
        wait_for(lambda: run_row(engine, delivery).status == "failed", timeout=60)
        with app() as session, session.begin():
            later = Publish("order.paid", {"order_id": 2, "mode": "ok"}, tenant_id=1)
            session.add(later)
            session.flush()
            assert later.webhook_deliveries == {}  # disabled: nothing scheduled for it
            welcome = later.resolved_run_ids["send_welcome"]
        wait_for(lambda: run_row(engine, welcome).status == "succeeded", timeout=60)
    finally:
        for process in processes:
            process.kill()
            print(f"--- {process.name} ---\n" + "".join(process.raw[-30:]))
    run = run_row(engine, delivery)
    assert (run.attempts, run.last_error) == (
        1,
        "gone: the receiver answered 410 Gone; the endpoint is disabled",
    )
    with engine.connect() as connection:
        row = connection.execute(
            sa.text("SELECT enabled, disabled_reason, disabled_at FROM webhook_endpoints WHERE id = :id"),
            {"id": gone_id},
        ).one()
    assert (row.enabled, row.disabled_reason) == (False, "gone") and row.disabled_at is not None
    assert [r.path for r in receiver.requests] == ["/unsubscribed"]


def _threads(pid: int) -> int:
    """Threads of a process now (Linux ``/proc/<pid>/status``)."""
    with open(f"/proc/{pid}/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("Threads:"))


def test_a_tenants_slow_receivers_hold_neither_another_tenants_runs_nor_threads(
    app: sessionmaker[Session],
    engine: sa.Engine,
    settings: OutboxSettings,
    sqs_endpoint: str,
    queues: dict[str, str],
    receiver: Receiver,
) -> None:
    """Tenant 1's four receivers trickle one byte every 0.5 s forever. With 4 slots and the
    default share (half), its deliveries hold 2 slots at most, so tenant 2's run is done
    while tenant 1's first attempts still trickle; each attempt ends at the 4 s deadline
    and its thread is reused, so rounds of retries do not add threads."""
    receiver.script(*[Reply(200, trickle_seconds=0.5) for _ in range(200)])
    with app() as session, session.begin():
        for n in range(4):
            session.add(
                webhooks.new_endpoint(tenant_id=1, url=receiver.url(f"/slow/{n}"), events=["invoice.sent"])
            )
    processes = [
        start_relay(settings, sqs_endpoint),
        start_worker(
            settings,
            sqs_endpoint,
            imports="tests.e2e.webhook_tasks",
            SQLA_OUTBOX_WORKER_CONCURRENCY="4",
            SQLA_OUTBOX_WEBHOOK_ALLOWED_HOSTS=f"127.0.0.1:{receiver.port}",
            SQLA_OUTBOX_WEBHOOK_TIMEOUT_SECONDS="4",
        ),
    ]
    worker = processes[1]
    try:
        worker.wait_for_action("worker.started")
        with app() as session, session.begin():
            event = Publish("invoice.sent", {"invoice": 1}, tenant_id=1)
            session.add(event)
            session.flush()
            slow = list(event.webhook_deliveries.values())
        receiver.wait_for(2, timeout=30)  # two deliveries hold their slots, trickling
        with app() as session, session.begin():
            other = Dispatch("send_welcome", {"mode": "ok"}, tenant_id=2)
            session.add(other)
        wait_for(lambda: run_row(engine, other.run_id).status == "succeeded", timeout=30)
        # done while no attempt of tenant 1 has reached its deadline yet
        assert receiver.abandoned == 0
        assert len(receiver.requests) <= 2
        deferred = [t.detail.get("throttled") for r in slow for t in trail(engine, r)]
        assert "tenant-share" in deferred
        # attempts end at the deadline: transient timeouts, retried
        wait_for(lambda: receiver.abandoned >= 2, timeout=30)
        settled = _threads(worker.process.pid)
        wait_for(lambda: receiver.abandoned >= 6, timeout=60)  # two more rounds of attempts
        assert _threads(worker.process.pid) <= settled + 2
        steps = [t for r in slow for t in trail(engine, r) if t.status == "retrying" and t.error_type]
        assert steps and all(t.error_message.startswith("timeout: ") for t in steps)
    finally:
        for process in processes:
            process.kill()
            print(f"--- {process.name} ---\n" + "".join(process.raw[-30:]))
