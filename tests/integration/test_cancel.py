"""Cancel and Reschedule in the application's transaction, against real PostgreSQL."""

from __future__ import annotations

import asyncio
import datetime as dt
import uuid
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.orm import Session, sessionmaker

import sqla_outbox
from sqla_outbox import Cancel, ControlOutcome, Dispatch, Reschedule, errors
from sqla_outbox.catalog import Catalog
from sqla_outbox.config import OutboxSettings
from tests.support import outbox_rows, run_row, trail


def dispatch(factory: sessionmaker[Session], task: str = "send_welcome", **options: object) -> uuid.UUID:
    with factory() as session, session.begin():
        item = Dispatch(task, {"n": 1}, **options)  # type: ignore[arg-type]
        session.add(item)
    return item.run_id


def set_status(engine: sa.Engine, run_id: uuid.UUID, status: str, *, sent: bool = False) -> None:
    with engine.begin() as connection:
        connection.execute(
            sa.text(
                "UPDATE task_runs SET status = :status, "
                "attempts = CASE WHEN :status = 'queued' THEN 0 ELSE 1 END, "
                "finished_at = CASE WHEN :status IN ('succeeded', 'failed') THEN clock_timestamp() END "
                "WHERE run_id = :run_id"
            ),
            {"status": status, "run_id": run_id},
        )
        if sent:
            for table in ("outbox_messages", "platform_outbox_messages"):
                connection.execute(
                    sa.text(f"UPDATE {table} SET sent_at = clock_timestamp() WHERE run_id = :run_id"),
                    {"run_id": run_id},
                )


def test_rolled_back_cancel_cancels_nothing(factory: sessionmaker[Session], engine: sa.Engine) -> None:
    run_id = dispatch(factory)
    with factory() as session:
        session.begin()
        cancel = Cancel(run_id)
        session.add(cancel)
        session.flush()
        assert cancel.outcome is ControlOutcome.CANCELLED  # inside the transaction
        session.rollback()
    assert run_row(engine, run_id).status == "queued"
    assert [r.run_id for r in outbox_rows(engine)] == [run_id]
    assert [t.status for t in trail(engine, run_id)] == []


def test_cancel_before_send_removes_the_outbox_row_in_the_same_commit(
    factory: sessionmaker[Session], engine: sa.Engine
) -> None:
    run_id = dispatch(factory, delay=60)
    other = dispatch(factory)
    with factory() as session, session.begin():
        cancel = Cancel(run_id, by="booking-service", reason="appointment 7 cancelled")
        session.add(cancel)
    assert cancel.outcome is ControlOutcome.CANCELLED
    [result] = cancel.results
    assert (result.run_id, result.previous_status, result.was_sent) == (run_id, "queued", False)
    run = run_row(engine, run_id)
    assert run.status == "cancelled" and run.finished_at is not None
    assert [r.run_id for r in outbox_rows(engine)] == [other]
    [entry] = trail(engine, run_id)
    assert entry.status == "cancelled"
    assert entry.detail == {
        "cancelled_by": "booking-service",
        "reason": "appointment 7 cancelled",
        "from": "queued",
        "cancel": "done",
        "unsent": True,
    }


def test_cancel_of_a_sent_run_keeps_the_row_and_reports_it_sent(
    factory: sessionmaker[Session], engine: sa.Engine
) -> None:
    run_id = dispatch(factory)
    set_status(engine, run_id, "queued", sent=True)
    with factory() as session, session.begin():
        cancel = Cancel(run_id)
        session.add(cancel)
    assert cancel.outcome is ControlOutcome.CANCELLED
    assert cancel.results[0].was_sent is True
    assert run_row(engine, run_id).status == "cancelled"
    assert len(outbox_rows(engine)) == 1


def test_cancel_of_a_running_run_records_a_request(factory: sessionmaker[Session], engine: sa.Engine) -> None:
    run_id = dispatch(factory)
    set_status(engine, run_id, "running", sent=True)
    with factory() as session, session.begin():
        cancel = Cancel(run_id)
        session.add(cancel)
    assert cancel.outcome is ControlOutcome.STOP_REQUESTED
    run = run_row(engine, run_id)
    assert run.status == "running" and run.cancel_requested_at is not None
    [entry] = trail(engine, run_id)
    assert (entry.status, entry.detail["cancel"]) == ("running", "requested")


@pytest.mark.parametrize("status", ["succeeded", "failed"])
def test_finished_run_is_left_alone_and_the_call_says_so(
    factory: sessionmaker[Session], engine: sa.Engine, status: str
) -> None:
    run_id = dispatch(factory)
    set_status(engine, run_id, status, sent=True)
    with factory() as session, session.begin():
        cancel = Cancel(run_id)
        session.add(cancel)
    assert cancel.outcome is ControlOutcome.FINISHED
    assert cancel.results[0].previous_status == status
    assert run_row(engine, run_id).status == status
    assert trail(engine, run_id) == []


def test_unknown_run_is_reported_not_found(factory: sessionmaker[Session]) -> None:
    missing = uuid.uuid4()
    with factory() as session, session.begin():
        cancel = Cancel(missing)
        session.add(cancel)
    assert cancel.outcome is ControlOutcome.NOT_FOUND
    assert cancel.results[0].run_id == missing


def test_cancel_by_idempotency_key_and_tenant(factory: sessionmaker[Session], engine: sa.Engine) -> None:
    mine = dispatch(factory, "charge_card", tenant_id=3, idempotency_key="appt-7")
    other_tenant = dispatch(factory, "charge_card", tenant_id=4, idempotency_key="appt-7")
    with factory() as session, session.begin():
        cancel = Cancel(task="charge_card", tenant_id=3, idempotency_key="appt-7")
        session.add(cancel)
    assert cancel.outcome is ControlOutcome.CANCELLED
    assert cancel.results[0].run_id == mine
    assert run_row(engine, mine).status == "cancelled"
    assert run_row(engine, other_tenant).status == "queued"
    # the key is free again: a new dispatch with it makes a new run
    again = dispatch(factory, "charge_card", tenant_id=3, idempotency_key="appt-7")
    assert again != mine and run_row(engine, again).status == "queued"


def test_cancel_by_task_and_tenant_filters(factory: sessionmaker[Session], engine: sa.Engine) -> None:
    a = dispatch(factory, "charge_card", tenant_id=3)
    b = dispatch(factory, "charge_card", tenant_id=3)
    c = dispatch(factory, "charge_card", tenant_id=4)
    d = dispatch(factory, "audit")
    done = dispatch(factory, "charge_card", tenant_id=3)
    set_status(engine, done, "succeeded", sent=True)
    with factory() as session, session.begin():
        cancel = Cancel(task="charge_card", tenant_id=3)
        session.add(cancel)
    assert {r.run_id for r in cancel.results} == {a, b}
    assert cancel.outcome is None  # a filter: read .results
    assert [run_row(engine, r).status for r in (a, b, c, d, done)] == [
        "cancelled",
        "cancelled",
        "queued",
        "queued",
        "succeeded",
    ]


def test_status_filter_narrows_a_filter_cancel(factory: sessionmaker[Session], engine: sa.Engine) -> None:
    queued = dispatch(factory, "audit")
    running = dispatch(factory, "audit")
    set_status(engine, running, "running", sent=True)
    with factory() as session, session.begin():
        session.add(Cancel(task="audit", statuses=["running"]))
    assert run_row(engine, queued).status == "queued"
    assert run_row(engine, running).cancel_requested_at is not None


def test_dispatch_and_cancel_in_one_flush(factory: sessionmaker[Session], engine: sa.Engine) -> None:
    with factory() as session, session.begin():
        item = Dispatch("audit", {})
        session.add(item)
        cancel = Cancel(item.run_id)
        session.add(cancel)
    assert cancel.outcome is ControlOutcome.CANCELLED
    assert run_row(engine, item.run_id).status == "cancelled"
    assert outbox_rows(engine) == []


def test_bad_controls_fail_at_construction_or_add(factory: sessionmaker[Session]) -> None:
    with pytest.raises(errors.InvalidControl, match="name the runs"):
        Cancel()
    with pytest.raises(errors.InvalidControl, match="needs task"):
        Cancel(idempotency_key="k")
    with pytest.raises(errors.InvalidControl, match="run_id alone"):
        Cancel(uuid.uuid4(), task="audit")
    with pytest.raises(errors.InvalidControl, match="statuses"):
        Cancel(task="audit", statuses=["succeeded"])
    with pytest.raises(errors.InvalidControl, match="one of them"):
        Reschedule(uuid.uuid4())
    with pytest.raises(errors.InvalidControl, match="timezone-aware"):
        Reschedule(uuid.uuid4(), available_at=dt.datetime(2030, 1, 1))
    with pytest.raises(errors.InvalidControl, match="got -5 s"):  # not "-1 day, 23:59:55"
        Reschedule(uuid.uuid4(), delay=-5)
    with pytest.raises(errors.InvalidControl, match="reason must be text, got int"):
        Cancel(uuid.uuid4(), reason=5)  # type: ignore[arg-type]
    with factory() as session, pytest.raises(errors.UnknownTask):
        session.add(Cancel(task="no_such_task"))


def test_cancel_without_listeners_is_refused(engine: sa.Engine) -> None:
    with Session(engine) as session, pytest.raises(errors.NotInstalled):
        session.add(Cancel(uuid.uuid4()))
        session.flush()


def test_reschedule_moves_an_unsent_run_earlier_and_later(
    factory: sessionmaker[Session], engine: sa.Engine
) -> None:
    run_id = dispatch(factory, delay=3600)
    target = dt.datetime.now(dt.UTC) + dt.timedelta(days=2)
    with factory() as session, session.begin():
        later = Reschedule(run_id, available_at=target)
        session.add(later)
    assert later.outcome is ControlOutcome.RESCHEDULED
    [row] = outbox_rows(engine)
    assert row.available_at == target == run_row(engine, run_id).available_at
    with factory() as session, session.begin():
        earlier = Reschedule(run_id, delay=0)
        session.add(earlier)
    assert earlier.outcome is ControlOutcome.RESCHEDULED
    [row] = outbox_rows(engine)
    assert row.available_at < dt.datetime.now(dt.UTC) + dt.timedelta(seconds=5)
    assert run_row(engine, run_id).available_at == row.available_at
    assert [t.detail["rescheduled_by"] for t in trail(engine, run_id)] == ["application", "application"]


def test_reschedule_leaves_sent_and_finished_runs_alone(
    factory: sessionmaker[Session], engine: sa.Engine
) -> None:
    sent = dispatch(factory)
    set_status(engine, sent, "queued", sent=True)
    done = dispatch(factory)
    set_status(engine, done, "succeeded", sent=True)
    later = dt.datetime.now(dt.UTC) + dt.timedelta(hours=1)
    with factory() as session, session.begin():
        a = Reschedule(sent, available_at=later)
        b = Reschedule(done, available_at=later)
        session.add_all([a, b])
    assert (a.outcome, b.outcome) == (ControlOutcome.ALREADY_SENT, ControlOutcome.FINISHED)
    assert run_row(engine, sent).available_at < later


def test_rolled_back_reschedule_moves_nothing(factory: sessionmaker[Session], engine: sa.Engine) -> None:
    run_id = dispatch(factory, delay=3600)
    before = outbox_rows(engine)[0].available_at
    with factory() as session:
        session.begin()
        session.add(Reschedule(run_id, delay=0))
        session.flush()
        session.rollback()
    assert outbox_rows(engine)[0].available_at == before


def test_async_session_cancel(
    settings: OutboxSettings, catalog: Catalog, factory: sessionmaker[Session], engine: sa.Engine
) -> None:
    from sqlalchemy.ext.asyncio import async_sessionmaker, create_async_engine

    from sqla_outbox.config import sqlalchemy_url

    run_id = dispatch(factory)

    async def main() -> ControlOutcome | None:
        async_engine = create_async_engine(sqlalchemy_url(settings.database_url))
        maker = async_sessionmaker(async_engine)
        sqla_outbox.install(maker, settings, catalog=catalog)
        try:
            async with maker() as session, session.begin():
                cancel = Cancel(run_id)
                session.add(cancel)
                await session.flush()
                return cancel.outcome
        finally:
            sqla_outbox.uninstall(maker)
            await async_engine.dispose()

    assert asyncio.run(main()) is ControlOutcome.CANCELLED
    assert run_row(engine, run_id).status == "cancelled"
    assert outbox_rows(engine) == []


def test_a_cancel_pending_when_the_worker_died_ends_the_run_at_the_next_delivery(
    factory: sessionmaker[Session], engine: sa.Engine
) -> None:
    from sqla_outbox.lifecycle import attempts

    run_id = dispatch(factory)
    set_status(engine, run_id, "running", sent=True)
    with factory() as session, session.begin():
        session.add(Cancel(run_id))
    live = None
    with engine.begin() as connection:  # the lease is still held: the copy waits
        connection.execute(
            sa.text("UPDATE task_runs SET lease_expires_at = clock_timestamp() + interval '1 minute'")
        )
        live = attempts.take_lease(
            connection,
            run_id=run_id,
            task="send_welcome",
            tenant_id=None,
            worker_id="w2",
            lease_seconds=30,
            receive_count=2,
        )
    assert live.status is attempts.ClaimStatus.LEASED
    with engine.begin() as connection:  # the worker died: its lease expired
        connection.execute(
            sa.text("UPDATE task_runs SET lease_expires_at = clock_timestamp() - interval '1 s'")
        )
        claim = attempts.take_lease(
            connection,
            run_id=run_id,
            task="send_welcome",
            tenant_id=None,
            worker_id="w2",
            lease_seconds=30,
            receive_count=2,
        )
    assert claim.status is attempts.ClaimStatus.CANCELLED
    run = run_row(engine, run_id)
    assert (run.status, run.attempts) == ("cancelled", 1)  # no new attempt was started
    assert [t.status for t in trail(engine, run_id)] == ["running", "cancelled"]
    assert trail(engine, run_id)[-1].detail == {"reason": "cancel-requested", "lease": "expired"}


def test_a_cancelled_run_is_never_claimed(factory: sessionmaker[Session], engine: sa.Engine) -> None:
    from sqla_outbox.lifecycle import attempts

    run_id = dispatch(factory)
    set_status(engine, run_id, "queued", sent=True)
    with factory() as session, session.begin():
        session.add(Cancel(run_id))
    with engine.begin() as connection:
        claim = attempts.take_lease(
            connection,
            run_id=run_id,
            task="send_welcome",
            tenant_id=None,
            worker_id="w1",
            lease_seconds=30,
            receive_count=1,
        )
    assert claim.status is attempts.ClaimStatus.CANCELLED
    assert run_row(engine, run_id).attempts == 0


def test_reschedule_earlier_wakes_the_relay(
    factory: sessionmaker[Session], valkey: Any, settings: OutboxSettings
) -> None:
    from tests.support import drain_wakes

    run_id = dispatch(factory, delay=3600)
    drain_wakes()
    valkey.delete(settings.wake_key)
    with factory() as session, session.begin():
        session.add(Reschedule(run_id, delay=0))
    drain_wakes()
    assert valkey.llen(settings.wake_key) == 1
    with factory() as session, session.begin():  # a cancel wakes nobody
        session.add(Cancel(run_id))
    drain_wakes()
    assert valkey.llen(settings.wake_key) == 1


def test_a_rolled_back_savepoint_takes_its_cancel_with_it(
    factory: sessionmaker[Session], engine: sa.Engine
) -> None:
    kept, undone = dispatch(factory), dispatch(factory)
    with factory() as session, session.begin():
        session.add(Cancel(kept))
        nested = session.begin_nested()
        session.add(Cancel(undone))
        session.flush()
        nested.rollback()
    assert run_row(engine, kept).status == "cancelled"
    assert run_row(engine, undone).status == "queued"
    assert [r.run_id for r in outbox_rows(engine)] == [undone]
