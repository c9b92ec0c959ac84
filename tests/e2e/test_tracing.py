"""Trace context travels from the dispatching transaction to the worker's handler span."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import sqlalchemy as sa
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from sqlalchemy.orm import Session, sessionmaker

from sqla_outbox import Dispatch
from sqla_outbox.config import OutboxSettings
from tests.support import outbox_rows, start_worker, status_of, wait_for

pytestmark = pytest.mark.e2e


def test_handler_span_continues_the_dispatching_trace(
    app: sessionmaker[Session],
    engine: sa.Engine,
    settings: OutboxSettings,
    sqs_endpoint: str,
    queues: dict[str, str],
    tmp_path: Path,
) -> None:
    tracer = TracerProvider().get_tracer("shop")
    with tracer.start_as_current_span("POST /orders") as request_span:
        with app() as session, session.begin():
            item = Dispatch("audit", {"mode": "ok"})
            session.add(item)
    request = request_span.get_span_context()
    [row] = outbox_rows(engine)
    traceparent = row.envelope["trace"]["traceparent"]
    assert traceparent.startswith(f"00-{request.trace_id:032x}-{request.span_id:016x}-")

    spans_file = tmp_path / "spans.jsonl"
    worker = start_worker(
        settings,
        sqs_endpoint,
        imports="tests.e2e.otel_setup,tests.e2e.worker_tasks",
        SQLA_OUTBOX_WORKER_RUN_RELAY="true",
        OTEL_TEST_SPANS_FILE=str(spans_file),
    )
    try:
        wait_for(lambda: status_of(engine, item.run_id) == "succeeded", timeout=20)
        wait_for(spans_file.exists, timeout=5)
    finally:
        worker.terminate()
    [span] = [json.loads(line) for line in spans_file.read_text().splitlines()]
    assert span["name"] == "audit process"
    assert span["trace_id"] == f"{request.trace_id:032x}"
    assert span["parent_span_id"] == f"{request.span_id:016x}"
    assert span["attributes"]["sqla_outbox.run_id"] == str(item.run_id)
    assert span["attributes"]["sqla_outbox.attempt"] == 1


def test_without_a_current_span_the_envelope_carries_no_trace(
    app: sessionmaker[Session], engine: sa.Engine
) -> None:
    assert not trace.get_current_span().get_span_context().is_valid
    with app() as session, session.begin():
        session.add(Dispatch("audit", {}))
    assert "trace" not in outbox_rows(engine)[0].envelope
