"""maintenance.purge against a real PostgreSQL: every retention boundary, batches, SKIP LOCKED."""

from __future__ import annotations

import datetime as dt
import json
import threading
import time
import uuid
from typing import Any

import pytest
import sqlalchemy as sa

from sqla_outbox import maintenance
from sqla_outbox.config import OutboxSettings
from sqla_outbox.worker.registry import registry

MINUTE = dt.timedelta(minutes=1)
DAY = dt.timedelta(days=1)


def ago(param: str) -> str:
    """SQL for "``:param`` (an interval, possibly NULL) before now"."""
    return f"clock_timestamp() - CAST(:{param} AS interval)"


def insert_outbox(
    conn: sa.Connection,
    *,
    table: str = "outbox_messages",
    sent_ago: dt.timedelta | None,
    created_ago: dt.timedelta | None = None,
    attempts: int = 0,
    run_id: uuid.UUID | None = None,
) -> uuid.UUID:
    """An outbox row sent ``sent_ago`` ago (None: pending), created a minute before that."""
    run_id = run_id or uuid.uuid4()
    created_ago = created_ago or (sent_ago or dt.timedelta()) + MINUTE
    envelope = json.dumps(
        {"v": 1, "run_id": str(run_id), "task": "audit", "queue": "default", "payload": "{}"}
    )
    tenant = "tenant_id, " if table == "outbox_messages" else ""
    tenant_value = "3, " if table == "outbox_messages" else ""
    columns = f"{tenant}run_id, queue, envelope, available_at, sent_at, attempts, created_at"
    values = (
        f"{tenant_value}:run_id, 'default', CAST(:envelope AS jsonb), {ago('created_ago')}, "
        f"{ago('sent_ago')}, :attempts, {ago('created_ago')}"
    )
    conn.execute(
        sa.text(f"INSERT INTO {table} ({columns}) VALUES ({values})"),
        {
            "run_id": run_id,
            "envelope": envelope,
            "created_ago": created_ago,
            "sent_ago": sent_ago,
            "attempts": attempts,
        },
    )
    return run_id


def insert_run(
    conn: sa.Connection,
    *,
    status: str,
    finished_ago: dt.timedelta | None = None,
    created_ago: dt.timedelta = 120 * DAY,
    tenant_id: int | None = None,
    trail_rows: int = 2,
) -> uuid.UUID:
    """A task_runs row with ``trail_rows`` trail rows."""
    run_id = uuid.uuid4()
    conn.execute(
        sa.text(
            "INSERT INTO task_runs (run_id, task, queue, tenant_id, status, attempts, available_at, "
            "created_at, updated_at, finished_at) VALUES (:run_id, 'audit', 'default', :tenant_id, "
            f":status, 1, {ago('created_ago')}, {ago('created_ago')}, {ago('created_ago')}, "
            f"{ago('finished_ago')})"
        ),
        {
            "run_id": run_id,
            "tenant_id": tenant_id,
            "status": status,
            "created_ago": created_ago,
            "finished_ago": finished_ago,
        },
    )
    for step in range(trail_rows):
        conn.execute(
            sa.text(
                "INSERT INTO task_run_trail (run_id, status, attempt) VALUES (:run_id, :status, :attempt)"
            ),
            {"run_id": run_id, "status": "running" if step == 0 else status, "attempt": 1},
        )
    return run_id


def outbox_ids(engine: sa.Engine, table: str) -> set[uuid.UUID]:
    with engine.connect() as conn:
        return set(conn.execute(sa.text(f"SELECT run_id FROM {table}")).scalars())


def run_ids(engine: sa.Engine) -> set[uuid.UUID]:
    with engine.connect() as conn:
        return set(conn.execute(sa.text("SELECT run_id FROM task_runs")).scalars())


def trail_run_ids(engine: sa.Engine) -> set[uuid.UUID]:
    with engine.connect() as conn:
        return set(conn.execute(sa.text("SELECT DISTINCT run_id FROM task_run_trail")).scalars())


@pytest.mark.parametrize("table", ["outbox_messages", "platform_outbox_messages"])
def test_sent_rows_go_after_7_days_and_pending_rows_never(
    engine: sa.Engine, settings: OutboxSettings, table: str
) -> None:
    with engine.begin() as conn:
        old = insert_outbox(conn, table=table, sent_ago=7 * DAY + MINUTE)
        much_older = insert_outbox(conn, table=table, sent_ago=300 * DAY)
        recent = insert_outbox(conn, table=table, sent_ago=7 * DAY - MINUTE)
        just_sent = insert_outbox(conn, table=table, sent_ago=dt.timedelta(seconds=1))
        pending_ancient = insert_outbox(conn, table=table, sent_ago=None, created_ago=400 * DAY, attempts=9)
        pending_new = insert_outbox(conn, table=table, sent_ago=None)

    report = maintenance.purge(engine, settings)

    assert outbox_ids(engine, table) == {recent, just_sent, pending_ancient, pending_new}
    assert old not in outbox_ids(engine, table) and much_older not in outbox_ids(engine, table)
    counts = report.by_category()
    assert counts[table].deleted == 2
    other = "platform_outbox_messages" if table == "outbox_messages" else "outbox_messages"
    assert counts[other].deleted == 0
    assert report.deleted == 2 and not report.dry_run and not report.stopped
    assert counts[table].cutoff == pytest.approx(report.started_at - 7 * DAY, abs=dt.timedelta(seconds=1))


def test_succeeded_and_failed_runs_have_separate_retentions_and_unfinished_runs_stay(
    engine: sa.Engine, settings: OutboxSettings
) -> None:
    with engine.begin() as conn:
        succeeded_old = insert_run(conn, status="succeeded", finished_ago=7 * DAY + MINUTE)
        succeeded_recent = insert_run(conn, status="succeeded", finished_ago=7 * DAY - MINUTE)
        failed_8_days = insert_run(conn, status="failed", finished_ago=8 * DAY, tenant_id=4)
        failed_recent = insert_run(conn, status="failed", finished_ago=30 * DAY - MINUTE)
        failed_old = insert_run(conn, status="failed", finished_ago=30 * DAY + MINUTE, tenant_id=4)
        unfinished = {
            insert_run(conn, status=status, finished_ago=None, created_ago=400 * DAY)
            for status in ("queued", "running", "retrying")
        }
        # a requeued run's finished_at is cleared; even a stale one must not make it go
        queued_with_old_finish = insert_run(conn, status="queued", finished_ago=90 * DAY)

    report = maintenance.purge(engine, settings)

    kept = {succeeded_recent, failed_8_days, failed_recent, queued_with_old_finish, *unfinished}
    assert run_ids(engine) == kept
    assert trail_run_ids(engine) == kept  # the trail went with its runs (ON DELETE CASCADE)
    counts = report.by_category()
    assert (counts["succeeded_runs"].deleted, counts["succeeded_runs"].trail_rows) == (1, 2)
    assert (counts["failed_runs"].deleted, counts["failed_runs"].trail_rows) == (1, 2)
    assert succeeded_old not in kept and failed_old not in kept


def test_retentions_come_from_the_settings(engine: sa.Engine, settings: OutboxSettings) -> None:
    with engine.begin() as conn:
        sent_2h = insert_outbox(conn, sent_ago=2 * dt.timedelta(hours=1))
        sent_30m = insert_outbox(conn, sent_ago=30 * MINUTE)
        succeeded_2h = insert_run(conn, status="succeeded", finished_ago=dt.timedelta(hours=2))
        failed_2h = insert_run(conn, status="failed", finished_ago=dt.timedelta(hours=2))
        failed_5h = insert_run(conn, status="failed", finished_ago=dt.timedelta(hours=5))
    hour = 1 / 24
    custom = settings.replace(
        purge_sent_after_days=hour, purge_succeeded_after_days=hour, purge_failed_after_days=3 * hour
    )

    maintenance.purge(engine, custom)

    assert outbox_ids(engine, "outbox_messages") == {sent_30m}
    assert run_ids(engine) == {failed_2h}
    assert sent_2h and succeeded_2h and failed_5h


def test_a_finished_run_whose_outbox_row_is_pending_again_is_kept(
    engine: sa.Engine, settings: OutboxSettings
) -> None:
    with engine.begin() as conn:
        run_id = insert_run(conn, status="failed", finished_ago=40 * DAY, tenant_id=2)
        insert_outbox(conn, sent_ago=None, run_id=run_id)
        platform_run = insert_run(conn, status="succeeded", finished_ago=40 * DAY)
        insert_outbox(conn, table="platform_outbox_messages", sent_ago=None, run_id=platform_run)
        gone = insert_run(conn, status="succeeded", finished_ago=40 * DAY)
        insert_outbox(conn, sent_ago=40 * DAY, run_id=gone)

    maintenance.purge(engine, settings)

    assert run_ids(engine) == {run_id, platform_run}
    assert outbox_ids(engine, "outbox_messages") == {run_id}


@pytest.mark.parametrize("table", ["outbox_messages", "platform_outbox_messages"])
def test_sent_rows_of_unfinished_runs_are_kept_by_every_purge_path(
    engine: sa.Engine, settings: OutboxSettings, table: str
) -> None:
    """`purge --sent-after-days 0` deleted the rows of runs still queued or retrying in SQS:
    the worker's envelope check, and any re-send, need them (issue 11, item 6)."""
    tenant = 3 if table == "outbox_messages" else None
    with engine.begin() as conn:
        live = {}
        for status in ("queued", "running", "retrying"):
            live[status] = insert_run(conn, status=status, tenant_id=tenant)
            insert_outbox(conn, table=table, sent_ago=10 * DAY, run_id=live[status])
        done = insert_run(conn, status="succeeded", finished_ago=MINUTE, tenant_id=tenant)
        insert_outbox(conn, table=table, sent_ago=10 * DAY, run_id=done)
        orphan = insert_outbox(conn, table=table, sent_ago=10 * DAY)  # its run was purged long ago
    aggressive = settings.replace(purge_sent_after_days=0)

    dry = maintenance.purge(engine, aggressive, dry_run=True).by_category()
    assert dry[table].deleted == 2
    report = maintenance.purge(engine, aggressive).by_category()

    assert report[table].deleted == 2
    assert outbox_ids(engine, table) == set(live.values())
    assert done not in outbox_ids(engine, table) and orphan not in outbox_ids(engine, table)


def test_a_purged_failed_run_takes_its_parked_row_with_it(
    engine: sa.Engine, settings: OutboxSettings
) -> None:
    with engine.begin() as conn:
        parked_run = insert_run(conn, status="failed", finished_ago=40 * DAY, tenant_id=2)
        insert_outbox(conn, sent_ago=None, run_id=parked_run)
        recent = insert_run(conn, status="failed", finished_ago=DAY, tenant_id=2)
        insert_outbox(conn, sent_ago=None, run_id=recent)
        conn.execute(sa.text("UPDATE outbox_messages SET parked_at = clock_timestamp(), last_error = 'X: y'"))

    counts = maintenance.purge(engine, settings).by_category()

    assert counts["failed_runs"].deleted == 1
    assert run_ids(engine) == {recent}
    assert outbox_ids(engine, "outbox_messages") == {recent}


def test_batches_smaller_than_the_set_loop_until_a_short_batch(
    engine: sa.Engine, settings: OutboxSettings
) -> None:
    with engine.begin() as conn:
        for _ in range(8):
            insert_outbox(conn, sent_ago=10 * DAY)
        for _ in range(6):
            insert_outbox(conn, table="platform_outbox_messages", sent_ago=10 * DAY)
        for _ in range(7):
            insert_run(conn, status="succeeded", finished_ago=10 * DAY, trail_rows=3)
        keep = insert_outbox(conn, sent_ago=DAY)

    report = maintenance.purge(engine, settings.replace(purge_batch_size=3))

    counts = report.by_category()
    assert (counts["outbox_messages"].deleted, counts["outbox_messages"].batches) == (8, 3)  # 3+3+2
    assert (counts["platform_outbox_messages"].deleted, counts["platform_outbox_messages"].batches) == (6, 3)
    assert (counts["succeeded_runs"].deleted, counts["succeeded_runs"].batches) == (7, 3)  # 3+3+1
    assert counts["succeeded_runs"].trail_rows == 21
    assert (counts["failed_runs"].deleted, counts["failed_runs"].batches) == (0, 1)
    assert outbox_ids(engine, "outbox_messages") == {keep}
    assert outbox_ids(engine, "platform_outbox_messages") == set() and run_ids(engine) == set()


def test_rows_locked_by_another_transaction_are_skipped_not_waited_on(
    engine: sa.Engine, settings: OutboxSettings
) -> None:
    with engine.begin() as conn:
        locked_row = insert_outbox(conn, sent_ago=10 * DAY)
        free_row = insert_outbox(conn, sent_ago=10 * DAY)
        locked_run = insert_run(conn, status="failed", finished_ago=60 * DAY)
        free_run = insert_run(conn, status="failed", finished_ago=60 * DAY)

    holder = engine.connect()
    transaction = holder.begin()
    holder.execute(sa.text("SELECT 1 FROM outbox_messages WHERE run_id = :r FOR UPDATE"), {"r": locked_row})
    holder.execute(sa.text("SELECT 1 FROM task_runs WHERE run_id = :r FOR UPDATE"), {"r": locked_run})
    result: dict[str, Any] = {}

    def run() -> None:
        started = time.monotonic()
        try:
            result["report"] = maintenance.purge(engine, settings)
        except Exception as exc:  # surfaced below
            result["error"] = exc
        result["seconds"] = time.monotonic() - started

    thread = threading.Thread(target=run)
    try:
        thread.start()
        thread.join(timeout=15)
        assert not thread.is_alive(), "the purge waited on the locked rows"
    finally:
        transaction.rollback()
        holder.close()
        thread.join()
    assert "error" not in result, result.get("error")
    assert result["seconds"] < 3  # lock_timeout is 5 s: it never waited
    assert outbox_ids(engine, "outbox_messages") == {locked_row}
    assert run_ids(engine) == {locked_run}
    assert free_row and free_run

    again = maintenance.purge(engine, settings)  # the next run gets them
    assert again.deleted == 2
    assert outbox_ids(engine, "outbox_messages") == set() and run_ids(engine) == set()


def test_dry_run_counts_with_the_same_cutoffs_and_deletes_nothing(
    engine: sa.Engine, settings: OutboxSettings
) -> None:
    with engine.begin() as conn:
        insert_outbox(conn, sent_ago=8 * DAY)
        insert_outbox(conn, table="platform_outbox_messages", sent_ago=8 * DAY)
        insert_outbox(conn, sent_ago=None, created_ago=80 * DAY)
        insert_run(conn, status="succeeded", finished_ago=8 * DAY, trail_rows=3)
        insert_run(conn, status="failed", finished_ago=31 * DAY, trail_rows=4)
        insert_run(conn, status="failed", finished_ago=8 * DAY)
        insert_run(conn, status="cancelled", finished_ago=8 * DAY, trail_rows=1)  # succeeded's age
        insert_run(conn, status="cancelled", finished_ago=6 * DAY)
    before = (outbox_ids(engine, "outbox_messages"), run_ids(engine), trail_run_ids(engine))

    dry = maintenance.purge(engine, settings, dry_run=True)

    assert (outbox_ids(engine, "outbox_messages"), run_ids(engine), trail_run_ids(engine)) == before
    counts = {c.category: (c.deleted, c.trail_rows, c.batches) for c in dry.counts}
    assert counts == {
        "outbox_messages": (1, 0, 0),
        "platform_outbox_messages": (1, 0, 0),
        "succeeded_runs": (1, 3, 0),
        "failed_runs": (1, 4, 0),
        "cancelled_runs": (1, 1, 0),
        "completed_groups": (0, 0, 0),
    }
    real = maintenance.purge(engine, settings)
    assert {c.category: (c.deleted, c.trail_rows) for c in real.counts} == {
        k: v[:2] for k, v in counts.items()
    }


def test_should_stop_ends_the_purge_between_batches(engine: sa.Engine, settings: OutboxSettings) -> None:
    with engine.begin() as conn:
        for _ in range(5):
            insert_outbox(conn, sent_ago=9 * DAY)
    calls = []

    def stop_after_two() -> bool:
        calls.append(1)
        return len(calls) > 2

    report = maintenance.purge(engine, settings.replace(purge_batch_size=2), should_stop=stop_after_two)

    assert report.stopped
    assert report.by_category()["outbox_messages"].deleted == 4
    assert len(outbox_ids(engine, "outbox_messages")) == 1


def test_the_task_is_registered_on_the_maintenance_queue_with_a_daily_schedule() -> None:
    definition = registry.get("maintenance.purge")
    assert (definition.queue, definition.scope) == ("maintenance", "platform")
    assert definition.schedule == {"cron": "17 3 * * *"}
    assert definition.handler is maintenance.purge_task
    spec = registry.catalog().task("maintenance.purge")
    assert spec.schedule == {"cron": "17 3 * * *"} and spec.queue == "maintenance"
