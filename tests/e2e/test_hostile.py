"""Bad and hostile input: what others put on our queues never runs and ends in the DLQ."""

from __future__ import annotations

import datetime as dt
import json
import uuid
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.orm import Session, sessionmaker

from sqla_outbox import Dispatch
from sqla_outbox.config import OutboxSettings
from tests.support import effects, receive_all, run_row, start_worker, status_of, wait_for

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
            json.dumps(dict(base, queue="urgent")): "malformed-envelope:bad-field",
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
    """A body over the worker's limit (here 64 KiB) is not even parsed; the DLQ gets a summary."""
    worker = start_worker(settings, sqs_endpoint, SQLA_OUTBOX_MAX_MESSAGE_BYTES="65536")
    try:
        worker.wait_for_action("worker.started")
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
