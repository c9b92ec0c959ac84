"""The operations modules (status, runs, dlq, requeue) against real PostgreSQL, Redis and moto SQS.

Failed runs are produced with the worker's own code path (take the lease, mark failed,
dead-letter with the error context, record the DLQ send), not with hand-made rows.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import redis
import sqlalchemy as sa
from sqlalchemy.orm import Session, sessionmaker

from sqla_outbox import Dispatch, envelope, errors
from sqla_outbox.config import OutboxSettings
from sqla_outbox.lifecycle import attempts
from sqla_outbox.ops import dlq, requeue, resend, runs, status
from sqla_outbox.relay import Relay
from sqla_outbox.sqs.client import QueueDirectory
from sqla_outbox.wakeup import Waker
from sqla_outbox.worker.outcome import Outcomes
from tests.support import receive_all, run_row, trail

SECRET = "s3cr3t-card-4242"


@pytest.fixture
def ops_settings(settings: OutboxSettings, sqs_endpoint: str, queues: dict[str, str]) -> OutboxSettings:
    return settings.replace(sqs_endpoint_url=sqs_endpoint)


@pytest.fixture
def relay(ops_settings: OutboxSettings, engine: sa.Engine) -> Iterator[Relay]:
    relay = Relay(ops_settings, engine=engine)
    yield relay
    relay.sender.close()


@pytest.fixture
def waker(ops_settings: OutboxSettings) -> Iterator[Waker]:
    waker = Waker(ops_settings)
    yield waker
    waker.close()


def dispatch(app: sessionmaker[Session], task: str, payload: dict[str, Any], **options: Any) -> uuid.UUID:
    with app() as session, session.begin():
        item = Dispatch(task, payload, **options)
        session.add(item)
    assert item.resolved_run_id is not None
    return item.resolved_run_id


def fail_into_dlq(
    engine: sa.Engine,
    sqs: Any,
    settings: OutboxSettings,
    queue: str,
    run_ids: set[uuid.UUID],
    *,
    failed_at: dt.datetime | dict[uuid.UUID, dt.datetime] | None = None,
) -> dict[uuid.UUID, dict[str, Any]]:
    """Receive the runs' messages from ``queue`` and take the worker's permanent path.

    ``failed_at`` (one time, or one per run) backdates the DLQ ``failed_at`` attribute.
    Returns the original SQS message of each run.
    """
    directory = QueueDirectory(sqs, settings)
    outcomes = Outcomes(sqs, directory, max_message_bytes=settings.max_message_bytes)
    found: dict[uuid.UUID, dict[str, Any]] = {}
    for message in receive_all(sqs, directory.url(queue), expect=len(run_ids), timeout=10):
        env = envelope.decode(message["Body"], max_bytes=settings.max_message_bytes)
        if env.run_id not in run_ids:
            continue
        with engine.begin() as conn:
            claim = attempts.take_lease(
                conn,
                run_id=env.run_id,
                task=env.task,
                tenant_id=env.tenant_id,
                worker_id="test-worker",
                lease_seconds=60,
                receive_count=1,
            )
            attempt = attempts.Attempt(env.run_id, claim.attempt, 1, "test-worker")
            failure = attempts.Failure(
                "ValueError", "order 7 has no lines", "Traceback ...\nValueError: order 7"
            )
            assert attempts.mark_failed(conn, attempt, failure, reason="permanent-error")
        context = {
            "reason": "permanent-error",
            "error_type": "ValueError",
            "error_message": "order 7 has no lines",
            "failed_at": (
                (failed_at.get(env.run_id) if isinstance(failed_at, dict) else failed_at)
                or dt.datetime.now(dt.UTC)
            ).isoformat(timespec="milliseconds"),
            "receive_count": "1",
            "source_queue": queue,
            "worker_id": "test-worker",
        }
        dlq_url = outcomes.dead_letter(
            queue, message["ReceiptHandle"], message["Body"], message["MessageAttributes"], context
        )
        with engine.begin() as conn:
            attempts.mark_dead_lettered(
                conn, env.run_id, receive_count=1, worker_id="test-worker", dlq=dlq_url.rsplit("/", 1)[-1]
            )
        found[env.run_id] = message
    assert set(found) == run_ids
    return found


def outbox_row(engine: sa.Engine, run_id: uuid.UUID) -> Any:
    with engine.connect() as conn:
        return conn.execute(
            sa.text(
                "SELECT 'tenant' AS kind, run_id, queue, envelope, sent_at, attempts, available_at "
                "FROM outbox_messages WHERE run_id = :r UNION ALL "
                "SELECT 'platform', run_id, queue, envelope, sent_at, attempts, available_at "
                "FROM platform_outbox_messages WHERE run_id = :r"
            ),
            {"r": run_id},
        ).one_or_none()


def execute(engine: sa.Engine, sql: str, **params: Any) -> None:
    with engine.begin() as conn:
        conn.execute(sa.text(sql), params)


def visible_messages(sqs: Any, url: str, expect: int | None = None) -> list[dict[str, Any]]:
    """Receive (and hide) what is visible now; the scans above must have released it."""
    return receive_all(sqs, url, expect=expect, timeout=5)


# --- status --------------------------------------------------------------------------------


def test_status_reports_pending_rows_runs_stale_leases_and_queue_depths(
    app: sessionmaker[Session],
    engine: sa.Engine,
    ops_settings: OutboxSettings,
    sqs: Any,
    queues: dict[str, str],
) -> None:
    late = dispatch(app, "audit", {"n": 1})
    dispatch(app, "audit", {"n": 2})
    dispatch(app, "audit", {"n": 3}, tenant_id=3, delay=dt.timedelta(hours=1))
    charge = dispatch(app, "charge_card", {"n": 4}, tenant_id=1)
    execute(
        engine,
        "UPDATE platform_outbox_messages SET created_at = clock_timestamp() - interval '2 hours', "
        "available_at = clock_timestamp() - interval '1 hour' WHERE run_id = :r",
        r=late,
    )
    stale = dispatch(app, "send_welcome", {"n": 5})
    fresh = dispatch(app, "send_welcome", {"n": 6})
    execute(
        engine,
        "UPDATE task_runs SET status = 'running', lease_owner = 'host:1', "
        "lease_expires_at = clock_timestamp() - interval '1 hour' WHERE run_id = :r",
        r=stale,
    )
    execute(
        engine,
        "UPDATE task_runs SET status = 'running', lease_owner = 'host:2', "
        "lease_expires_at = clock_timestamp() - interval '1 minute' WHERE run_id = :r",
        r=fresh,
    )
    execute(engine, "UPDATE task_runs SET status = 'succeeded' WHERE run_id = :r", r=charge)
    for _ in range(2):
        sqs.send_message(QueueUrl=queues["default-dlq"], MessageBody="{}")
    sqs.send_message(QueueUrl=queues["critical"], MessageBody="{}")

    with engine.connect() as conn:
        report = status.collect(conn, ops_settings, client=sqs, stale_after_seconds=900)

    pending = {(p.table, p.queue): p for p in report.pending}
    assert set(pending) == {
        ("outbox_messages", "critical"),
        ("outbox_messages", "default"),
        ("platform_outbox_messages", "default"),
    }
    platform = pending[("platform_outbox_messages", "default")]
    assert (platform.pending, platform.due, platform.max_attempts) == (4, 4, 0)
    assert platform.oldest_pending_age_seconds == pytest.approx(7200, abs=30)
    assert platform.oldest_due_age_seconds == pytest.approx(3600, abs=30)
    delayed = pending[("outbox_messages", "default")]
    assert (delayed.pending, delayed.due, delayed.oldest_due_age_seconds) == (1, 0, None)
    assert report.runs_by_status == {
        "queued": 3,
        "running": 2,
        "retrying": 0,
        "succeeded": 1,
        "failed": 0,
        "cancelled": 0,
    }
    assert report.stale_running_count == 1
    [flagged] = report.stale_running
    assert (flagged.run_id, flagged.lease_owner) == (str(stale), "host:1")
    assert flagged.lease_expired_seconds_ago == pytest.approx(3600, abs=30)
    assert report.queues is not None and len(report.queues) == 8
    depths = {(q.queue, q.dead_letter): q for q in report.queues}
    assert all(q.error is None for q in report.queues)
    assert depths[("default", True)].visible == 2
    assert depths[("critical", False)].visible == 1
    assert depths[("bulk", False)].visible == 0 and depths[("default", True)].not_visible == 0


def test_queue_depths_report_missing_queues_instead_of_raising(
    ops_settings: OutboxSettings, sqs: Any
) -> None:
    depths = status.queue_depths(sqs, ops_settings.replace(queue_prefix="never-provisioned-"))
    assert len(depths) == 8
    assert all(d.visible is None and d.error and "NonExistentQueue" in d.error for d in depths)


# --- runs ----------------------------------------------------------------------------------


def test_get_run_returns_the_run_and_its_whole_trail(
    app: sessionmaker[Session], engine: sa.Engine, ops_settings: OutboxSettings, sqs: Any, relay: Relay
) -> None:
    run_id = dispatch(app, "charge_card", {"card": SECRET}, tenant_id=5)
    relay.run_once()
    fail_into_dlq(engine, sqs, ops_settings, "critical", {run_id})

    with engine.connect() as conn:
        detail = runs.get_run(conn, run_id)
        with_tb = runs.get_run(conn, run_id, with_traceback=True)

    assert (detail.run.run_id, detail.run.task, detail.run.tenant_id) == (run_id, "charge_card", 5)
    assert (detail.run.status, detail.run.attempts, detail.run.last_error_type) == ("failed", 1, "ValueError")
    assert detail.run.dead_lettered_at is not None and detail.run.age_seconds >= 0
    assert [(t.status, t.attempt, t.worker_id) for t in detail.trail] == [
        ("running", 1, "test-worker"),
        ("failed", 1, "test-worker"),
        ("failed", None, "test-worker"),
    ]
    failed = detail.trail[1]
    assert (failed.error_type, failed.error_message) == ("ValueError", "order 7 has no lines")
    assert failed.detail == {"reason": "permanent-error"}
    assert detail.trail[2].detail == {"dead_lettered": True, "dlq": ops_settings.dlq_url_name("critical")}
    assert all(t.traceback is None for t in detail.trail)
    assert with_tb.trail[1].traceback is not None and "ValueError" in with_tb.trail[1].traceback


def test_get_run_of_an_unknown_run_raises_run_not_found(engine: sa.Engine) -> None:
    missing = uuid.uuid4()
    with engine.connect() as conn, pytest.raises(runs.RunNotFound) as caught:
        runs.get_run(conn, missing)
    assert caught.value.run_id == missing and str(missing) in str(caught.value)


def test_list_runs_filters_by_task_status_tenant_queue_and_age(
    app: sessionmaker[Session], engine: sa.Engine
) -> None:
    audit = dispatch(app, "audit", {})
    charge_1 = dispatch(app, "charge_card", {}, tenant_id=1)
    charge_2 = dispatch(app, "charge_card", {}, tenant_id=2)
    welcome_1 = dispatch(app, "send_welcome", {}, tenant_id=1)
    execute(
        engine, "UPDATE task_runs SET created_at = created_at - interval '3 hours' WHERE run_id = :r", r=audit
    )
    execute(
        engine,
        "UPDATE task_runs SET created_at = created_at - interval '2 days' WHERE run_id = :r",
        r=charge_1,
    )
    execute(
        engine, "UPDATE task_runs SET status = 'failed' WHERE run_id IN (:a, :b)", a=charge_1, b=welcome_1
    )

    def ids(**filters: Any) -> list[uuid.UUID]:
        with engine.connect() as conn:
            return [r.run_id for r in runs.list_runs(conn, runs.RunFilter(**filters))]

    assert ids() == [welcome_1, charge_2, audit, charge_1]  # newest first
    assert ids(tasks=("charge_card",)) == [charge_2, charge_1]
    assert ids(statuses=("failed",)) == [welcome_1, charge_1]
    assert ids(tenant_id=1) == [welcome_1, charge_1]
    assert ids(tenant_id="platform") == [audit]
    assert ids(queues=("critical",)) == [charge_2, charge_1]
    assert ids(older_than=dt.timedelta(hours=1)) == [audit, charge_1]
    assert ids(newer_than=dt.timedelta(days=1)) == [welcome_1, charge_2, audit]
    assert ids(older_than=dt.timedelta(hours=1), newer_than=dt.timedelta(days=1)) == [audit]
    assert ids(tasks=("charge_card",), statuses=("failed",), tenant_id=1) == [charge_1]
    assert ids(limit=2) == [welcome_1, charge_2]
    with engine.connect() as conn:
        [record] = runs.list_runs(conn, runs.RunFilter(tenant_id="platform"))
    assert record.age_seconds == pytest.approx(3 * 3600, abs=60)


def test_keyset_pages_reach_every_run_once_even_when_runs_share_a_creation_time(
    app: sessionmaker[Session], engine: sa.Engine
) -> None:
    with app() as session, session.begin():
        for i in range(30):
            session.add(Dispatch("send_welcome", {"i": i}, tenant_id=1 + i % 2))
    # groups of 4 runs created at the very same instant: only run_id orders them
    execute(
        engine,
        "UPDATE task_runs SET created_at = t.at FROM (SELECT run_id, timestamptz '2026-11-30 10:00Z' "
        "+ (row_number() OVER (ORDER BY run_id) / 4) * interval '1 second' AS at FROM task_runs) t "
        "WHERE task_runs.run_id = t.run_id",
    )
    with engine.connect() as conn:
        everything = [r.run_id for r in runs.list_runs(conn, runs.RunFilter(limit=100))]
        assert len(everything) == 30
        forward: list[list[uuid.UUID]] = []
        page = runs.list_runs(conn, runs.RunFilter(limit=7))
        while page:
            forward.append([r.run_id for r in page])
            last = runs.RunCursor(page[-1].created_at, page[-1].run_id)
            page = runs.list_runs(conn, runs.RunFilter(limit=7, before=last))
        backward: list[list[uuid.UUID]] = []
        page = runs.list_runs(conn, runs.RunFilter(limit=100))[-7:]
        while page:
            backward.append([r.run_id for r in page])
            first = runs.RunCursor(page[0].created_at, page[0].run_id)
            page = runs.list_runs(conn, runs.RunFilter(limit=7, after=first))
        tenant = [r.run_id for r in runs.list_runs(conn, runs.RunFilter(tenant_id=2, limit=100))]
        with pytest.raises(errors.ConfigurationError, match="give one of before and after"):
            runs.list_runs(conn, runs.RunFilter(before=last, after=first))
    assert [run_id for chunk in forward for run_id in chunk] == everything
    assert [len(chunk) for chunk in forward] == [7, 7, 7, 7, 2]
    assert [run_id for chunk in reversed(backward) for run_id in chunk] == everything
    assert tenant == [run_id for run_id in everything if run_id in set(tenant)] and len(tenant) == 15


# --- dlq list ------------------------------------------------------------------------------


def test_list_dead_letters_shows_metadata_never_payloads_and_leaves_the_messages(
    app: sessionmaker[Session],
    engine: sa.Engine,
    ops_settings: OutboxSettings,
    sqs: Any,
    queues: dict[str, str],
    relay: Relay,
) -> None:
    audit = dispatch(app, "audit", {"card": SECRET})
    charge = dispatch(app, "charge_card", {"card": SECRET}, tenant_id=5)
    relay.run_once()
    two_hours_ago = dt.datetime.now(dt.UTC) - dt.timedelta(hours=2)
    fail_into_dlq(engine, sqs, ops_settings, "default", {audit}, failed_at=two_hours_ago)
    fail_into_dlq(engine, sqs, ops_settings, "critical", {charge})
    sqs.send_message(QueueUrl=queues["bulk-dlq"], MessageBody="not json " + SECRET)
    ghost = uuid.uuid4()
    sqs.send_message(  # what the SQS redrive moves (original attributes only, no verdict), or a forgery
        QueueUrl=queues["bulk-dlq"],
        MessageBody=json.dumps({"v": 1, "run_id": str(ghost), "task": "index_user", "payload": SECRET}),
        MessageAttributes=envelope.message_attributes(ghost, "index_user", 9),
    )

    with engine.connect() as conn:
        listing = dlq.list_dead_letters(sqs, ops_settings, dlq.DeadLetterFilter(), connection=conn)

    assert listing.missing_queues == [] and not listing.truncated
    assert listing.scanned == {"critical": 1, "default": 1, "bulk": 2, "maintenance": 0}
    by_run = {x.run_id: x for x in listing.letters}
    assert set(by_run) == {audit, charge, ghost, None}
    assert dataclasses.asdict(by_run[charge]) | {
        "failed_at": None,
        "age_seconds": None,
        "message_id": None,
    } == {
        "queue": "critical",
        "dlq": ops_settings.dlq_url_name("critical"),
        "message_id": None,
        "run_id": charge,
        "task": "charge_card",
        "tenant_id": 5,
        "reason": "permanent-error",
        "error_type": "ValueError",
        "receive_count": 1,
        "failed_at": None,
        "age_seconds": None,
        "run_status": "failed",
        "origin": "ledger",  # no signing keys, but the body is the run's outbox envelope
        "resolved": True,
        "claims": (),
        "run_queue": "critical",
        "run_failed_age_seconds": by_run[charge].run_failed_age_seconds,
        "digest": by_run[charge].digest,
    }
    assert by_run[audit].age_seconds == pytest.approx(7200, abs=60)
    assert (by_run[audit].tenant_id, by_run[audit].run_status) == (None, "failed")
    assert (by_run[ghost].reason, by_run[ghost].tenant_id, by_run[ghost].run_status) == (
        dlq.NO_REASON,
        9,
        None,
    )
    assert by_run[ghost].origin == "unverified"  # no such run: nothing vouches for it
    assert (by_run[None].task, by_run[None].reason) == (None, dlq.NO_REASON)
    assert SECRET not in repr(listing) and SECRET not in json.dumps(dataclasses.asdict(listing), default=str)

    def select(**filters: Any) -> set[uuid.UUID | None]:
        found = dlq.list_dead_letters(sqs, ops_settings, dlq.DeadLetterFilter(**filters))
        return {x.run_id for x in found.letters}

    assert select(tasks=("charge_card",)) == {charge}
    assert select(queues=("bulk",)) == {ghost, None}
    assert select(older_than=dt.timedelta(hours=1)) == {audit}
    assert select(queues=("default", "critical"), older_than=dt.timedelta(minutes=1)) == {audit}
    # nothing was deleted, and every scan released what it received
    assert len(visible_messages(sqs, queues["bulk-dlq"], expect=2)) == 2
    assert len(visible_messages(sqs, queues["default-dlq"], expect=1)) == 1


# --- dlq requeue ---------------------------------------------------------------------------


def test_requeue_puts_a_failed_run_back_through_the_outbox_then_wakes_and_deletes(
    app: sessionmaker[Session],
    engine: sa.Engine,
    ops_settings: OutboxSettings,
    sqs: Any,
    queues: dict[str, str],
    relay: Relay,
    waker: Waker,
    valkey: redis.Redis,
) -> None:
    run_id = dispatch(app, "audit", {"card": SECRET}, tenant_id=3)
    relay.run_once()
    fail_into_dlq(engine, sqs, ops_settings, "default", {run_id})
    before = outbox_row(engine, run_id)
    assert before.sent_at is not None
    valkey.delete(ops_settings.wake_key)  # the dispatch's own wake

    report = requeue.requeue(engine, sqs, ops_settings, dlq.DeadLetterFilter(tasks=("audit",)), waker=waker)

    [item] = report.items
    assert (item.run_id, item.action, item.source, item.outbox, item.dlq_deleted) == (
        run_id,
        "requeued",
        "dlq",
        "reset",
        1,
    )
    assert (report.requeued, report.skipped, report.woke) == (1, 0, True)
    assert valkey.llen(ops_settings.wake_key) == 1
    run = run_row(engine, run_id)
    assert (run.status, run.attempts, run.last_error_type) == ("queued", 1, "ValueError")
    assert (run.finished_at, run.dead_lettered_at, run.lease_owner, run.lease_expires_at) == (None,) * 4
    row = outbox_row(engine, run_id)
    assert (row.kind, row.sent_at, row.attempts) == ("tenant", None, 0)
    assert row.envelope == before.envelope
    steps = trail(engine, run_id)
    assert [t.status for t in steps] == ["running", "failed", "failed", "queued"]
    assert steps[-1].attempt == 1 and steps[-1].worker_id.startswith("operator:")
    assert steps[-1].detail == {
        "requeued_by": "operator",
        "from": "failed",
        "source": "dlq",
        "outbox": "reset",
        "dlq": ops_settings.dlq_url_name("default"),
        "dlq_message_id": item.dlq_message_ids[0],
        "dlq_reason": "permanent-error",
    }
    assert visible_messages(sqs, queues["default-dlq"]) == []

    assert relay.run_once().sent == 1  # the relay sends it again, same run
    [again] = receive_all(sqs, queues["default"], expect=1, timeout=10)
    assert json.loads(again["Body"])["run_id"] == str(run_id)


def test_dry_run_reports_the_same_decisions_and_changes_nothing(
    app: sessionmaker[Session],
    engine: sa.Engine,
    ops_settings: OutboxSettings,
    sqs: Any,
    queues: dict[str, str],
    relay: Relay,
    valkey: redis.Redis,
) -> None:
    first = dispatch(app, "audit", {})
    second = dispatch(app, "audit", {}, tenant_id=2)
    relay.run_once()
    fail_into_dlq(engine, sqs, ops_settings, "default", {first, second})
    execute(engine, "DELETE FROM outbox_messages WHERE run_id = :r", r=second)  # purged
    runs_before = {r: run_row(engine, r) for r in (first, second)}
    trails_before = {r: len(trail(engine, r)) for r in (first, second)}
    valkey.delete(ops_settings.wake_key)

    report = requeue.requeue(
        engine,
        sqs,
        ops_settings,
        dlq.DeadLetterFilter(queues=("default",)),
        dry_run=True,
        trust_dlq_body=True,
    )

    assert report.dry_run and report.requeued == 2 and not report.woke
    assert {(i.run_id, i.action, i.outbox, i.dlq_deleted) for i in report.items} == {
        (first, "would-requeue", "reset", 0),
        (second, "would-requeue", "recreated", 0),
    }
    assert {r: run_row(engine, r) for r in (first, second)} == runs_before
    assert {r: len(trail(engine, r)) for r in (first, second)} == trails_before
    assert outbox_row(engine, first).sent_at is not None and outbox_row(engine, second) is None
    assert valkey.llen(ops_settings.wake_key) == 0
    assert len(visible_messages(sqs, queues["default-dlq"], expect=2)) == 2


def test_only_failed_runs_are_requeued_the_rest_is_skipped_with_a_reason(
    app: sessionmaker[Session],
    engine: sa.Engine,
    ops_settings: OutboxSettings,
    sqs: Any,
    queues: dict[str, str],
    relay: Relay,
    waker: Waker,
) -> None:
    succeeded = dispatch(app, "audit", {})
    queued = dispatch(app, "send_welcome", {})
    forgotten = dispatch(app, "audit", {"n": 3})
    relay.run_once()
    fail_into_dlq(engine, sqs, ops_settings, "default", {succeeded, queued, forgotten})
    execute(engine, "UPDATE task_runs SET status = 'succeeded' WHERE run_id = :r", r=succeeded)
    execute(engine, "UPDATE task_runs SET status = 'queued', finished_at = NULL WHERE run_id = :r", r=queued)
    execute(engine, "DELETE FROM task_runs WHERE run_id = :r", r=forgotten)
    sqs.send_message(QueueUrl=queues["default-dlq"], MessageBody="garbage")

    report = requeue.requeue(engine, sqs, ops_settings, dlq.DeadLetterFilter(), waker=waker)

    items = {i.run_id: i for i in report.items}
    assert (report.requeued, report.skipped, report.woke) == (1, 3, True)
    assert (items[succeeded].reason, items[succeeded].detail) == (
        "not-failed",
        "run is succeeded; only failed and unfinished runs are requeued",
    )
    # an unfinished run whose message is in the DLQ has no live copy: it is sent again
    assert (items[queued].action, items[queued].outbox, items[queued].dlq_deleted) == (
        "requeued",
        "rescued",
        1,
    )
    assert status_and_sent(engine, queued) == ("queued", False)
    assert items[forgotten].reason == "unknown-run"
    assert items[None].reason == "not-a-run"
    assert all(i.action == "skipped" and i.dlq_deleted == 0 for i in report.items if i.run_id != queued)
    assert status_and_sent(engine, succeeded) == ("succeeded", True)
    assert len(visible_messages(sqs, queues["default-dlq"], expect=3)) == 3  # the others left in place


def status_and_sent(engine: sa.Engine, run_id: uuid.UUID) -> tuple[str, bool]:
    return run_row(engine, run_id).status, outbox_row(engine, run_id).sent_at is not None


def test_a_newer_unfinished_run_with_the_same_idempotency_key_blocks_the_requeue(
    app: sessionmaker[Session],
    engine: sa.Engine,
    ops_settings: OutboxSettings,
    sqs: Any,
    queues: dict[str, str],
    relay: Relay,
    waker: Waker,
) -> None:
    old = dispatch(app, "charge_card", {}, tenant_id=4, idempotency_key="order-7")
    relay.run_once()
    fail_into_dlq(engine, sqs, ops_settings, "critical", {old})
    newer = dispatch(app, "charge_card", {}, tenant_id=4, idempotency_key="order-7")
    assert newer != old  # the failed run is finished, so the key was free again

    report = requeue.requeue(
        engine, sqs, ops_settings, dlq.DeadLetterFilter(run_ids=frozenset({old})), waker=waker
    )

    [item] = report.items
    assert (item.action, item.reason) == ("skipped", "idempotency-conflict")
    assert str(newer) in (item.detail or "")
    assert status_and_sent(engine, old) == ("failed", True)
    assert len(visible_messages(sqs, queues["critical-dlq"], expect=1)) == 1


def test_a_purged_outbox_row_is_recreated_from_the_dlq_envelope(
    app: sessionmaker[Session],
    engine: sa.Engine,
    ops_settings: OutboxSettings,
    sqs: Any,
    relay: Relay,
    waker: Waker,
) -> None:
    tenant_run = dispatch(app, "audit", {"n": 1}, tenant_id=6, priority=7)
    platform_run = dispatch(app, "rebuild_cache", {"n": 2}, priority=1)
    relay.run_once()
    fail_into_dlq(engine, sqs, ops_settings, "default", {tenant_run})
    fail_into_dlq(engine, sqs, ops_settings, "maintenance", {platform_run})
    originals = {r: outbox_row(engine, r).envelope for r in (tenant_run, platform_run)}
    execute(engine, "DELETE FROM outbox_messages")
    execute(engine, "DELETE FROM platform_outbox_messages")

    report = requeue.requeue(
        engine,
        sqs,
        ops_settings,
        dlq.DeadLetterFilter(queues=("default", "maintenance")),
        waker=waker,
        trust_dlq_body=True,  # no signing keys here: the unverifiable bodies are trusted on request
    )

    assert {(i.run_id, i.action, i.outbox) for i in report.items} == {
        (tenant_run, "requeued", "recreated"),
        (platform_run, "requeued", "recreated"),
    }
    assert report.rebuilt_unchecked == 2 and {i.body_origin for i in report.items} == {"unchecked"}
    for run_id, kind, queue in ((tenant_run, "tenant", "default"), (platform_run, "platform", "maintenance")):
        row = outbox_row(engine, run_id)
        assert (row.kind, row.queue, row.sent_at, row.attempts) == (kind, queue, None, 0)
        assert row.envelope == originals[run_id]
        assert (trail(engine, run_id)[-1].detail["outbox"], trail(engine, run_id)[-1].detail["body"]) == (
            "recreated",
            "unchecked",
        )
    with engine.connect() as conn:
        tenant = conn.execute(sa.text("SELECT tenant_id FROM outbox_messages")).scalar_one()
        priorities = dict(
            conn.execute(
                sa.text(
                    "SELECT run_id, priority FROM outbox_messages UNION ALL "
                    "SELECT run_id, priority FROM platform_outbox_messages"
                )
            ).all()
        )
    assert tenant == 6
    # an operator's requeue goes out at the manual priority (2), or the run's own if higher
    assert priorities == {tenant_run: 2, platform_run: 1}
    assert relay.run_once().sent == 2


def test_run_id_requeues_from_the_database_when_the_dlq_message_is_gone(
    app: sessionmaker[Session],
    engine: sa.Engine,
    ops_settings: OutboxSettings,
    sqs: Any,
    queues: dict[str, str],
    relay: Relay,
    waker: Waker,
    valkey: redis.Redis,
) -> None:
    kept_row = dispatch(app, "audit", {})
    purged_row = dispatch(app, "audit", {"n": 2})
    other_task = dispatch(app, "send_welcome", {})
    relay.run_once()
    fail_into_dlq(engine, sqs, ops_settings, "default", {kept_row, purged_row, other_task})
    sqs.purge_queue(QueueUrl=queues["default-dlq"])
    execute(engine, "DELETE FROM platform_outbox_messages WHERE run_id = :r", r=purged_row)
    unknown = uuid.uuid4()
    valkey.delete(ops_settings.wake_key)

    report = requeue.requeue(
        engine,
        sqs,
        ops_settings,
        dlq.DeadLetterFilter(
            tasks=("audit",), run_ids=frozenset({kept_row, purged_row, other_task, unknown})
        ),
        waker=waker,
    )

    items = {i.run_id: i for i in report.items}
    assert all(i.source == "database" and not i.dlq_message_ids for i in report.items)
    assert (items[kept_row].action, items[kept_row].outbox) == ("requeued", "reset")
    assert (items[purged_row].action, items[purged_row].reason) == ("skipped", "no-envelope")
    assert (items[other_task].action, items[other_task].reason) == ("skipped", "filtered-out")
    assert (items[unknown].action, items[unknown].reason) == ("skipped", "unknown-run")
    assert report.woke and valkey.llen(ops_settings.wake_key) == 1
    assert status_and_sent(engine, kept_row) == ("queued", False)
    assert trail(engine, kept_row)[-1].detail["source"] == "database"
    assert run_row(engine, purged_row).status == "failed" and outbox_row(engine, purged_row) is None


def test_a_filtered_requeue_reaches_the_runs_whose_messages_another_reader_holds(
    app: sessionmaker[Session],
    engine: sa.Engine,
    ops_settings: OutboxSettings,
    sqs: Any,
    queues: dict[str, str],
    relay: Relay,
    waker: Waker,
) -> None:
    """A colleague's DLQ page received some messages (hidden from every other reader for
    their visibility timeout): a filtered requeue meanwhile requeued only the rest, and
    reported "requeued 52, skipped 0" for 117. It selects the ledger's dead-lettered runs:
    the held ones are requeued from their outbox rows; one whose row was purged is
    counted as unreachable; the ledger lists and counts all of them without receiving."""
    run_ids = [dispatch(app, "audit", {"n": n}) for n in range(6)]
    relay.run_once()
    fail_into_dlq(engine, sqs, ops_settings, "default", set(run_ids))
    matching = dlq.DeadLetterFilter(tasks=("audit",))
    with engine.connect() as conn:
        listed = dlq.dead_lettered_runs(conn, matching)
        [group] = dlq.dead_lettered_groups(conn, matching)
    assert sorted(x.run_id for x in listed) == sorted(run_ids)
    assert (group.queue, group.task, group.reason, group.error_type, group.runs) == (
        "default",
        "audit",
        "permanent-error",
        "ValueError",
        6,
    )
    assert {x.reason for x in listed} == {"permanent-error"}
    assert dlq.dlq_depths(sqs, ops_settings, ["default", "bulk"]) == {"default": 6, "bulk": 0}
    held = sqs.receive_message(
        QueueUrl=queues["default-dlq"],
        MaxNumberOfMessages=3,
        VisibilityTimeout=600,
        MessageAttributeNames=["All"],
    )["Messages"]
    held_runs = {uuid.UUID(m["MessageAttributes"]["run_id"]["StringValue"]) for m in held}
    purged = sorted(held_runs)[0]
    execute(engine, "DELETE FROM platform_outbox_messages WHERE run_id = :r", r=purged)

    report = requeue.requeue(engine, sqs, ops_settings, matching, waker=waker)

    items = {i.run_id: i for i in report.items}
    assert set(items) == set(run_ids)
    assert report.not_received == 3 and report.unreachable == 1
    assert {r for r, i in items.items() if i.source == "database"} == held_runs
    assert (items[purged].action, items[purged].reason) == ("skipped", "no-envelope")
    assert report.requeued == 5
    for run_id in set(run_ids) - {purged}:
        assert status_and_sent(engine, run_id) == ("queued", False)
    assert trail(engine, sorted(held_runs - {purged})[0])[-1].detail["dlq_message"] == "not-received"
    with engine.connect() as conn:
        assert [x.run_id for x in dlq.dead_lettered_runs(conn, matching)] == [purged]


def test_filters_pick_by_task_and_age_and_every_copy_of_a_requeued_run_is_deleted(
    app: sessionmaker[Session],
    engine: sa.Engine,
    ops_settings: OutboxSettings,
    sqs: Any,
    queues: dict[str, str],
    relay: Relay,
    waker: Waker,
) -> None:
    old_audit = dispatch(app, "audit", {})
    new_audit = dispatch(app, "audit", {"n": 2})
    charge = dispatch(app, "charge_card", {}, tenant_id=1)
    relay.run_once()
    an_hour_ago = dt.datetime.now(dt.UTC) - dt.timedelta(hours=1)
    messages = fail_into_dlq(
        engine, sqs, ops_settings, "default", {old_audit, new_audit}, failed_at={old_audit: an_hour_ago}
    )
    fail_into_dlq(engine, sqs, ops_settings, "critical", {charge}, failed_at=an_hour_ago)
    # --older-than reads when the run failed (its row), not the message's failed_at
    execute(
        engine,
        "UPDATE task_runs SET finished_at = :at WHERE run_id = ANY(:ids)",
        at=an_hour_ago,
        ids=[old_audit, charge],
    )
    original = messages[old_audit]
    sqs.send_message(  # a second copy of the same run (e.g. an interrupted DLQ send, retried)
        QueueUrl=queues["default-dlq"],
        MessageBody=original["Body"],
        MessageAttributes={
            **original["MessageAttributes"],
            "reason": {"DataType": "String", "StringValue": "completed-after-interruption"},
            "failed_at": {"DataType": "String", "StringValue": an_hour_ago.isoformat()},
        },
    )

    report = requeue.requeue(
        engine,
        sqs,
        ops_settings,
        dlq.DeadLetterFilter(tasks=("audit",), older_than=dt.timedelta(minutes=30)),
        waker=waker,
    )

    [item] = report.items
    assert (item.run_id, item.action, len(item.dlq_message_ids), item.dlq_deleted) == (
        old_audit,
        "requeued",
        2,
        2,
    )
    assert len(trail(engine, old_audit)) == 4  # one requeue, however many copies
    assert run_row(engine, new_audit).status == "failed" and run_row(engine, charge).status == "failed"
    left = visible_messages(sqs, queues["default-dlq"], expect=1)
    assert [json.loads(m["Body"])["run_id"] for m in left] == [str(new_audit)]
    assert len(visible_messages(sqs, queues["critical-dlq"], expect=1)) == 1


def test_messages_the_worker_refused_unexecuted_are_never_requeued(
    app: sessionmaker[Session],
    engine: sa.Engine,
    ops_settings: OutboxSettings,
    sqs: Any,
    queues: dict[str, str],
    relay: Relay,
    waker: Waker,
) -> None:
    run_id = dispatch(app, "audit", {"amount": 10}, tenant_id=2)
    relay.run_once()
    fail_into_dlq(engine, sqs, ops_settings, "default", {run_id})
    execute(engine, "DELETE FROM outbox_messages WHERE run_id = :r", r=run_id)  # purged
    genuine = json.loads(outbox_envelope_from_dlq(sqs, queues["default-dlq"]))
    forged = {**genuine, "payload": json.dumps({"amount": 10_000})}
    for reason in ("bad-signature", "malformed-envelope:bad-field"):
        sqs.send_message(  # what the worker does with a forged copy naming a real run
            QueueUrl=queues["default-dlq"],
            MessageBody=json.dumps(forged),
            MessageAttributes={
                **envelope.message_attributes(run_id, "audit", 2),
                "reason": {"DataType": "String", "StringValue": reason},
            },
        )

    report = requeue.requeue(
        engine,
        sqs,
        ops_settings,
        dlq.DeadLetterFilter(run_ids=frozenset({run_id})),
        waker=waker,
        trust_dlq_body=True,
    )

    requeued = [i for i in report.items if i.selected]
    foreign = [i for i in report.items if i.reason == "foreign-message"]
    assert len(requeued) == 1 and len(foreign) == 2 and len(report.items) == 3
    assert requeued[0].outbox == "recreated"
    assert json.loads(outbox_row(engine, run_id).envelope["payload"]) == {"amount": 10}  # the genuine one
    left = visible_messages(sqs, queues["default-dlq"], expect=2)
    assert {m["MessageAttributes"]["reason"]["StringValue"] for m in left} == {
        "bad-signature",
        "malformed-envelope:bad-field",
    }


def outbox_envelope_from_dlq(sqs: Any, url: str) -> str:
    """The body of the one message in a DLQ, left visible."""
    [message] = receive_all(sqs, url, expect=1, timeout=5, visibility=0)
    return str(message["Body"])


def test_a_late_dead_letter_record_only_marks_a_run_that_is_still_failed(
    app: sessionmaker[Session], engine: sa.Engine
) -> None:
    """Regression: the DLQ send finishes after the run moved on (requeued by an operator, or
    finished by another copy). Recording the DLQ then must not mark that run dead-lettered."""

    def lease(run_id: uuid.UUID) -> attempts.Attempt:
        with engine.begin() as conn:
            claim = attempts.take_lease(
                conn,
                run_id=run_id,
                task="audit",
                tenant_id=None,
                worker_id="w",
                lease_seconds=60,
                receive_count=1,
            )
        return attempts.Attempt(run_id, claim.attempt, 1, "w")

    def record_dlq(run_id: uuid.UUID) -> None:
        with engine.begin() as conn:
            attempts.mark_dead_lettered(conn, run_id, receive_count=1, worker_id="w", dlq="x-default-dlq")

    def dead_letter_trail(run_id: uuid.UUID) -> list[Any]:
        return [row for row in trail(engine, run_id) if (row.detail or {}).get("dead_lettered")]

    queued = dispatch(app, "audit", {})
    record_dlq(queued)
    assert run_row(engine, queued).status == "queued"
    assert run_row(engine, queued).dead_lettered_at is None and dead_letter_trail(queued) == []

    succeeded = dispatch(app, "audit", {})
    attempt = lease(succeeded)
    with engine.begin() as conn:
        assert attempts.mark_succeeded(conn, attempt)
    record_dlq(succeeded)
    assert run_row(engine, succeeded).dead_lettered_at is None and dead_letter_trail(succeeded) == []

    failed = dispatch(app, "audit", {})
    attempt = lease(failed)
    with engine.begin() as conn:
        failure = attempts.Failure("ValueError", "bad", None)
        assert attempts.mark_failed(conn, attempt, failure, reason="x")
    record_dlq(failed)
    record_dlq(failed)  # a second record of the same DLQ send adds nothing
    assert run_row(engine, failed).dead_lettered_at is not None
    assert len(dead_letter_trail(failed)) == 1


# --- what a DLQ message is trusted for (docs/security.md) -----------------------------------

ATTACKER = {"amount": 1_000_000, "to": "attacker"}
SIGNING_KEY = "dlq-test-signing-key-0123456789"


def forge_dlq_message(
    sqs: Any, url: str, genuine_body: str, *, reason: str | None, signature: str | None = None
) -> dict[str, Any]:
    """What anyone with SendMessage on the DLQ can write: the genuine envelope with the
    attacker's payload, the run's attributes, optionally a verdict and a signature."""
    document = {**json.loads(genuine_body), "payload": json.dumps(ATTACKER)}
    attributes = envelope.message_attributes(document["run_id"], document["task"], document["tenant_id"])
    if reason is not None:
        attributes["reason"] = {"DataType": "String", "StringValue": reason}
    if signature is not None:
        attributes["signature"] = {"DataType": "String", "StringValue": signature}
    sqs.send_message(QueueUrl=url, MessageBody=json.dumps(document), MessageAttributes=attributes)
    return document


def dlq_bodies(sqs: Any, url: str, expect: int) -> list[dict[str, Any]]:
    return [json.loads(m["Body"]) for m in visible_messages(sqs, url, expect=expect)]


def dlq_message_gone(
    app: sessionmaker[Session],
    engine: sa.Engine,
    sqs: Any,
    settings: OutboxSettings,
    relay: Relay,
    queue: str,
    task: str,
    payload: dict[str, Any],
    **options: Any,
) -> tuple[uuid.UUID, dict[str, Any]]:
    """A run that failed into ``queue``'s DLQ, whose DLQ message is then gone (expired,
    deleted by hand); returns the run and its genuine DLQ message as it was."""
    run_id = dispatch(app, task, payload, **options)
    relay.run_once()
    [genuine] = fail_into_dlq(engine, sqs, settings, queue, {run_id}).values()
    sqs.purge_queue(QueueUrl=QueueDirectory(sqs, settings).dlq_url(queue))
    return run_id, genuine


def test_without_signing_a_purged_row_is_never_rebuilt_from_a_dlq_body_by_default(
    app: sessionmaker[Session],
    engine: sa.Engine,
    ops_settings: OutboxSettings,
    sqs: Any,
    queues: dict[str, str],
    relay: Relay,
    waker: Waker,
) -> None:
    """Issue 12 (1): a forged DLQ message naming a failed, purged charge run. Before, a
    routine ``dlq requeue --task`` rebuilt the row from it and the relay signed and sent it."""
    run_id, genuine = dlq_message_gone(
        app,
        engine,
        sqs,
        ops_settings,
        relay,
        "critical",
        "charge_card",
        {"amount": 10, "to": "shop"},
        tenant_id=3,
    )
    execute(engine, "DELETE FROM outbox_messages WHERE run_id = :r", r=run_id)  # purged
    forge_dlq_message(sqs, queues["critical-dlq"], genuine["Body"], reason=None)  # straight into the DLQ
    forge_dlq_message(sqs, queues["critical-dlq"], genuine["Body"], reason="permanent-error")

    report = requeue.requeue(
        engine, sqs, ops_settings, dlq.DeadLetterFilter(tasks=("charge_card",)), waker=waker
    )

    assert report.requeued == 0
    assert sorted((i.reason, i.run_id) for i in report.items) == [
        ("no-reason", run_id),
        ("unverified", run_id),  # the row is purged: nothing vouches for the body
    ]
    assert run_row(engine, run_id).status == "failed" and outbox_row(engine, run_id) is None
    asked = requeue.requeue(  # acting on it on request still never rebuilds from the body
        engine, sqs, ops_settings, dlq.DeadLetterFilter(tasks=("charge_card",)), include_unverified=True
    )
    assert sorted(i.reason for i in asked.items) == ["no-reason", "unverifiable-body"]
    assert outbox_row(engine, run_id) is None
    assert len(visible_messages(sqs, queues["critical-dlq"], expect=2)) == 2  # both left in place


def test_without_signing_trusted_bodies_need_every_copy_to_agree_whatever_the_order(
    app: sessionmaker[Session],
    engine: sa.Engine,
    ops_settings: OutboxSettings,
    sqs: Any,
    queues: dict[str, str],
    relay: Relay,
    waker: Waker,
) -> None:
    """``--trust-dlq-body``: a forged copy beside the genuine one, sent before it or after
    it (SQS does not guarantee an order), blocks the rebuild instead of winning it."""
    forged_first = dispatch(app, "charge_card", {"amount": 10}, tenant_id=3)
    forged_last = dispatch(app, "charge_card", {"amount": 20}, tenant_id=4)
    alone = dispatch(app, "charge_card", {"amount": 30}, tenant_id=5)
    relay.run_once()
    messages = fail_into_dlq(engine, sqs, ops_settings, "critical", {forged_first, forged_last, alone})
    sqs.purge_queue(QueueUrl=queues["critical-dlq"])
    execute(engine, "DELETE FROM outbox_messages")
    url = queues["critical-dlq"]
    for run_id in (forged_first, forged_last, alone):
        genuine = messages[run_id]
        attributes = {**genuine["MessageAttributes"], "reason": {"DataType": "String", "StringValue": "x"}}
        if run_id == forged_first:
            forge_dlq_message(sqs, url, genuine["Body"], reason="permanent-error")
        sqs.send_message(QueueUrl=url, MessageBody=genuine["Body"], MessageAttributes=attributes)
        if run_id == forged_last:
            forge_dlq_message(sqs, url, genuine["Body"], reason="permanent-error")

    report = requeue.requeue(
        engine,
        sqs,
        ops_settings,
        dlq.DeadLetterFilter(queues=("critical",)),
        waker=waker,
        trust_dlq_body=True,
    )

    items = {i.run_id: i for i in report.items}
    assert (items[forged_first].reason, items[forged_last].reason) == ("conflicting-copies",) * 2
    assert (items[alone].action, items[alone].outbox, items[alone].body_origin) == (
        "requeued",
        "recreated",
        "unchecked",
    )
    assert report.rebuilt_unchecked == 1
    assert outbox_row(engine, forged_first) is None and outbox_row(engine, forged_last) is None
    assert json.loads(outbox_row(engine, alone).envelope["payload"]) == {"amount": 30}
    assert len(visible_messages(sqs, url, expect=4)) == 4  # the conflicting copies stay


def test_a_message_without_a_worker_verdict_is_only_requeued_on_request(
    app: sessionmaker[Session],
    engine: sa.Engine,
    ops_settings: OutboxSettings,
    sqs: Any,
    queues: dict[str, str],
    relay: Relay,
    waker: Waker,
) -> None:
    """No ``reason`` attribute: moved by the redrive policy or put straight into the DLQ; the
    two look alike, so neither is requeued unless asked (the outbox row is still the truth)."""
    run_id, genuine = dlq_message_gone(app, engine, sqs, ops_settings, relay, "default", "audit", {"n": 1})
    sqs.send_message(
        QueueUrl=queues["default-dlq"],
        MessageBody=genuine["Body"],
        MessageAttributes=envelope.message_attributes(run_id, "audit", None),
    )

    default = requeue.requeue(engine, sqs, ops_settings, dlq.DeadLetterFilter(tasks=("audit",)))
    assert [(i.action, i.reason) for i in default.items] == [("skipped", "no-reason")]
    assert run_row(engine, run_id).status == "failed"

    asked = requeue.requeue(
        engine, sqs, ops_settings, dlq.DeadLetterFilter(tasks=("audit",)), waker=waker, include_no_reason=True
    )
    assert [(i.action, i.outbox, i.dlq_deleted) for i in asked.items] == [("requeued", "reset", 1)]
    assert run_row(engine, run_id).status == "queued"


def test_with_signing_only_a_signed_dlq_body_is_used_and_forgeries_stay(
    app: sessionmaker[Session],
    engine: sa.Engine,
    ops_settings: OutboxSettings,
    sqs: Any,
    queues: dict[str, str],
    waker: Waker,
) -> None:
    """The worker keeps the relay's signature when it dead-letters; requeue checks it and
    rebuilds a purged row only from a body that carries it. Forged copies (no signature, a
    wrong one, another run's signed body under this run's attributes) are never used."""
    signed = ops_settings.replace(signing_keys=(SIGNING_KEY,))
    relay = Relay(signed, engine=engine)
    try:
        run_id = dispatch(app, "charge_card", {"amount": 10, "to": "shop"}, tenant_id=3)
        other = dispatch(app, "charge_card", {"amount": 99}, tenant_id=3)
        relay.run_once()
    finally:
        relay.sender.close()
    messages = fail_into_dlq(engine, sqs, signed, "critical", {run_id, other})
    genuine = messages[run_id]
    url = queues["critical-dlq"]
    found = receive_all(sqs, url, expect=2, timeout=5, visibility=0)
    assert len(found) == 2 and all(
        envelope.signature_valid(m["Body"], m["MessageAttributes"]["signature"]["StringValue"], [SIGNING_KEY])
        for m in found
    )
    assert all(len(m["MessageAttributes"]) <= 10 for m in found)
    execute(engine, "DELETE FROM outbox_messages")
    forge_dlq_message(sqs, url, genuine["Body"], reason="permanent-error")  # unsigned
    forge_dlq_message(sqs, url, genuine["Body"], reason="permanent-error", signature="0" * 64)
    other_signed = messages[other]
    sqs.send_message(  # a genuine signed body of another run, relabelled as this run
        QueueUrl=url,
        MessageBody=other_signed["Body"],
        MessageAttributes={
            **envelope.message_attributes(run_id, "charge_card", 3),
            "reason": {"DataType": "String", "StringValue": "permanent-error"},
            "signature": other_signed["MessageAttributes"]["signature"],
        },
    )

    report = requeue.requeue(
        engine,
        sqs,
        signed,
        dlq.DeadLetterFilter(run_ids=frozenset({run_id})),
        waker=waker,
        trust_dlq_body=True,
    )

    requeued = [i for i in report.items if i.selected]
    assert [(i.run_id, i.outbox, i.body_origin, i.dlq_deleted) for i in requeued] == [
        (run_id, "recreated", "verified", 1)
    ]
    assert sorted(i.reason for i in report.items if not i.selected) == ["unverified", "unverified"]
    assert json.loads(outbox_row(engine, run_id).envelope["payload"]) == {"amount": 10, "to": "shop"}
    assert trail(engine, run_id)[-1].detail["body"] == "verified"
    # the relabelled body is the other run's (its signed body says so): not this run's copy
    assert run_row(engine, other).status == "failed" and outbox_row(engine, other) is None
    left = dlq_bodies(sqs, url, expect=3)
    assert sum(1 for body in left if json.loads(body["payload"]) == ATTACKER) == 2


def test_with_signing_a_run_whose_only_dlq_copy_is_forged_is_not_rebuilt(
    app: sessionmaker[Session],
    engine: sa.Engine,
    ops_settings: OutboxSettings,
    sqs: Any,
    queues: dict[str, str],
    waker: Waker,
) -> None:
    """Issue 12 (1) with signing on: the genuine DLQ message is gone and a forged one names
    the run. Before, requeue rebuilt the row from it and the relay signed it with the real key."""
    signed = ops_settings.replace(signing_keys=(SIGNING_KEY,))
    relay = Relay(signed, engine=engine)
    try:
        run_id, genuine = dlq_message_gone(
            app,
            engine,
            sqs,
            signed,
            relay,
            "critical",
            "charge_card",
            {"amount": 10, "to": "shop"},
            tenant_id=3,
        )
        execute(engine, "DELETE FROM outbox_messages WHERE run_id = :r", r=run_id)
        forge_dlq_message(sqs, queues["critical-dlq"], genuine["Body"], reason="permanent-error")

        report = requeue.requeue(
            engine,
            sqs,
            signed,
            dlq.DeadLetterFilter(tasks=("charge_card",), run_ids=frozenset({run_id})),
            waker=waker,
        )

        assert [(i.source, i.reason) for i in report.items] == [
            ("dlq", "unverified"),
            ("database", "no-envelope"),
        ]
        assert run_row(engine, run_id).status == "failed" and outbox_row(engine, run_id) is None
        assert relay.run_once().claimed == 0
    finally:
        relay.sender.close()


def test_a_copy_found_in_another_queues_dlq_is_never_acted_on(
    app: sessionmaker[Session],
    engine: sa.Engine,
    ops_settings: OutboxSettings,
    sqs: Any,
    queues: dict[str, str],
    relay: Relay,
    waker: Waker,
) -> None:
    """A run's own DLQ message is in its own queue's DLQ; a copy in another DLQ is not."""
    run_id, genuine = dlq_message_gone(app, engine, sqs, ops_settings, relay, "default", "audit", {"n": 1})
    sqs.send_message(
        QueueUrl=queues["bulk-dlq"],
        MessageBody=genuine["Body"],
        MessageAttributes={
            **genuine["MessageAttributes"],
            "reason": {"DataType": "String", "StringValue": "permanent-error"},
        },
    )

    report = requeue.requeue(engine, sqs, ops_settings, dlq.DeadLetterFilter(tasks=("audit",)), waker=waker)

    [item] = report.items
    assert (item.action, item.reason) == ("skipped", "foreign-message")
    assert "found in the bulk DLQ" in (item.detail or "")
    assert run_row(engine, run_id).status == "failed"


def test_a_requeue_holds_at_most_one_body_per_run_whatever_the_dlq_holds(
    engine: sa.Engine, ops_settings: OutboxSettings, sqs: Any, queues: dict[str, str]
) -> None:
    """A DLQ filled with 20 MB of bodies naming runs (here, none that exist) is read whole
    before any run is decided; the scan keeps receipt handles and digests, not bodies, so
    memory holds about one received batch (before: every body, 23 MiB traced)."""
    import tracemalloc

    body = json.dumps({"v": 1, "pad": "x" * 200_000})
    count = 100
    for _ in range(count):
        sqs.send_message(
            QueueUrl=queues["default-dlq"],
            MessageBody=body,
            MessageAttributes={
                **envelope.message_attributes(uuid.uuid4(), "audit", None),
                "reason": {"DataType": "String", "StringValue": "permanent-error"},
            },
        )
    tracemalloc.start()
    try:
        report = requeue.requeue(
            engine, sqs, ops_settings, dlq.DeadLetterFilter(queues=("default",)), trust_dlq_body=True
        )
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert [i.reason for i in report.items] == ["unknown-run"] * count
    assert peak < 12 * 2**20, f"{peak / 2**20:.1f} MiB traced"


def test_without_signing_filters_match_the_runs_own_row_never_the_dlq_attributes(
    app: sessionmaker[Session],
    engine: sa.Engine,
    ops_settings: OutboxSettings,
    sqs: Any,
    queues: dict[str, str],
    relay: Relay,
    waker: Waker,
) -> None:
    """Unsigned DLQ attributes claiming ``task=audit`` on copies of a failed charge run
    (one the exact envelope, one forged) do not put the charge run among ``--task audit``:
    the listing and the requeue read the run's row, and say where each copy comes from."""
    charge = dispatch(app, "charge_card", {"amount": 10}, tenant_id=3)
    relay.run_once()
    genuine = fail_into_dlq(engine, sqs, ops_settings, "critical", {charge})[charge]
    url = queues["critical-dlq"]
    relabelled = {
        **envelope.message_attributes(charge, "audit", 3),
        "reason": {"DataType": "String", "StringValue": "permanent-error"},
        "failed_at": {"DataType": "String", "StringValue": "2000-01-01T00:00:00+00:00"},
    }
    sqs.send_message(QueueUrl=url, MessageBody=genuine["Body"], MessageAttributes=relabelled)
    forged = {**json.loads(genuine["Body"]), "payload": json.dumps(ATTACKER)}
    sqs.send_message(QueueUrl=url, MessageBody=json.dumps(forged), MessageAttributes=relabelled)

    report = requeue.requeue(engine, sqs, ops_settings, dlq.DeadLetterFilter(tasks=("audit",)), waker=waker)
    assert report.items == [] and run_row(engine, charge).status == "failed"
    aged = requeue.requeue(  # the claimed failed_at (the year 2000) is not the run's
        engine, sqs, ops_settings, dlq.DeadLetterFilter(older_than=dt.timedelta(days=1)), waker=waker
    )
    assert aged.items == [] and run_row(engine, charge).status == "failed"

    with engine.connect() as conn:
        assert (
            dlq.list_dead_letters(
                sqs, ops_settings, dlq.DeadLetterFilter(tasks=("audit",)), connection=conn
            ).letters
            == []
        )
        listing = dlq.list_dead_letters(sqs, ops_settings, dlq.DeadLetterFilter(), connection=conn)
    shown = sorted((x.task, x.origin, x.claims) for x in listing.letters)
    assert shown == [
        ("charge_card", "ledger", ()),  # the worker's own copy
        ("charge_card", "ledger", (("task", "audit"),)),  # the exact envelope, relabelled
        ("charge_card", "unverified", (("task", "audit"),)),  # another payload: nothing vouches
    ]

    # the run's own task selects it; the unverified copy is left unless asked for
    done = requeue.requeue(
        engine, sqs, ops_settings, dlq.DeadLetterFilter(tasks=("charge_card",)), waker=waker
    )
    assert [(i.run_id, i.action, len(i.dlq_message_ids)) for i in done.items if i.selected] == [
        (charge, "requeued", 2)
    ]
    assert [i.reason for i in done.items if not i.selected] == ["unverified"]
    assert json.loads(outbox_row(engine, charge).envelope["payload"]) == {"amount": 10}
    assert dlq_bodies(sqs, url, expect=1) == [forged]


def _into_dlq_while_retrying(
    engine: sa.Engine, sqs: Any, settings: OutboxSettings, run_id: uuid.UUID, *, backoff: float = 1.0
) -> None:
    """The run's attempt fails transiently (``retrying``), then its message reaches the DLQ
    (as SQS's redrive moves a message received ``maxReceiveCount`` times)."""
    directory = QueueDirectory(sqs, settings)
    outcomes = Outcomes(sqs, directory, max_message_bytes=settings.max_message_bytes)
    [message] = receive_all(sqs, directory.url("default"), expect=1, timeout=10)
    env = envelope.decode(message["Body"], max_bytes=settings.max_message_bytes)
    with engine.begin() as conn:
        claim = attempts.take_lease(
            conn,
            run_id=run_id,
            task=env.task,
            tenant_id=env.tenant_id,
            worker_id="w",
            lease_seconds=60,
            receive_count=1,
        )
        attempt = attempts.Attempt(run_id, claim.attempt, 1, "w")
        failure = attempts.Failure("ConnectionError", "flaky")
        assert attempts.mark_retrying(conn, attempt, failure, backoff_seconds=backoff)
    outcomes.dead_letter(
        "default", message["ReceiptHandle"], message["Body"], message["MessageAttributes"], {}
    )


def test_requeue_reconciles_an_unfinished_run_whose_message_reached_the_dlq(
    app: sessionmaker[Session],
    engine: sa.Engine,
    ops_settings: OutboxSettings,
    sqs: Any,
    queues: dict[str, str],
    relay: Relay,
) -> None:
    """The run is ``retrying`` but its only copy is in the DLQ (SQS redrove it: no worker
    verdict, so ``--include-no-reason``): requeue used to skip it (not failed) and it waited
    forever. It is sent again through the outbox and the copy deleted."""
    run_id = dispatch(app, "audit", {"n": 1}, tenant_id=2)
    relay.run_once()
    _into_dlq_while_retrying(engine, sqs, ops_settings, run_id)

    report = requeue.requeue(
        engine, sqs, ops_settings, dlq.DeadLetterFilter(tasks=("audit",)), include_no_reason=True
    )

    [item] = report.items
    assert (item.action, item.outbox, item.dlq_deleted) == ("requeued", "rescued", 1)
    assert run_row(engine, run_id).status == "retrying"
    assert outbox_row(engine, run_id).sent_at is None
    [step] = [t for t in trail(engine, run_id) if t.detail and "rescued" in t.detail]
    assert step.detail == {"rescued": "in-dlq", "from": "retrying"}
    assert visible_messages(sqs, queues["default-dlq"]) == []
    assert relay.run_once().sent == 1


def test_resend_sends_again_any_unfinished_run_an_operator_names(
    app: sessionmaker[Session], engine: sa.Engine, ops_settings: OutboxSettings, sqs: Any, relay: Relay
) -> None:
    retrying = dispatch(app, "audit", {"n": 1}, tenant_id=2)
    relay.run_once()
    _into_dlq_while_retrying(engine, sqs, ops_settings, retrying)
    leased = dispatch(app, "audit", {"n": 2}, tenant_id=2)
    relay.run_once()
    with engine.begin() as conn:
        attempts.take_lease(
            conn, run_id=leased, task="audit", tenant_id=2, worker_id="w", lease_seconds=600, receive_count=1
        )
    selection = resend.Selection(run_ids=(retrying, leased, uuid.uuid4()))

    report = resend.resend_unreceived(engine, selection)

    by_run = {item.run_id: item for item in report.items}
    assert (by_run[retrying].action, by_run[leased].reason) == ("resent", "leased")
    assert by_run[selection.run_ids[2]].reason == "unknown-run"
    assert outbox_row(engine, retrying).sent_at is None and outbox_row(engine, leased).sent_at is not None
