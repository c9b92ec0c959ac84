"""Bad and hostile input: what others put on our queues never runs and ends in the DLQ."""

from __future__ import annotations

import datetime as dt
import json
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.orm import Session, sessionmaker

from sqla_outbox import Dispatch, envelope
from sqla_outbox.config import OutboxSettings
from tests.e2e.test_ops_cli import cli, cli_json
from tests.support import effects, receive_all, run_row, service_env, start_worker, status_of, wait_for

pytestmark = pytest.mark.e2e

KEY = "test-signing-key-2026-0123456789"


def envelope_of(engine: sa.Engine, run_id: uuid.UUID) -> dict[str, Any]:
    with engine.connect() as conn:
        value: dict[str, Any] = conn.execute(
            sa.text(
                "SELECT envelope FROM platform_outbox_messages WHERE run_id = :r "
                "UNION ALL SELECT envelope FROM outbox_messages WHERE run_id = :r"
            ),
            {"r": run_id},
        ).scalar_one()
    return value


def dlq_reasons(sqs: Any, url: str, expect: int) -> dict[str, str]:
    messages = receive_all(sqs, url, expect=expect, timeout=30)
    return {m["Body"]: m["MessageAttributes"]["reason"]["StringValue"] for m in messages}


def test_forged_messages_never_execute_and_land_in_the_dlq_with_a_reason(
    app: sessionmaker[Session],
    engine: sa.Engine,
    settings: OutboxSettings,
    sqs_endpoint: str,
    sqs: Any,
    queues: dict[str, str],
) -> None:
    worker = start_worker(settings, sqs_endpoint, SQLA_OUTBOX_WORKER_RUN_RELAY="true")
    try:
        worker.wait_for_action("worker.started")
        with app() as session, session.begin():
            real = Dispatch("audit", {"mode": "ok"})
            session.add(real)
        wait_for(lambda: status_of(engine, real.run_id) == "succeeded", timeout=20)
        genuine = envelope_of(engine, real.run_id)
        base = dict(genuine, run_id=str(uuid.uuid4()))
        bodies = {
            "{not json": "malformed-envelope:not-json",
            "null": "malformed-envelope:not-an-object",
            json.dumps({"v": 99}): "malformed-envelope:bad-version",
            json.dumps(dict(base, run_id=12345)): "malformed-envelope:bad-field",
            json.dumps(dict(base, tenant_id="1")): "malformed-envelope:bad-field",
            json.dumps(dict(base, queue="../urgent")): "malformed-envelope:bad-field",
            # a well-formed name (a declared queue, perhaps) that is not the queue it came from
            json.dumps(dict(base, queue="urgent")): "wrong-queue",
            json.dumps(dict(base, payload={"not": "text"})): "malformed-envelope:bad-field",
            json.dumps(dict(base, payload="{broken")): "malformed-envelope:bad-payload",
            json.dumps(base): "unknown-run",
            json.dumps(dict(genuine, task="send_welcome")): "envelope-mismatch",
            json.dumps({"v": 1, "pad": "x" * 200_000}): "malformed-envelope:bad-field",
        }
        for body in bodies:
            sqs.send_message(QueueUrl=queues["default"], MessageBody=body)
        found = dlq_reasons(sqs, queues["default-dlq"], expect=len(bodies))
        assert found == bodies
        assert len(effects(engine)) == 1  # only the genuine run ever executed
        assert worker.process.poll() is None
    finally:
        worker.kill()


def test_forged_copies_of_real_runs_with_other_content_never_execute(
    app: sessionmaker[Session],
    engine: sa.Engine,
    settings: OutboxSettings,
    sqs_endpoint: str,
    sqs: Any,
    queues: dict[str, str],
) -> None:
    """Without signing keys: a body naming a real run (right task and tenant) but carrying
    other content is refused while the run's outbox row exists: for a finished run, and for a
    queued one, which would otherwise execute the forged payload. A byte-identical copy of a
    finished run is an SQS duplicate: acknowledged and skipped."""
    worker = start_worker(settings, sqs_endpoint, SQLA_OUTBOX_WORKER_RUN_RELAY="true")
    try:
        worker.wait_for_action("worker.started")
        with app() as session, session.begin():
            done = Dispatch("audit", {"mode": "ok"})
            later = Dispatch("audit", {"mode": "ok"}, delay=dt.timedelta(hours=1))
            session.add_all([done, later])
        wait_for(lambda: status_of(engine, done.run_id) == "succeeded", timeout=20)
        finished = envelope_of(engine, done.run_id)
        queued = envelope_of(engine, later.run_id)
        forged = {
            json.dumps(dict(finished, payload=json.dumps({"mode": "record_payload", "evil": 1}))),
            json.dumps(dict(finished, idempotency_key="k")),
            json.dumps(dict(queued, payload=json.dumps({"mode": "record_payload", "evil": 2}))),
            json.dumps(dict(queued, trace={"traceparent": "00-" + "1" * 32 + "-" + "2" * 16 + "-01"})),
        }
        for body in forged:
            sqs.send_message(QueueUrl=queues["default"], MessageBody=body)
        sqs.send_message(QueueUrl=queues["default"], MessageBody=json.dumps(finished))  # exact copy
        found = dlq_reasons(sqs, queues["default-dlq"], expect=len(forged))
        assert found == dict.fromkeys(forged, "envelope-mismatch")
        wait_for(lambda: worker.actions("worker.duplicate"), timeout=20)
        assert status_of(engine, later.run_id) == "queued"
        assert run_row(engine, later.run_id).attempts == 0
        assert [e.run_id for e in effects(engine)] == [done.run_id]  # nothing forged ever ran
    finally:
        worker.kill()


def test_tricky_payloads_reach_a_real_handler_byte_for_byte(
    app: sessionmaker[Session],
    engine: sa.Engine,
    settings: OutboxSettings,
    sqs_endpoint: str,
    queues: dict[str, str],
) -> None:
    payloads = [
        {"mode": "record_payload", "z": 1, "a": 2, "float": 1e16, "small": 5e-324, "neg_zero": -0.0},
        {"mode": "record_payload", "nul": "a\x00b", "surrogate": "\ud800", "emoji": "🦆", "big": 2**70},
        {"mode": "record_payload", "dup": [1, 1.0, True, None, "", [], {}]},
    ]
    worker = start_worker(settings, sqs_endpoint, SQLA_OUTBOX_WORKER_RUN_RELAY="true")
    try:
        with app() as session, session.begin():
            items = [Dispatch("audit", payload) for payload in payloads]
            session.add_all(items)
        for item in items:
            wait_for(lambda item=item: status_of(engine, item.run_id) == "succeeded", timeout=30)
        for item, payload in zip(items, payloads, strict=True):
            [effect] = effects(engine, item.run_id)
            assert effect.note == json.dumps(payload)
    finally:
        worker.kill()


def test_oversized_body_is_refused_before_parsing(
    engine: sa.Engine, settings: OutboxSettings, sqs_endpoint: str, sqs: Any, queues: dict[str, str]
) -> None:
    """A body over the worker's limit (here 64 KiB) is not even parsed; the DLQ gets a summary.
    The queues match the worker's limit when it starts (it refuses larger ones); someone with
    rights on the queue raises its MaximumMessageSize afterwards."""
    for name, url in queues.items():
        if not name.endswith("-dlq"):
            sqs.set_queue_attributes(QueueUrl=url, Attributes={"MaximumMessageSize": "65536"})
    worker = start_worker(settings, sqs_endpoint, SQLA_OUTBOX_MAX_MESSAGE_BYTES="65536")
    try:
        worker.wait_for_action("worker.started")
        sqs.set_queue_attributes(QueueUrl=queues["default"], Attributes={"MaximumMessageSize": "262144"})
        sqs.send_message(QueueUrl=queues["default"], MessageBody="[" * 100_000)
        [message] = receive_all(sqs, queues["default-dlq"], expect=1, timeout=30)
        assert message["MessageAttributes"]["reason"]["StringValue"] == "malformed-envelope:too-large"
        summary = json.loads(message["Body"])
        assert summary == {
            "sqla_outbox_dlq_summary": True,
            "reason": "malformed-envelope:too-large",
            "original_size_bytes": 100_000,
        }
    finally:
        worker.kill()


def test_with_signing_a_forged_copy_of_a_finished_run_goes_to_the_dlq(
    app: sessionmaker[Session],
    engine: sa.Engine,
    settings: OutboxSettings,
    sqs_endpoint: str,
    sqs: Any,
    queues: dict[str, str],
) -> None:
    worker = start_worker(
        settings, sqs_endpoint, SQLA_OUTBOX_WORKER_RUN_RELAY="true", SQLA_OUTBOX_SIGNING_KEYS=KEY
    )
    try:
        worker.wait_for_action("worker.started")
        with app() as session, session.begin():
            real = Dispatch("audit", {"mode": "ok"})
            session.add(real)
        wait_for(lambda: status_of(engine, real.run_id) == "succeeded", timeout=20)
        body = json.dumps(envelope_of(engine, real.run_id), separators=(",", ":"))
        sqs.send_message(QueueUrl=queues["default"], MessageBody=body)  # unsigned copy
        sqs.send_message(
            QueueUrl=queues["default"],
            MessageBody=body,
            MessageAttributes={"signature": {"DataType": "String", "StringValue": "0" * 64}},
        )
        found = receive_all(sqs, queues["default-dlq"], expect=2, timeout=30)
        assert [m["MessageAttributes"]["reason"]["StringValue"] for m in found] == ["bad-signature"] * 2
        assert len(effects(engine, real.run_id)) == 1
    finally:
        worker.kill()


def test_no_pickle_eval_or_exec_in_the_library() -> None:
    """Nothing in the path from queue to handler can execute data: checked on the syntax tree."""
    import ast

    root = Path(__file__).resolve().parents[2] / "sqla_outbox"
    banned_modules = {"pickle", "cPickle", "marshal", "shelve", "dill", "yaml"}
    offenders = []
    for path in root.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [alias.name.split(".")[0] for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [(node.module or "").split(".")[0]]
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
                names = [node.func.id] if node.func.id in {"eval", "exec", "compile", "__import__"} else []
            else:
                continue
            offenders += [
                f"{path.relative_to(root)}:{node.lineno}: {name}"
                for name in names
                if name in banned_modules | {"eval", "exec", "compile", "__import__"}
            ]
    assert offenders == []


# --- the DLQ path (issue 12 (1)) --------------------------------------------------------------

ATTACKER = {"mode": "record_payload", "amount": 1_000_000, "to": "attacker"}


def _forge(sqs: Any, url: str, genuine: dict[str, Any], **attributes: str) -> None:
    """What anyone with SendMessage on the DLQ can write: the genuine envelope, the
    attacker's payload, the run's attributes plus ``attributes``."""
    document = {**json.loads(genuine["Body"]), "payload": json.dumps(ATTACKER)}
    sqs.send_message(
        QueueUrl=url,
        MessageBody=json.dumps(document, separators=(",", ":")),
        MessageAttributes={
            **{k: v for k, v in genuine["MessageAttributes"].items() if k in ("run_id", "task", "tenant_id")},
            **{k: {"DataType": "String", "StringValue": v} for k, v in attributes.items()},
        },
    )


def _attacker_ran(engine: sa.Engine) -> bool:
    return any("attacker" in (effect.note or "") for effect in effects(engine))


def test_dlq_requeue_without_signing_never_runs_a_forged_payload(
    app: sessionmaker[Session],
    engine: sa.Engine,
    settings: OutboxSettings,
    sqs_endpoint: str,
    sqs: Any,
    queues: dict[str, str],
) -> None:
    """Issue 12 (1), as seen: a failed ``charge_card`` run, its outbox row purged and its
    genuine DLQ message gone; a forged ``{"amount": 1000000, "to": "attacker"}`` put into
    the DLQ ran after a routine ``dlq requeue --task charge_card``."""
    env = service_env(settings, sqs_endpoint)
    worker = start_worker(settings, sqs_endpoint, SQLA_OUTBOX_WORKER_RUN_RELAY="true")
    try:
        worker.wait_for_action("worker.started")
        with app() as session, session.begin():
            charge = Dispatch("charge_card", {"mode": "keyerror", "amount": 10, "to": "shop"}, tenant_id=3)
            session.add(charge)
        wait_for(lambda: run_row(engine, charge.run_id).dead_lettered_at is not None, timeout=30)
        [genuine] = receive_all(sqs, queues["critical-dlq"], expect=1, timeout=10, visibility=0)
        sqs.purge_queue(QueueUrl=queues["critical-dlq"])  # retention: the genuine copy is gone
        with engine.begin() as conn:  # maintenance.purge: the row is gone
            conn.execute(sa.text("DELETE FROM outbox_messages WHERE run_id = :r"), {"r": charge.run_id})
        _forge(sqs, queues["critical-dlq"], genuine)  # straight into the DLQ: no verdict
        _forge(sqs, queues["critical-dlq"], genuine, reason="permanent-error")  # a made-up verdict

        report = cli_json(env, "dlq", "requeue", "--task", "charge_card")
        assert sorted(item["reason"] for item in report["items"]) == ["no-reason", "unverified"]
        assert report["requeued"] == 0 and status_of(engine, charge.run_id) == "failed"
        asked = cli_json(env, "dlq", "requeue", "--task", "charge_card", "--include-unverified")
        assert sorted(item["reason"] for item in asked["items"]) == ["no-reason", "unverifiable-body"]
        assert asked["requeued"] == 0 and status_of(engine, charge.run_id) == "failed"

        # trusting the bodies on request says what it trusts (dry run: nothing changes)
        shown = cli(env, "dlq", "requeue", "--task", "charge_card", "--trust-dlq-body", "--dry-run")
        assert shown.returncode == 0, shown.stderr
        assert "rebuilt from DLQ bodies nothing could verify" in " ".join(shown.stdout.split())
        time.sleep(2)  # what a relay and worker would do with a rebuilt row, they had time to do
        assert status_of(engine, charge.run_id) == "failed" and not _attacker_ran(engine)
        assert len(receive_all(sqs, queues["critical-dlq"], expect=2, timeout=10)) == 2  # left in place
    finally:
        worker.kill()


def test_dlq_requeue_with_signing_uses_only_the_signed_body(
    app: sessionmaker[Session],
    engine: sa.Engine,
    settings: OutboxSettings,
    sqs_endpoint: str,
    sqs: Any,
    queues: dict[str, str],
) -> None:
    """With signing keys the worker keeps the relay's signature on the DLQ copy; requeue
    rebuilds the purged row from that copy only, and the run runs again with its own payload."""
    env = service_env(settings, sqs_endpoint, SQLA_OUTBOX_SIGNING_KEYS=KEY)
    worker = start_worker(
        settings,
        sqs_endpoint,
        SQLA_OUTBOX_WORKER_RUN_RELAY="true",
        SQLA_OUTBOX_SIGNING_KEYS=KEY,
        SQLA_OUTBOX_WORKER_MAX_RECEIVES="1",
    )
    try:
        worker.wait_for_action("worker.started")
        with app() as session, session.begin():
            charge = Dispatch("charge_card", {"mode": "fail_times", "times": 1, "to": "shop"}, tenant_id=3)
            session.add(charge)
        wait_for(lambda: run_row(engine, charge.run_id).dead_lettered_at is not None, timeout=30)
        [genuine] = receive_all(sqs, queues["critical-dlq"], expect=1, timeout=10, visibility=0)
        signature = genuine["MessageAttributes"]["signature"]["StringValue"]
        assert envelope.signature_valid(genuine["Body"], signature, [KEY])
        with engine.begin() as conn:
            conn.execute(sa.text("DELETE FROM outbox_messages WHERE run_id = :r"), {"r": charge.run_id})
        _forge(sqs, queues["critical-dlq"], genuine, reason="permanent-error")
        _forge(sqs, queues["critical-dlq"], genuine, reason="permanent-error", signature="0" * 64)

        report = cli_json(env, "dlq", "requeue", "--task", "charge_card")
        [requeued] = [item for item in report["items"] if item["action"] == "requeued"]
        assert (requeued["outbox"], requeued["body_origin"], requeued["dlq_deleted"]) == (
            "recreated",
            "verified",
            1,
        )
        assert sorted(item["reason"] for item in report["items"] if item["action"] == "skipped") == [
            "unverified",
            "unverified",
        ]
        wait_for(lambda: status_of(engine, charge.run_id) == "succeeded", timeout=30)
        assert [effect.note for effect in effects(engine, charge.run_id)] == ["fail_times"]
        left = cli_json(env, "dlq", "list", "--task", "charge_card")["letters"]
        assert [letter["origin"] for letter in left] == ["unverified", "unverified"]
        assert not _attacker_ran(engine)
    finally:
        worker.kill()


# --- copies that bend the rules (issue 12 (4)) ------------------------------------------------


def test_an_early_copy_of_a_delayed_run_never_runs_it_before_its_due_time(
    app: sessionmaker[Session],
    engine: sa.Engine,
    settings: OutboxSettings,
    sqs_endpoint: str,
    sqs: Any,
    queues: dict[str, str],
) -> None:
    """Without signing, an exact copy of a delayed run's message ran it at once. Now a copy
    due within a minute waits in the queue until the due time (the run then runs once);
    a copy due later is deleted while the relay still holds the run's own message, and
    waits until the due time when the row was already sent. No attempt is spent."""
    worker = start_worker(settings, sqs_endpoint, SQLA_OUTBOX_WORKER_RUN_RELAY="true")
    try:
        worker.wait_for_action("worker.started")
        with app() as session, session.begin():
            soon = Dispatch("audit", {"mode": "ok"}, delay=dt.timedelta(seconds=6))
            later = Dispatch("audit", {"mode": "ok", "n": 2}, delay=dt.timedelta(hours=1))
            sent = Dispatch("audit", {"mode": "ok", "n": 3}, delay=dt.timedelta(hours=1))
            session.add_all([soon, later, sent])
        with engine.begin() as conn:  # as if the relay had sent it (a clock that stepped back)
            conn.execute(
                sa.text("UPDATE platform_outbox_messages SET sent_at = clock_timestamp() WHERE run_id = :r"),
                {"r": sent.run_id},
            )
        for run in (soon, later, sent):
            body = json.dumps(envelope_of(engine, run.run_id), separators=(",", ":"))
            sqs.send_message(QueueUrl=queues["default"], MessageBody=body)
        deleted = worker.wait_for_action("worker.early_copy")
        worker.wait_for_action("worker.not_due", count=2)
        hidden = {entry["run_id"]: entry["hide_s"] for entry in worker.actions("worker.not_due")}
        assert deleted["run_id"] == str(later.run_id)
        assert 1 <= hidden[str(soon.run_id)] <= 7 and hidden[str(sent.run_id)] > 3000
        assert [run_row(engine, r.run_id).attempts for r in (soon, later, sent)] == [0, 0, 0]
        assert effects(engine) == []
        wait_for(lambda: status_of(engine, soon.run_id) == "succeeded", timeout=30)
        run = run_row(engine, soon.run_id)
        assert run.started_at >= run.available_at and run.attempts == 1
        time.sleep(2)  # the copy, due too, comes back beside the relay's own message
        assert len(effects(engine, soon.run_id)) == 1
        assert [status_of(engine, r.run_id) for r in (later, sent)] == ["queued", "queued"]
    finally:
        worker.kill()


def test_a_copy_sent_to_another_queue_is_refused_there(
    app: sessionmaker[Session],
    engine: sa.Engine,
    settings: OutboxSettings,
    sqs_endpoint: str,
    sqs: Any,
    queues: dict[str, str],
) -> None:
    """Without signing, a copy sent to another queue ran there, under that queue's
    visibility timeout. Now it is dead-lettered there as ``wrong-queue``, unexecuted."""
    worker = start_worker(settings, sqs_endpoint, SQLA_OUTBOX_WORKER_RUN_RELAY="true")
    try:
        worker.wait_for_action("worker.started")
        with app() as session, session.begin():
            done = Dispatch("audit", {"mode": "ok"})
            session.add(done)
        wait_for(lambda: status_of(engine, done.run_id) == "succeeded", timeout=20)
        with engine.begin() as conn:  # a queued run whose message is already out (a retry, say)
            conn.execute(
                sa.text("UPDATE task_runs SET status = 'queued', finished_at = NULL WHERE run_id = :r"),
                {"r": done.run_id},
            )
        body = json.dumps(envelope_of(engine, done.run_id), separators=(",", ":"))
        sqs.send_message(QueueUrl=queues["bulk"], MessageBody=body)
        [letter] = receive_all(sqs, queues["bulk-dlq"], expect=1, timeout=30)
        assert letter["MessageAttributes"]["reason"]["StringValue"] == "wrong-queue"
        assert (status_of(engine, done.run_id), len(effects(engine, done.run_id))) == ("queued", 1)
    finally:
        worker.kill()


# --- what reaches an operator's terminal (issue 12 (5)) ----------------------------------------


def test_dlq_list_shows_attacker_attributes_escaped(
    settings: OutboxSettings, sqs_endpoint: str, sqs: Any, queues: dict[str, str]
) -> None:
    """Attributes come from whoever wrote to the DLQ: escape sequences, a bidi override and
    C1 controls are shown as visible escapes, never sent to the terminal. (SQS refuses C0
    controls such as ESC in attribute values, but takes the C1 ones: CSI, OSC and ST
    introduce escape sequences on terminals that honour 8-bit controls.)"""
    sqs.send_message(
        QueueUrl=queues["default-dlq"],
        MessageBody="{}",
        MessageAttributes={
            "run_id": {"DataType": "String", "StringValue": str(uuid.uuid4())},
            "task": {"DataType": "String", "StringValue": "\x9d0;pwned\x9c\x9b2Jaudit"},
            "reason": {"DataType": "String", "StringValue": "permanent\u202eerror"},
            "error_type": {"DataType": "String", "StringValue": "Value\u0085Error\u200b"},
        },
    )
    env = service_env(settings, sqs_endpoint, COLUMNS="300")
    shown = cli(env, "dlq", "list")
    assert shown.returncode == 0, shown.stderr
    assert not any(char in shown.stdout for char in "\x9b\x9c\x9d\u202e\u0085\u200b")
    text = "".join(shown.stdout.split())
    assert "\\x9d0;pwned\\x9c\\x9b2Jaudit" in text
    assert "permanent\\u202eerror" in text and "Value\\x85Error\\u200b" in text


def test_the_dlq_copy_of_a_run_carries_the_runs_own_attributes_not_the_received_ones(
    app: sessionmaker[Session],
    engine: sa.Engine,
    settings: OutboxSettings,
    sqs_endpoint: str,
    sqs: Any,
    queues: dict[str, str],
) -> None:
    """A copy of a run's message (its exact envelope) relabelled ``task=audit``,
    ``tenant_id=9`` runs as what it is; when the run fails for good, its DLQ message names
    the run's task and tenant, not the labels it came with (they steered requeues before)."""
    from sqla_outbox.relay import Relay

    with app() as session, session.begin():
        charge = Dispatch("charge_card", {"mode": "keyerror", "amount": 10}, tenant_id=3)
        session.add(charge)
    relay = Relay(settings.replace(sqs_endpoint_url=sqs_endpoint), engine=engine)
    try:
        relay.run_once()
    finally:
        relay.sender.close()
    [genuine] = receive_all(sqs, queues["critical"], expect=1, timeout=10)
    sqs.delete_message(QueueUrl=queues["critical"], ReceiptHandle=genuine["ReceiptHandle"])
    sqs.send_message(
        QueueUrl=queues["critical"],
        MessageBody=genuine["Body"],
        MessageAttributes=envelope.message_attributes(charge.run_id, "audit", 9),
    )
    worker = start_worker(settings, sqs_endpoint)
    try:
        wait_for(lambda: run_row(engine, charge.run_id).dead_lettered_at is not None, timeout=30)
    finally:
        worker.kill()
    [message] = receive_all(sqs, queues["critical-dlq"], expect=1, timeout=10)
    attributes = {k: v["StringValue"] for k, v in message["MessageAttributes"].items()}
    assert (attributes["run_id"], attributes["task"], attributes["tenant_id"]) == (
        str(charge.run_id),
        "charge_card",
        "3",
    )
