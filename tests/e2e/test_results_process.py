"""Handler results through real worker processes: stored with ``succeeded``, read with a wait."""

from __future__ import annotations

import asyncio
import json
import threading
import time
import uuid
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.orm import Session, sessionmaker

from sqla_outbox import Dispatch, errors, results
from sqla_outbox.config import OutboxSettings, sqlalchemy_url
from tests.support import effects, receive_all, run_row, trail, wait_for

pytestmark = pytest.mark.e2e


def dispatch(app: sessionmaker[Session], task: str, payload: dict[str, Any], **options: Any) -> uuid.UUID:
    with app() as session, session.begin():
        item = Dispatch(task, payload, **options)
        session.add(item)
    return item.run_id


QUOTE = {"appointment_id": 7, "price_cents": 12_500, "currency": "EUR", "lines": ["cut", "colour"]}


def test_result_round_trip_sync_and_async(
    app: sessionmaker[Session], engine: sa.Engine, settings: OutboxSettings, worker_with_relay: Any
) -> None:
    worker_with_relay()
    run_id = dispatch(app, "audit", {"mode": "result", "value": QUOTE})
    got = results.get_result(engine, run_id, wait=20)
    assert (got.status, got.value, got.succeeded) == ("succeeded", QUOTE, True)
    assert run_row(engine, run_id).result == QUOTE
    assert len(effects(engine, run_id)) == 1  # committed with the result, in one transaction
    with app() as session:
        assert results.get_result(session, run_id).value == QUOTE

    async_run = dispatch(app, "index_user", {"mode": "result", "value": [1, "two", None]})

    async def read() -> results.RunResult:
        from sqlalchemy.ext.asyncio import AsyncSession, create_async_engine

        async_engine = create_async_engine(sqlalchemy_url(settings.database_url))
        try:
            waited = await results.get_result_async(async_engine, async_run, wait=20)
            async with AsyncSession(async_engine) as session:
                again = await results.get_result_async(session, async_run)
            assert again == waited
            return waited
        finally:
            await async_engine.dispose()

    got = asyncio.run(read())
    assert (got.status, got.value) == ("succeeded", [1, "two", None])


def test_too_large_and_non_json_results_fail_the_run_permanently(
    app: sessionmaker[Session],
    engine: sa.Engine,
    worker_with_relay: Any,
    sqs: Any,
    queues: dict[str, str],
) -> None:
    worker_with_relay(SQLA_OUTBOX_RESULT_MAX_BYTES="1000")
    fits = dispatch(app, "audit", {"mode": "big_result", "size": 998})  # 998 x + 2 quotes
    large = dispatch(app, "audit", {"mode": "big_result", "size": 999})
    not_json = dispatch(app, "audit", {"mode": "not_json_result"})
    assert results.get_result(engine, fits, wait=20).value == "x" * 998
    big = results.get_result(engine, large, wait=20)
    assert big.status == "failed" and big.value is None
    assert big.error_type == "sqla_outbox.errors.ResultTooLarge"
    assert "1001 bytes of JSON, over the 1000-byte limit" in (big.error or "")
    odd = results.get_result(engine, not_json, wait=20)
    assert odd.status == "failed" and odd.error_type == "sqla_outbox.errors.ResultNotSerializable"
    assert run_row(engine, large).attempts == 1  # permanent: not retried
    assert effects(engine, large) == []  # the handler's session was rolled back
    wait_for(lambda: run_row(engine, not_json).dead_lettered_at is not None, timeout=15)
    dead = receive_all(sqs, queues["default-dlq"], expect=2, timeout=10)
    reasons = {json.loads(m["Body"])["run_id"]: m["MessageAttributes"]["reason"]["StringValue"] for m in dead}
    assert reasons == {str(large): "permanent-error", str(not_json): "permanent-error"}
    assert [t.status for t in trail(engine, large)][-1] == "failed"


def test_wait_times_out_for_an_unfinished_run(app: sessionmaker[Session], engine: sa.Engine) -> None:
    run_id = dispatch(app, "audit", {"mode": "ok"}, delay=3600)
    started = time.monotonic()
    with pytest.raises(errors.ResultTimeout) as caught:
        results.get_result(engine, run_id, wait=0.5)
    waited = time.monotonic() - started
    assert 0.5 <= waited < 1.5
    assert caught.value.status == "queued" and caught.value.run_id == run_id
    assert results.get_result(engine, run_id).finished is False
    with pytest.raises(errors.RunNotFound):
        results.get_result(engine, uuid.uuid4())
    with pytest.raises(errors.ConfigurationError, match="wait"):
        results.get_result(engine, run_id, wait=-1)


def test_a_wait_waits_for_a_run_that_does_not_exist_yet(engine: sa.Engine) -> None:
    """Trial finding: waiting on a group's completion run (written when the last member
    finishes) raised RunNotFound at once; a wait now waits for the run to appear."""
    run_id = uuid.uuid4()

    def finish_later() -> None:
        time.sleep(0.4)
        with engine.begin() as conn:
            conn.execute(
                sa.text(
                    "INSERT INTO task_runs (run_id, task, queue, available_at, status, finished_at, result) "
                    "VALUES (:r, 'rebuild_cache', 'maintenance', now(), 'succeeded', now(), '{\"ok\": 1}')"
                ),
                {"r": run_id},
            )

    writer = threading.Thread(target=finish_later)
    writer.start()
    try:
        record = results.get_result(engine, run_id, wait=10)
    finally:
        writer.join()
    assert (record.status, record.value) == ("succeeded", {"ok": 1})
    started = time.monotonic()
    with pytest.raises(errors.RunNotFound, match="not committed yet"):
        results.get_result(engine, uuid.uuid4(), wait=0.3)
    assert time.monotonic() - started >= 0.3
