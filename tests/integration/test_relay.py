"""The relay's pass, in process, against real PostgreSQL and a moto SQS server."""

from __future__ import annotations

import datetime as dt
import json
from collections.abc import Iterator
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.orm import Session, sessionmaker

from sqla_outbox import Dispatch, Publish
from sqla_outbox.config import OutboxSettings
from sqla_outbox.relay import Relay
from tests.support import outbox_rows, receive_all


@pytest.fixture
def relay(
    settings: OutboxSettings, sqs_endpoint: str, queues: dict[str, str], engine: sa.Engine
) -> Iterator[Relay]:
    relay = Relay(settings.replace(sqs_endpoint_url=sqs_endpoint), engine=engine)
    yield relay
    relay.sender.close()


def test_pass_sends_committed_rows_to_their_queues_with_the_envelope_intact(
    app: sessionmaker[Session], relay: Relay, sqs: Any, queues: dict[str, str], engine: sa.Engine
) -> None:
    with app() as session, session.begin():
        plain = Dispatch("send_welcome", {"user_id": 7, "name": "Zoë"}, tenant_id=3)
        session.add(plain)
        event = Publish("user.created", {"user_id": 7})
        session.add(event)
    result = relay.run_once()
    assert (result.claimed, result.sent, result.failed) == (3, 3, 0)
    default = receive_all(sqs, queues["default"], expect=2)
    bulk = receive_all(sqs, queues["bulk"], expect=1)
    assert len(default) == 2 and len(bulk) == 1
    by_run = {json.loads(m["Body"])["run_id"]: m for m in default + bulk}
    message = by_run[str(plain.run_id)]
    body = json.loads(message["Body"])
    assert body["task"] == "send_welcome" and body["tenant_id"] == 3 and body["queue"] == "default"
    assert json.loads(body["payload"]) == {"user_id": 7, "name": "Zoë"}
    attributes = message["MessageAttributes"]
    assert attributes["run_id"]["StringValue"] == str(plain.run_id)
    assert attributes["task"]["StringValue"] == "send_welcome"
    assert attributes["tenant_id"]["StringValue"] == "3"
    assert str(event.runs["index_user"]) in by_run
    assert all(r.sent_at is not None for r in outbox_rows(engine))


def test_rows_not_due_yet_stay_pending(app: sessionmaker[Session], relay: Relay, engine: sa.Engine) -> None:
    with app() as session, session.begin():
        session.add(Dispatch("audit", {}, delay=dt.timedelta(hours=1)))
    assert relay.run_once().claimed == 0
    assert outbox_rows(engine)[0].sent_at is None


def test_a_row_sqs_refuses_is_parked_without_blocking_the_rows_behind_it(
    app: sessionmaker[Session],
    relay: Relay,
    sqs: Any,
    queues: dict[str, str],
    engine: sa.Engine,
    settings: OutboxSettings,
) -> None:
    with app() as session, session.begin():
        session.add(Dispatch("audit", {"n": 1}))
    with engine.begin() as conn:  # a row SQS will refuse: over the queue's 256 KiB limit
        conn.execute(
            sa.text(
                "INSERT INTO platform_outbox_messages (run_id, queue, envelope, available_at) "
                "VALUES (gen_random_uuid(), 'default', CAST(:env AS jsonb), "
                "clock_timestamp() - interval '1 hour')"
            ),
            {"env": json.dumps({"v": 1, "task": "audit", "payload": "x" * 300_000})},
        )
    with app() as session, session.begin():
        session.add(Dispatch("audit", {"n": 2}))
    big_relay = Relay(relay.settings.replace(max_message_bytes=1_048_576), engine=engine, sender=relay.sender)
    result = big_relay.run_once()
    assert (result.sent, result.failed, result.parked) == (2, 1, 1)
    [bad] = [r for r in outbox_rows(engine) if r.sent_at is None]
    assert bad.attempts == 1
    with engine.begin() as conn:  # even due again, a parked row is never claimed
        conn.execute(sa.text("UPDATE platform_outbox_messages SET available_at = clock_timestamp()"))
    assert big_relay.run_once().claimed == 0
    assert {
        json.loads(json.loads(m["Body"])["payload"])["n"]
        for m in receive_all(sqs, queues["default"], expect=2)
    } == {1, 2}


def test_endpoint_down_counts_attempts_for_every_row(
    app: sessionmaker[Session], settings: OutboxSettings, engine: sa.Engine, queues: dict[str, str]
) -> None:
    from tests.support import closed_port_url

    down = Relay(settings.replace(sqs_endpoint_url=closed_port_url().replace("redis", "http")), engine=engine)
    with app() as session, session.begin():
        session.add_all([Dispatch("audit", {"n": n}) for n in range(3)])
    result = down.run_once()
    down.sender.close()
    assert (result.sent, result.failed, result.parked) == (0, 3, 0)
    rows = outbox_rows(engine)
    assert [r.attempts for r in rows] == [1, 1, 1]
    assert all(r.sent_at is None for r in rows)
    for r in rows:  # backed off by relay_backoff_base_seconds (1 s) after the first failure
        assert dt.timedelta(seconds=0.5) < r.available_at - dt.datetime.now(dt.UTC) <= dt.timedelta(seconds=1)


def test_only_one_relay_holds_the_lock(relay: Relay, settings: OutboxSettings, engine: sa.Engine) -> None:
    other = Relay(relay.settings, engine=engine)
    with engine.connect() as holder:
        assert relay.ownership.join(holder)
        with engine.connect() as contender:
            assert not other.ownership.join(contender)
        relay.ownership.release(holder)
        with engine.connect() as contender:
            assert other.ownership.join(contender)
            other.ownership.release(contender)
