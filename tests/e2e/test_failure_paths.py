"""Failure paths through real relay and worker processes (issue 11): error texts PostgreSQL
or SQS cannot carry, the 12-hour visibility ceiling, parked and expired messages."""

from __future__ import annotations

import json
import subprocess
import time
import uuid
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.orm import Session, sessionmaker

from sqla_outbox.config import OutboxSettings
from sqla_outbox.relay import Relay
from tests import support
from tests.e2e.test_worker_process import dispatch
from tests.support import effects, receive_all, run_row, start_worker, status_of, trail, wait_for

pytestmark = pytest.mark.e2e

TEXT = "upstream said \x00, then \x1b[31mred\x1b[0m, a bell \x07 and a lone \ud800"
"""A handler's error message: NUL, escape sequences, a bell and a lone surrogate."""
IN_POSTGRES = "upstream said \\x00, then \x1b[31mred\x1b[0m, a bell \x07 and a lone \\ud800"
IN_SQS = "upstream said \\x00, then \\x1b[31mred\\x1b[0m, a bell \\x07 and a lone \\ud800"


def test_an_error_text_with_nul_and_control_characters_is_stored_and_dead_lettered_after_one_execution(
    app: sessionmaker[Session], engine: sa.Engine, worker_with_relay: Any, sqs: Any, queues: dict[str, str]
) -> None:
    """The issue's input: ``PermanentError("upstream said \\x00")``. Recording the verdict
    failed, the message came back after every visibility timeout and ran again, and the run
    ended as ``receive-limit`` with "earlier attempts were lost"."""
    process = worker_with_relay()
    run_id = dispatch(app, "audit", {"mode": "permanent_text", "text": TEXT})
    wait_for(lambda: run_row(engine, run_id).dead_lettered_at is not None, timeout=30)
    run = run_row(engine, run_id)
    assert (run.status, run.attempts, run.last_error) == ("failed", 1, IN_POSTGRES)
    steps = trail(engine, run_id)
    assert [t.status for t in steps] == ["running", "failed", "failed"]  # one execution
    assert steps[1].error_message == IN_POSTGRES and steps[1].detail == {"reason": "permanent-error"}
    assert "\\x00" in steps[1].traceback
    [message] = receive_all(sqs, queues["default-dlq"], expect=1, timeout=10)
    attributes = {k: v["StringValue"] for k, v in message["MessageAttributes"].items()}
    assert (attributes["reason"], attributes["error_message"]) == ("permanent-error", IN_SQS)
    assert effects(engine, run_id) == []
    assert process.actions("worker.handle_error") == []


def test_a_transient_error_text_with_nul_is_stored_and_the_retry_succeeds_once(
    app: sessionmaker[Session], engine: sa.Engine, worker_with_relay: Any
) -> None:
    worker_with_relay()
    run_id = dispatch(app, "audit", {"mode": "transient_text", "text": TEXT})
    wait_for(lambda: status_of(engine, run_id) == "succeeded", timeout=30)
    retrying = [t for t in trail(engine, run_id) if t.status == "retrying"]
    assert [t.error_message for t in retrying] == [IN_POSTGRES]
    assert len(effects(engine, run_id)) == 1


def test_a_retry_longer_than_sqs_can_hide_the_message_goes_through_the_outbox(
    app: sessionmaker[Session],
    engine: sa.Engine,
    settings: OutboxSettings,
    sqs_endpoint: str,
    sqs: Any,
    queues: dict[str, str],
) -> None:
    """A message first received almost 12 hours ago (200 s left, less a minute of margin): a
    handler asking to retry in an hour gets its hour, through the outbox (a fresh message due
    then), not what SQS still allows (the remaining tries would run back to back at the
    ceiling) and not a refused ChangeMessageVisibility."""
    run_id = dispatch(app, "audit", {"mode": "retry_in", "seconds": 3600})
    assert Relay(settings.replace(sqs_endpoint_url=sqs_endpoint), engine=engine).run_once().sent == 1
    [first] = sqs.receive_message(QueueUrl=queues["default"], VisibilityTimeout=1)["Messages"]
    support.backdate_first_receive(sqs_endpoint, first["MessageId"], time.time() - 43_000)  # 200 s left
    time.sleep(1.2)
    process = start_worker(settings, sqs_endpoint)
    try:
        wait_for(lambda: status_of(engine, run_id) == "retrying", timeout=30)
        [retrying] = [t for t in trail(engine, run_id) if t.status == "retrying"]
        assert (retrying.detail["backoff_seconds"], retrying.detail["via"]) == (3600, "outbox")
        [row] = [r for r in support.outbox_rows(engine) if r.run_id == run_id]
        due_in = (row.available_at - run_row(engine, run_id).updated_at).total_seconds()
        assert row.sent_at is None and 3590 <= due_in <= 3610  # a fresh message, due in an hour
        wait_for(
            lambda: not sqs.receive_message(QueueUrl=queues["default"], WaitTimeSeconds=1).get("Messages")
        )
        assert process.actions("worker.handle_error") == []
        assert (
            sqs.receive_message(QueueUrl=queues["default-dlq"], WaitTimeSeconds=1).get("Messages", []) == []
        )
    finally:
        process.kill()


def test_a_handler_still_running_at_the_12_hour_ceiling_retries_through_the_outbox_not_the_dlq(
    app: sessionmaker[Session],
    engine: sa.Engine,
    settings: OutboxSettings,
    sqs_endpoint: str,
    sqs: Any,
    queues: dict[str, str],
    tmp_path: Any,
) -> None:
    """The message can no longer be hidden while the handler runs: it comes back, and every
    copy a worker receives finds the run leased. Before, each copy was "hidden" with
    visibility 0, so copies cycled until SQS redrove the message to the DLQ, and the
    handler's transient failure then left the run ``retrying`` forever with its only copy
    in the DLQ. Now a copy that cannot be hidden as long as the lease needs is deleted, and
    the retry comes from the outbox: the run succeeds, nothing reaches the DLQ."""
    marker = tmp_path / "marker"
    run_id = dispatch(app, "audit", {"mode": "sleep_then_fail", "seconds": 12, "marker": str(marker)})
    support.set_visibility(sqs, queues["default"], 3)
    assert Relay(settings.replace(sqs_endpoint_url=sqs_endpoint), engine=engine).run_once().sent == 1
    [first] = sqs.receive_message(QueueUrl=queues["default"], VisibilityTimeout=1)["Messages"]
    support.backdate_first_receive(sqs_endpoint, first["MessageId"], time.time() - 43_170)  # 30 s left
    time.sleep(1.2)
    process = start_worker(settings, sqs_endpoint, SQLA_OUTBOX_WORKER_RUN_RELAY="true")
    try:
        wait_for(lambda: status_of(engine, run_id) == "succeeded", timeout=60)
        run = run_row(engine, run_id)
        assert run.attempts == 2 and len(effects(engine, run_id)) == 1
        assert process.actions("worker.visibility_cap")  # said when the ceiling came near
        assert process.actions("worker.copy_dropped")  # copies found the run leased
        [retrying] = [t for t in trail(engine, run_id) if t.status == "retrying"]
        assert retrying.detail["via"] == "outbox"
        assert (
            sqs.receive_message(QueueUrl=queues["default-dlq"], WaitTimeSeconds=1).get("Messages", []) == []
        )
        assert process.actions("worker.handle_error") == []
    finally:
        process.kill()


def test_a_retrying_run_whose_message_is_lost_is_rescued_and_succeeds(
    app: sessionmaker[Session],
    engine: sa.Engine,
    settings: OutboxSettings,
    sqs_endpoint: str,
    sqs: Any,
    queues: dict[str, str],
) -> None:
    """A run waits for its next try and its message vanishes from SQS (redriven to the DLQ,
    dropped past the retention, purged): nothing would ever run it again, and ``status``
    showed nothing. The relay's rescuer finds it past its queue's window (here 1 s x 7 + 1
    s), with a live worker for it and nothing waiting in the queue, and sends it again."""
    run_id = dispatch(app, "audit", {"mode": "retry_in", "seconds": 3})
    process = start_worker(
        settings,
        sqs_endpoint,
        SQLA_OUTBOX_WORKER_RUN_RELAY="true",
        SQLA_OUTBOX_RELAY_RESCUE_INTERVAL_SECONDS="1",
        SQLA_OUTBOX_RELAY_RESCUE_MARGIN_SECONDS="1",
        SQLA_OUTBOX_QUEUE_VISIBILITY_TIMEOUTS="default=1",
    )
    try:
        wait_for(lambda: status_of(engine, run_id) == "retrying", timeout=30)
        sqs.purge_queue(QueueUrl=queues["default"])  # the only copy is gone
        wait_for(lambda: status_of(engine, run_id) == "succeeded", timeout=60)
        [rescued] = process.actions("relay.rescued")
        assert (rescued["run_id"], rescued["reason"], rescued["status"]) == (
            str(run_id),
            "no-live-copy",
            "retrying",
        )
        [step] = [t for t in trail(engine, run_id) if t.detail and "rescued" in t.detail]
        assert (step.status, step.detail) == ("retrying", {"rescued": "no-live-copy", "from": "retrying"})
        assert run_row(engine, run_id).attempts == 2 and len(effects(engine, run_id)) == 1
    finally:
        process.kill()


def cli(settings: OutboxSettings, endpoint: str, *args: str) -> subprocess.CompletedProcess[str]:
    return support.run_cli(support.service_env(settings, endpoint), *args)


def test_parked_and_unreceived_runs_are_shown_and_put_back_from_the_command_line(
    app: sessionmaker[Session],
    engine: sa.Engine,
    settings: OutboxSettings,
    sqs_endpoint: str,
    sqs: Any,
    queues: dict[str, str],
) -> None:
    support.refuse_messages(sqs_endpoint, "poison-5", "InvalidParameterValue", message="refused for the test")
    parked = dispatch(app, "send_welcome", {"note": "poison-5"}, tenant_id=1)
    lost = dispatch(app, "send_welcome", {"note": "lost"}, tenant_id=1)
    relay = Relay(settings.replace(sqs_endpoint_url=sqs_endpoint), engine=engine)
    assert (relay.run_once().parked, status_of(engine, parked)) == (1, "failed")
    sqs.purge_queue(QueueUrl=queues["default"])  # as SQS does past the retention period
    with engine.begin() as conn:
        conn.execute(
            sa.text("UPDATE outbox_messages SET sent_at = sent_at - interval '2 days' WHERE run_id = :r"),
            {"r": lost},
        )
        conn.execute(
            sa.text("UPDATE task_runs SET updated_at = updated_at - interval '2 days' WHERE run_id = :r"),
            {"r": lost},
        )

    status = cli(settings, sqs_endpoint, "status", "--no-sqs", "--json")
    assert status.returncode == 0, status.stderr
    report = json.loads(status.stdout)
    assert report["parked_count"] == 1 and report["parked"][0]["run_id"] == str(parked)
    assert report["parked"][0]["last_error"] == "InvalidParameterValue: refused for the test"
    assert report["unreceived_count"] == 1 and report["unreceived"][0]["run_id"] == str(lost)
    human = cli(settings, sqs_endpoint, "status", "--no-sqs")
    assert "Parked outbox rows" in human.stdout and "Unreceived runs" in human.stdout
    listed = json.loads(cli(settings, sqs_endpoint, "outbox", "parked", "--json").stdout)
    assert [p["run_id"] for p in listed] == [str(parked)]
    in_runs = json.loads(cli(settings, sqs_endpoint, "runs", "list", "--parked", "--json").stdout)
    assert [(r["run_id"], r["status"], r["parked"]) for r in in_runs] == [(str(parked), "failed", True)]
    assert "failed (parked)" in cli(settings, sqs_endpoint, "runs", "list").stdout

    usage = cli(settings, sqs_endpoint, "outbox", "unpark")
    assert usage.returncode == 2 and "--all" in usage.stderr
    dry = cli(settings, sqs_endpoint, "outbox", "unpark", "--all", "--dry-run", "--json")
    assert dry.returncode == 0, dry.stderr
    assert [(i["run_id"], i["action"]) for i in json.loads(dry.stdout)["items"]] == [
        (str(parked), "would-unpark")
    ]
    support.refuse_messages(sqs_endpoint, "poison-5", clear=True)
    done = cli(settings, sqs_endpoint, "outbox", "unpark", "--run-id", str(parked))
    assert done.returncode == 0, done.stderr
    assert "unparked 1, skipped 0" in done.stdout
    resent = cli(settings, sqs_endpoint, "outbox", "resend", "--older-than", "1d", "--all", "--json")
    assert resent.returncode == 0, resent.stderr
    assert json.loads(resent.stdout)["done"] == 1
    missing = cli(settings, sqs_endpoint, "outbox", "resend", "--run-id", str(uuid.uuid4()))
    assert missing.returncode == 1 and "unknown-run" in missing.stdout

    assert relay.run_once().sent == 2
    bodies = {json.loads(m["Body"])["run_id"] for m in receive_all(sqs, queues["default"], expect=2)}
    assert bodies == {str(parked), str(lost)}
