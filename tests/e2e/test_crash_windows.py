"""kill -9 in every window between "SQS accepted" and "PostgreSQL recorded it" (and back).

The relay is stalled *inside* its marking transaction with a trigger (after SendMessageBatch
returned, before sent_at commits); a worker is stalled between its database verdict and the
SQS call that follows by a proxy that stops forwarding. Then the process is killed, and the
test checks that nothing is lost and no handler effect happens twice.
"""

from __future__ import annotations

import json
import time
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.orm import Session, sessionmaker

from sqla_outbox import Dispatch
from sqla_outbox.config import OutboxSettings
from tests import support
from tests.support import (
    effects,
    outbox_rows,
    receive_all,
    run_row,
    set_visibility,
    start_relay,
    start_worker,
    status_of,
    wait_for,
)

pytestmark = pytest.mark.e2e

STALL_FIRST_MARK = """
CREATE SEQUENCE stall_once;
CREATE FUNCTION stall_mark() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF NEW.sent_at IS NOT NULL AND OLD.sent_at IS NULL AND nextval('stall_once') = 1 THEN
        PERFORM pg_sleep(60);
    END IF;
    RETURN NEW;
END $$;
CREATE TRIGGER stall_mark BEFORE UPDATE ON platform_outbox_messages
    FOR EACH ROW EXECUTE FUNCTION stall_mark();
"""


def queue_depth(sqs: Any, url: str) -> int:
    attributes = sqs.get_queue_attributes(
        QueueUrl=url, AttributeNames=["ApproximateNumberOfMessages", "ApproximateNumberOfMessagesNotVisible"]
    )["Attributes"]
    return int(attributes["ApproximateNumberOfMessages"]) + int(
        attributes["ApproximateNumberOfMessagesNotVisible"]
    )


def test_relay_killed_after_send_before_commit_resends_and_the_standby_takes_over(
    app: sessionmaker[Session],
    engine: sa.Engine,
    settings: OutboxSettings,
    sqs_endpoint: str,
    sqs: Any,
    queues: dict[str, str],
    database_url: str,
) -> None:
    with engine.begin() as conn:
        conn.exec_driver_sql(STALL_FIRST_MARK)
        # a killed client's backend notices at once instead of finishing its pg_sleep
        conn.exec_driver_sql(
            f"ALTER DATABASE {engine.url.database} SET client_connection_check_interval = '100ms'"
        )
    first = start_relay(settings, sqs_endpoint, name="first")
    first.wait_for_action("relay.leader")
    second = start_relay(settings, sqs_endpoint, name="second")
    second.wait_for_action("relay.started")
    try:
        with app() as session, session.begin():
            items = [Dispatch("audit", {"mode": "ok", "n": n}) for n in range(5)]
            session.add_all(items)
        wait_for(lambda: queue_depth(sqs, queues["default"]) == 5, timeout=20)  # SQS accepted them ...
        time.sleep(0.5)
        assert all(r.sent_at is None for r in outbox_rows(engine))  # ... the commit has not happened
        first.kill()  # kill -9 while holding the row locks and the advisory lock
        second.wait_for_action("relay.leader", timeout=15)
        wait_for(lambda: all(r.sent_at is not None for r in outbox_rows(engine)), timeout=30)
        assert queue_depth(sqs, queues["default"]) == 10  # every message was sent twice
        # a copy received while its twin runs finds the run leased and is hidden for the rest
        # of the lease (the visibility timeout): keep that short so the queue drains in time
        set_visibility(sqs, queues["default"], 10)
        worker = start_worker(settings, sqs_endpoint)
        try:
            for item in items:
                wait_for(lambda item=item: status_of(engine, item.run_id) == "succeeded", timeout=30)
            wait_for(lambda: queue_depth(sqs, queues["default"]) == 0, timeout=30)
            for item in items:
                assert len(effects(engine, item.run_id)) == 1
                assert run_row(engine, item.run_id).attempts == 1
            assert len(worker.actions("worker.duplicate")) == 5
        finally:
            worker.kill()
    finally:
        first.kill()
        second.kill()


@pytest.fixture
def stalled_worker(settings: OutboxSettings, sqs_endpoint: str, sqs: Any, queues: dict[str, str]):
    """A worker whose SQS traffic goes through a proxy the test can hang; a relay direct."""
    host, port = sqs_endpoint.removeprefix("http://").split(":")
    proxy = support.TcpProxy(host, int(port))
    set_visibility(sqs, queues["default"], 3)
    relay = start_relay(settings, sqs_endpoint)
    worker = start_worker(settings, proxy.endpoint, name="stalled")
    worker.wait_for_action("worker.started")
    yield proxy, worker
    proxy.unhang()
    worker.kill()
    relay.kill()
    proxy.close()


def test_worker_killed_after_the_handler_committed_before_the_delete(
    app: sessionmaker[Session],
    engine: sa.Engine,
    settings: OutboxSettings,
    sqs_endpoint: str,
    sqs: Any,
    queues: dict[str, str],
    stalled_worker: Any,
) -> None:
    proxy, worker = stalled_worker
    with app() as session, session.begin():
        item = Dispatch("audit", {"mode": "sleep", "seconds": 1.5})
        session.add(item)
    wait_for(lambda: status_of(engine, item.run_id) == "running", timeout=20)
    proxy.hang()  # the DeleteMessage after the commit will never get through
    wait_for(lambda: status_of(engine, item.run_id) == "succeeded", timeout=20)
    time.sleep(0.3)
    worker.kill()
    proxy.unhang()
    assert queue_depth(sqs, queues["default"]) == 1  # not deleted
    successor = start_worker(settings, sqs_endpoint, name="successor")
    try:
        wait_for(lambda: queue_depth(sqs, queues["default"]) == 0, timeout=30)
        assert successor.actions("worker.duplicate")
        assert len(effects(engine, item.run_id)) == 1
        assert run_row(engine, item.run_id).attempts == 1
    finally:
        successor.kill()


def test_worker_killed_during_the_dlq_send(
    app: sessionmaker[Session],
    engine: sa.Engine,
    settings: OutboxSettings,
    sqs_endpoint: str,
    sqs: Any,
    queues: dict[str, str],
    stalled_worker: Any,
) -> None:
    proxy, worker = stalled_worker
    with app() as session, session.begin():
        item = Dispatch("audit", {"mode": "sleep_then_permanent", "seconds": 1.5})
        session.add(item)
    wait_for(lambda: status_of(engine, item.run_id) == "running", timeout=20)
    proxy.hang()  # the DLQ SendMessage after `failed` is recorded will never get through
    wait_for(lambda: status_of(engine, item.run_id) == "failed", timeout=20)
    time.sleep(0.3)
    worker.kill()
    proxy.unhang()
    assert run_row(engine, item.run_id).dead_lettered_at is None
    assert queue_depth(sqs, queues["default-dlq"]) == 0
    successor = start_worker(settings, sqs_endpoint, name="successor")
    try:
        wait_for(lambda: run_row(engine, item.run_id).dead_lettered_at is not None, timeout=30)
        wait_for(lambda: queue_depth(sqs, queues["default"]) == 0, timeout=30)
        [message] = receive_all(sqs, queues["default-dlq"], expect=1, timeout=10)
        assert json.loads(message["Body"])["run_id"] == str(item.run_id)
        assert message["MessageAttributes"]["reason"]["StringValue"] == "completed-after-interruption"
        run = run_row(engine, item.run_id)
        assert (run.status, run.attempts) == ("failed", 1)
        assert run.last_error_type == "sqla_outbox.errors.ValidationFailed"
        assert effects(engine, item.run_id) == []
    finally:
        successor.kill()
