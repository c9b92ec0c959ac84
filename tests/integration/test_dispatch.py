"""Dispatch and Publish against real PostgreSQL: rows exist exactly when the commit does."""

from __future__ import annotations

import datetime as dt
import enum
import json
import uuid
from typing import Any

import pytest
import redis
import sqlalchemy as sa
from sqlalchemy.orm import Session, sessionmaker

import sqla_outbox
from sqla_outbox import Cancel, Dispatch, Group, Publish, errors
from sqla_outbox.catalog import Catalog
from sqla_outbox.config import OutboxSettings
from tests.support import (
    StatementFailed,
    count,
    cyclic_garbage,
    drain_wakes,
    failing_statement,
    outbox_rows,
    runs,
)


def wakes(valkey: redis.Redis, settings: OutboxSettings) -> int:
    drain_wakes()  # wakes go out on the waker's thread, just after the commit
    return int(valkey.llen(settings.wake_key))


def test_dispatch_writes_one_outbox_row_and_one_queued_run(
    factory: sessionmaker[Session], engine: sa.Engine
) -> None:
    with factory() as session, session.begin():
        item = Dispatch("send_welcome", {"user_id": 7}, tenant_id=3)
        run_id_at_build = item.run_id
        session.add(item)
    assert item.resolved_run_id == run_id_at_build
    assert item.deduplicated is False
    [row] = outbox_rows(engine)
    assert row.kind == "tenant"
    assert row.tenant_id == 3
    assert row.run_id == run_id_at_build
    assert row.queue == "default"
    assert row.sent_at is None and row.attempts == 0
    assert row.envelope["task"] == "send_welcome"
    assert json.loads(row.envelope["payload"]) == {"user_id": 7}
    [run] = runs(engine)
    assert (run.run_id, run.status, run.task, run.tenant_id) == (run_id_at_build, "queued", "send_welcome", 3)
    assert run.available_at == row.available_at


def test_without_tenant_the_row_goes_to_the_platform_outbox(
    factory: sessionmaker[Session], engine: sa.Engine
) -> None:
    with factory() as session, session.begin():
        session.add(Dispatch("rebuild_cache", {}))
    [row] = outbox_rows(engine)
    assert row.kind == "platform"
    assert row.queue == "maintenance"
    assert runs(engine)[0].tenant_id is None


def test_rollback_leaves_nothing_and_sends_no_wake(
    factory: sessionmaker[Session], engine: sa.Engine, valkey: redis.Redis, settings: OutboxSettings
) -> None:
    with factory() as session:
        session.add(Dispatch("send_welcome", {"user_id": 1}, tenant_id=1))
        session.flush()
        assert count(engine, "task_runs") == 0  # not visible outside the transaction
        session.rollback()
    assert outbox_rows(engine) == []
    assert runs(engine) == []
    assert wakes(valkey, settings) == 0


def test_exception_inside_the_transaction_rolls_the_dispatch_back(
    factory: sessionmaker[Session], engine: sa.Engine
) -> None:
    with pytest.raises(RuntimeError), factory() as session, session.begin():
        session.add(Dispatch("send_welcome", tenant_id=1))
        session.flush()
        raise RuntimeError("use case failed after the flush")
    assert count(engine, "task_runs") == 0
    assert count(engine, "outbox_messages") == 0


def test_one_commit_one_wake_however_many_rows(
    factory: sessionmaker[Session], valkey: redis.Redis, settings: OutboxSettings
) -> None:
    with factory() as session, session.begin():
        session.add_all([Dispatch("audit", {"n": n}) for n in range(5)])
        session.add(Publish("user.created", {"user_id": 1}))
    assert wakes(valkey, settings) == 1
    with factory() as session, session.begin():
        session.add(Dispatch("audit"))
    assert wakes(valkey, settings) == 2


def test_commit_without_outbox_rows_sends_no_wake(
    factory: sessionmaker[Session], valkey: redis.Redis, settings: OutboxSettings
) -> None:
    with factory() as session, session.begin():
        session.execute(sa.text("UPDATE tenants SET name = 'x' WHERE id = 1"))
    with factory() as session, session.begin():
        session.add(Publish("nobody.listens", {}))  # known event, no subscribers
    assert wakes(valkey, settings) == 0


def test_many_dispatches_in_one_flush_are_one_statement(
    factory: sessionmaker[Session], engine: sa.Engine
) -> None:
    statements: list[str] = []

    def record(conn, cursor, statement, parameters, context, executemany) -> None:
        statements.append(statement)

    sa.event.listen(engine, "before_cursor_execute", record)
    try:
        with factory() as session, session.begin():
            session.add_all(
                [Dispatch("audit", {"n": n}, tenant_id=1 + n % 3) for n in range(100)]
                + [Dispatch("rebuild_cache", {"n": n}) for n in range(20)]
            )
    finally:
        sa.event.remove(engine, "before_cursor_execute", record)
    inserts = [s for s in statements if "INSERT INTO task_runs" in s]
    assert len(inserts) == 1
    assert count(engine, "task_runs") == 120
    assert count(engine, "outbox_messages") == 100
    assert count(engine, "platform_outbox_messages") == 20


def test_dispatch_order_is_kept_in_row_ids(factory: sessionmaker[Session], engine: sa.Engine) -> None:
    items = [Dispatch("audit", {"n": n}, tenant_id=2) for n in range(10)]
    with factory() as session, session.begin():
        session.add_all(items)
    with engine.connect() as conn:
        ordered = [r[0] for r in conn.execute(sa.text("SELECT run_id FROM outbox_messages ORDER BY id"))]
    assert ordered == [i.run_id for i in items]


def test_publish_fans_out_one_run_per_subscriber(factory: sessionmaker[Session], engine: sa.Engine) -> None:
    with factory() as session, session.begin():
        event = Publish("user.created", {"user_id": 9}, tenant_id=4)
        session.add(event)
        assert set(event.runs) == {"send_welcome", "index_user"}
    rows = outbox_rows(engine)
    assert {(r.envelope["task"], r.queue) for r in rows} == {
        ("send_welcome", "default"),
        ("index_user", "bulk"),
    }
    assert {r.envelope["event"] for r in rows} == {"user.created"}
    assert {r.run_id for r in rows} == set(event.runs.values())
    assert len({r.run_id for r in rows}) == 2
    assert event.resolved_run_ids == event.runs
    assert {r.event for r in runs(engine)} == {"user.created"}


def test_delay_is_measured_on_the_database_clock(factory: sessionmaker[Session], engine: sa.Engine) -> None:
    with factory() as session, session.begin():
        session.execute(sa.text("SELECT pg_sleep(0.3)"))  # a long transaction
        session.add(Dispatch("audit", {}, delay=dt.timedelta(seconds=30)))
        session.flush()
        transaction_start, clock = session.execute(sa.text("SELECT now(), clock_timestamp()")).one()
    [row] = outbox_rows(engine)
    assert row.available_at.tzinfo is not None
    # 30 s after the insert, not after the transaction began
    assert row.available_at - transaction_start >= dt.timedelta(seconds=30.3)
    assert abs((row.available_at - clock) - dt.timedelta(seconds=30)) < dt.timedelta(seconds=1)


def test_delay_accepts_seconds_and_long_durations(factory: sessionmaker[Session], engine: sa.Engine) -> None:
    with factory() as session, session.begin():
        session.add(Dispatch("audit", {"n": 1}, delay=90))
        session.add(Dispatch("audit", {"n": 2}, delay=dt.timedelta(days=3650)))
    rows = sorted(outbox_rows(engine), key=lambda r: r.available_at)
    assert dt.timedelta(seconds=89) < rows[0].available_at - rows[0].created_at < dt.timedelta(seconds=91)
    assert rows[1].available_at - rows[1].created_at > dt.timedelta(days=3649)


def test_available_at_is_absolute_and_timezone_safe(
    factory: sessionmaker[Session], engine: sa.Engine
) -> None:
    due = dt.datetime(2030, 1, 2, 3, 4, 5, tzinfo=dt.timezone(dt.timedelta(hours=-3)))
    with factory() as session, session.begin():
        session.execute(sa.text("SET LOCAL TIME ZONE 'Asia/Tokyo'"))
        session.add(Dispatch("audit", {}, available_at=due))
    [row] = outbox_rows(engine)
    assert row.available_at == due
    assert row.available_at.utcoffset() is not None


def test_connection_time_zone_does_not_shift_available_at(
    factory: sessionmaker[Session], engine: sa.Engine
) -> None:
    with factory() as session, session.begin():
        session.execute(sa.text("SET LOCAL TIME ZONE 'America/Sao_Paulo'"))
        session.add(Dispatch("audit", {}, delay=60))
        db_now = session.execute(sa.text("SELECT clock_timestamp()")).scalar_one()
    [row] = outbox_rows(engine)
    assert dt.timedelta(seconds=59) < row.available_at - db_now < dt.timedelta(seconds=61)


def test_enum_and_subclass_names_and_tenants_are_stored_as_their_plain_values(
    factory: sessionmaker[Session], engine: sa.Engine
) -> None:
    """The envelope (orjson writes an Enum member's .value), the rows and SQS all see the
    same plain text and integer: a Dispatch keeps exact copies of what it is given."""

    class Tenant(enum.IntEnum):
        def __new__(cls, value: str) -> Tenant:
            member = int.__new__(cls, 3)  # the integer is 3, the value a label
            member._value_ = value
            return member

        ACME = "acme"

    class Task(enum.StrEnum):
        WELCOME = "send_welcome"

        def __str__(self) -> str:
            return "not the task name"

    with factory() as session, session.begin():
        item = Dispatch(Task.WELCOME, {"user_id": 7}, tenant_id=Tenant.ACME, idempotency_key=Task.WELCOME)
        session.add(item)
    assert type(item.task) is str and type(item.tenant_id) is int and type(item.idempotency_key) is str
    [row] = outbox_rows(engine)
    assert row.tenant_id == 3 and row.envelope["tenant_id"] == 3
    assert row.envelope["task"] == "send_welcome" and row.envelope["idempotency_key"] == "send_welcome"
    [run] = runs(engine)
    assert (run.task, run.tenant_id, run.idempotency_key) == ("send_welcome", 3, "send_welcome")


def test_names_keys_and_tenants_are_checked_as_they_are_stored() -> None:
    """A subclass's own __len__ or comparisons do not decide: the exact copy is checked."""

    class Short(str):
        def __len__(self) -> int:
            return 1

    class Small(int):
        def __lt__(self, other: object) -> bool:
            return True

        def __le__(self, other: object) -> bool:
            return True

    with pytest.raises(errors.InvalidDispatch, match="at most 512"):
        Dispatch("send_welcome", tenant_id=1, idempotency_key=Short("k" * 5000))
    with pytest.raises(errors.InvalidDispatch, match="bigint"):
        Dispatch("send_welcome", tenant_id=Small(2**70))
    assert type(Dispatch("send_welcome", tenant_id=Small(3)).tenant_id) is int


# --- idempotency -------------------------------------------------------------------------
def test_duplicate_idempotency_key_resolves_to_the_existing_run(
    factory: sessionmaker[Session], engine: sa.Engine
) -> None:
    with factory() as session, session.begin():
        first = Dispatch("send_welcome", {"v": 1}, tenant_id=5, idempotency_key="welcome:5")
        session.add(first)
    with factory() as session, session.begin():
        second = Dispatch("send_welcome", {"v": 2}, tenant_id=5, idempotency_key="welcome:5")
        session.add(second)
    assert second.deduplicated is True
    assert second.resolved_run_id == first.run_id
    assert second.run_id != first.run_id
    assert count(engine, "task_runs") == 1
    assert count(engine, "outbox_messages") == 1


def test_idempotency_key_is_scoped_by_task_and_tenant(
    factory: sessionmaker[Session], engine: sa.Engine
) -> None:
    with factory() as session, session.begin():
        session.add(Dispatch("send_welcome", tenant_id=5, idempotency_key="k"))
        session.add(Dispatch("send_welcome", tenant_id=6, idempotency_key="k"))
        session.add(Dispatch("audit", tenant_id=5, idempotency_key="k"))
        session.add(Dispatch("audit", idempotency_key="k"))  # platform
        session.add(Dispatch("audit", idempotency_key="k"))  # platform duplicate
    assert count(engine, "task_runs") == 4


def test_duplicates_in_one_flush_resolve_to_the_first(factory: sessionmaker[Session]) -> None:
    with factory() as session, session.begin():
        a = Dispatch("audit", tenant_id=1, idempotency_key="same")
        b = Dispatch("audit", tenant_id=1, idempotency_key="same")
        session.add_all([a, b])
    assert a.resolved_run_id == a.run_id and not a.deduplicated
    assert b.resolved_run_id == a.run_id and b.deduplicated


def test_key_is_free_again_once_the_run_finished(factory: sessionmaker[Session], engine: sa.Engine) -> None:
    with factory() as session, session.begin():
        first = Dispatch("audit", tenant_id=1, idempotency_key="nightly:1")
        session.add(first)
    with engine.begin() as conn:
        conn.execute(sa.text("UPDATE task_runs SET status = 'succeeded'"))
    with factory() as session, session.begin():
        again = Dispatch("audit", tenant_id=1, idempotency_key="nightly:1")
        session.add(again)
    assert again.resolved_run_id == again.run_id
    assert count(engine, "task_runs") == 2


@pytest.mark.parametrize("runs_in_flush", [1, 2], ids=["one-run flush", "several-run flush"])
def test_a_keyed_rival_finishing_between_insert_and_lookup_makes_a_new_run(
    factory: sessionmaker[Session], engine: sa.Engine, runs_in_flush: int
) -> None:
    """The INSERT loses to an unfinished rival; the rival finishes before the lookup finds
    it; the write tries the INSERT again, which now succeeds (both write paths)."""
    with factory() as session, session.begin():
        rival = Dispatch("audit", tenant_id=1, idempotency_key="nightly:1")
        session.add(rival)
    finished: list[str] = []

    def finish_the_rival(conn, cursor, statement, parameters, context, executemany) -> None:  # type: ignore[no-untyped-def]
        if statement.lstrip().startswith("WITH") and "INSERT INTO task_runs" in statement and not finished:
            with engine.connect() as other, other.begin():
                other.execute(
                    sa.text("UPDATE task_runs SET status = 'succeeded' WHERE run_id = :r"),
                    {"r": rival.run_id},
                )
            finished.append(statement)

    sa.event.listen(engine, "after_cursor_execute", finish_the_rival)
    try:
        with factory() as session, session.begin():
            again = Dispatch("audit", tenant_id=1, idempotency_key="nightly:1")
            session.add(again)
            if runs_in_flush == 2:
                session.add(Dispatch("audit", tenant_id=1, idempotency_key="other"))
    finally:
        sa.event.remove(engine, "after_cursor_execute", finish_the_rival)
    assert len(finished) == 1
    assert again.resolved_run_id == again.run_id and not again.deduplicated
    assert count(engine, "task_runs") == 1 + runs_in_flush
    assert {row.run_id for row in outbox_rows(engine)} >= {rival.run_id, again.run_id}


@pytest.mark.parametrize("runs_in_flush", [1, 2], ids=["one-run flush", "several-run flush"])
def test_a_key_whose_rivals_keep_finishing_fails_the_flush_instead_of_dropping_the_run(
    factory: sessionmaker[Session], engine: sa.Engine, runs_in_flush: int
) -> None:
    """Each INSERT meets an unfinished rival that finishes before the lookup, and a new
    rival appears before the next INSERT: after three rounds the flush raises and the
    transaction writes nothing (it used to commit with the dispatch unresolved and unwritten)."""
    installed = sqla_outbox.installation_for(factory)
    assert installed is not None
    other = sessionmaker(sa.create_engine(engine.url))
    sqla_outbox.install(other, installed.settings, catalog=installed.catalog)

    def new_rival() -> uuid.UUID:
        with other() as session, session.begin():
            rival = Dispatch("audit", tenant_id=1, idempotency_key="nightly:1")
            session.add(rival)
        return rival.run_id

    rivals = [new_rival()]

    def interleave(conn, cursor, statement, parameters, context, executemany) -> None:  # type: ignore[no-untyped-def]
        if "INSERT INTO task_runs" in statement:  # the rival finishes before the lookup
            with other.kw["bind"].begin() as c:
                c.execute(
                    sa.text("UPDATE task_runs SET status = 'succeeded' WHERE run_id = :r"), {"r": rivals[-1]}
                )
        elif "idempotency_key = ANY" in statement:  # and a new one is there for the next INSERT
            rivals.append(new_rival())

    sa.event.listen(engine, "after_cursor_execute", interleave)
    try:
        with factory() as session:
            mine = Dispatch("audit", {"mine": True}, tenant_id=1, idempotency_key="nightly:1")
            session.add(mine)
            if runs_in_flush == 2:
                session.add(Dispatch("audit", tenant_id=2))
            with pytest.raises(errors.IdempotencyKeyContended) as caught:
                session.flush()
            session.commit()  # an application that catches the error and goes on
    finally:
        sa.event.remove(engine, "after_cursor_execute", interleave)
        sqla_outbox.uninstall(other)
        other.kw["bind"].dispose()
    assert caught.value.task == "audit" and caught.value.code == "idempotency-key-contended"
    assert len(rivals) == 4  # the first rival and one per round
    assert {row.run_id for row in runs(engine)} == set(rivals)  # nothing of the failed flush
    assert count(engine, "outbox_messages") == len(rivals)
    assert mine.resolved_run_id is None


def test_a_flush_refused_after_its_first_statement_leaves_nothing_even_when_committed(
    factory: sessionmaker[Session], engine: sa.Engine
) -> None:
    """A run_id of another task's run is found only after the flush's INSERT wrote the other
    runs and the group: they are taken back, so catching the error and committing writes
    none of the flush (a flush of outbox objects alone writes from before_flush, which
    SQLAlchemy does not roll back)."""
    taken = uuid.uuid4()
    with factory() as session, session.begin():
        session.add(Dispatch("send_welcome", tenant_id=1, run_id=taken))
    with factory() as session:
        session.add(Dispatch("audit", tenant_id=2))
        session.add(Publish("user.created", {"user_id": 1}, tenant_id=2))
        session.add(Group([Dispatch("audit", tenant_id=3)], on_complete=Dispatch("audit", tenant_id=3)))
        session.add(Dispatch("audit", tenant_id=1, run_id=taken))
        with pytest.raises(errors.InvalidDispatch, match="already belongs"):
            session.flush()
        session.commit()
    assert [row.run_id for row in runs(engine)] == [taken]
    assert count(engine, "outbox_messages") == 1
    assert count(engine, "task_groups") == 0


def test_the_objects_of_a_refused_flush_read_as_never_written(
    factory: sessionmaker[Session], engine: sa.Engine
) -> None:
    """Their rows are taken back, so none of the flush's objects names a run: not the ones
    written before the problem was found, not the one refused (which read deduplicated with
    no run), not a group's members, not a publish's subscribers; the one-run flush too."""
    taken = uuid.uuid4()
    with factory() as session, session.begin():
        session.add(Dispatch("send_welcome", tenant_id=1, run_id=taken))
    alone = Dispatch("audit", tenant_id=1, run_id=taken)  # the one-run flush's path
    with factory() as session:
        session.add(alone)
        with pytest.raises(errors.InvalidDispatch, match="already belongs"):
            session.flush()
    assert (alone.resolved_run_id, alone.deduplicated) == (None, False)
    good = Dispatch("audit", tenant_id=2)
    member = Dispatch("audit", tenant_id=3)
    event = Publish("user.created", {"user_id": 1}, tenant_id=2)
    bad = Dispatch("audit", tenant_id=1, run_id=taken)
    with factory() as session:
        session.add_all([good, event, Group([member], on_complete=Dispatch("audit", tenant_id=3)), bad])
        with pytest.raises(errors.InvalidDispatch, match="already belongs"):
            session.flush()
        session.commit()
    assert [(d.resolved_run_id, d.deduplicated) for d in (good, member, bad)] == [(None, False)] * 3
    assert event.resolved_run_ids == {}
    assert [row.run_id for row in runs(engine)] == [taken]
    with factory() as session, session.begin():  # added again, they are written as new
        session.add_all([good, event])
    assert good.resolved_run_id == good.run_id and not good.deduplicated
    assert set(event.resolved_run_ids.values()) == set(event.runs.values())
    assert count(engine, "task_runs") == 1 + 1 + 2


def test_dispatches_leave_no_reference_cycles(factory: sessionmaker[Session], engine: sa.Engine) -> None:
    """Reference counting frees a Dispatch, Publish or Group and its prepared runs once the
    flush is over, committed or rolled back: the prepared run no longer points back to the
    object it came from (that cycle left about ten objects per dispatch, its payload and
    envelope among them, to the cyclic garbage collector: memory held until a collection,
    and the dispatching transaction paid for the collections)."""
    from sqla_outbox.dispatch import PreparedGroup, PreparedRun

    ours = (Dispatch, Publish, Group, PreparedRun, PreparedGroup)
    with cyclic_garbage(*ours) as garbage:
        for n in range(3):
            with factory() as session, session.begin():
                session.add(Dispatch("send_welcome", {"n": n}, tenant_id=3))
                session.add(Dispatch("audit", {"n": n}, tenant_id=3, idempotency_key="same"))
                session.add(Publish("user.created", {"n": n}, tenant_id=3))
                session.add(
                    Group([Dispatch("audit", tenant_id=3)], on_complete=Dispatch("audit", tenant_id=3))
                )
            with factory() as session:
                session.add(Dispatch("send_welcome", {"n": n}, tenant_id=3))
                session.flush()
                session.rollback()
    assert garbage == []
    # a round: send_welcome, two subscribers, the group's member (its completion waits for
    # the member to finish); the keyed audit run is one run, not three
    assert count(engine, "task_runs") == 3 * 4 + 1
    kept = Dispatch("send_welcome", tenant_id=3)
    with factory() as session, session.begin():
        session.add(kept)
    assert kept.resolved_run_id == kept.run_id and kept.deduplicated is False  # read from its run


def test_the_objects_of_a_flush_that_fails_after_its_write_read_as_never_written(
    factory: sessionmaker[Session], engine: sa.Engine
) -> None:
    """A statement failing after the runs were written and resolved (the group join, the
    write's last statement; or a Cancel of the same flush) aborts the transaction: the
    flush's dispatches read as never written, its controls as never applied."""
    good = Dispatch("audit", tenant_id=2)
    with failing_statement(engine, "SET group_id"), factory() as session:
        session.add_all(
            [good, Group([Dispatch("audit", tenant_id=3)], on_complete=Dispatch("audit", tenant_id=3))]
        )
        with pytest.raises(StatementFailed):
            session.flush()
    assert (good.resolved_run_id, good.deduplicated) == (None, False)
    target = uuid.uuid4()
    first, second = Cancel(run_id=target), Cancel(run_id=uuid.uuid4())
    again = Dispatch("audit", tenant_id=2)
    with failing_statement(engine, "cancel_requested_at", nth=2), factory() as session:
        session.add_all([again, first, second])
        with pytest.raises(StatementFailed):
            session.flush()
    assert (again.resolved_run_id, first.applied, first.results, first.outcome) == (None, False, [], None)
    assert count(engine, "task_runs") == 0


def test_caller_chosen_run_id_is_quietly_deduplicated(
    factory: sessionmaker[Session], engine: sa.Engine
) -> None:
    run_id = uuid.uuid4()
    for _ in range(2):
        with factory() as session, session.begin():
            item = Dispatch("rebuild_cache", run_id=run_id)
            session.add(item)
    assert item.resolved_run_id == run_id and item.deduplicated
    assert count(engine, "task_runs") == 1
    assert count(engine, "platform_outbox_messages") == 1


def test_caller_chosen_run_id_of_another_task_or_tenant_is_refused(
    factory: sessionmaker[Session], engine: sa.Engine
) -> None:
    """Resolving to a run of another task or tenant would silently drop the dispatch."""
    run_id = uuid.uuid4()
    with factory() as session, session.begin():
        session.add(Dispatch("audit", {}, tenant_id=1, run_id=run_id))
    for other in (
        Dispatch("send_welcome", {}, tenant_id=1, run_id=run_id),
        Dispatch("audit", {}, tenant_id=2, run_id=run_id),
    ):
        with factory() as session, pytest.raises(errors.InvalidDispatch) as caught:
            with session.begin():
                session.add(other)
        assert caught.value.task == other.task and f"run_id {run_id} already belongs" in str(caught.value)
    with factory() as session, pytest.raises(errors.InvalidDispatch):  # twins in one flush
        with session.begin():
            twin = uuid.uuid4()
            session.add_all(
                [Dispatch("audit", {}, tenant_id=1, run_id=twin), Dispatch("audit", {}, run_id=twin)]
            )
    assert count(engine, "task_runs") == 1 and count(engine, "outbox_messages") == 1


def test_keyed_dispatch_whose_chosen_run_id_exists_is_never_silently_dropped(
    factory: sessionmaker[Session], engine: sa.Engine
) -> None:
    run_id = uuid.uuid4()
    with factory() as session, session.begin():
        session.add(Dispatch("audit", {}, tenant_id=1, run_id=run_id))
    with factory() as session, pytest.raises(errors.InvalidDispatch, match="already belongs"):
        with session.begin():
            session.add(Dispatch("send_welcome", {}, tenant_id=1, run_id=run_id, idempotency_key="k"))
    with factory() as session, session.begin():  # same task and tenant: resolves to that run
        same = Dispatch("audit", {}, tenant_id=1, run_id=run_id, idempotency_key="k")
        session.add(same)
    assert (same.resolved_run_id, same.deduplicated) == (run_id, True)
    assert count(engine, "task_runs") == 1


def test_dispatch_helper_returns_the_resolved_run(factory: sessionmaker[Session]) -> None:
    with factory() as session, session.begin():
        first = sqla_outbox.dispatch(session, "audit", {"a": 1}, tenant_id=1, idempotency_key="x")
        second = sqla_outbox.dispatch(session, "audit", {"a": 2}, tenant_id=1, idempotency_key="x")
        fanned = sqla_outbox.publish(session, "user.created", {"u": 1})
    assert first == second
    assert set(fanned) == {"send_welcome", "index_user"}


def test_the_helpers_deliver_the_payload_as_dispatch_does(
    factory: sessionmaker[Session], engine: sa.Engine
) -> None:
    """``payload=None`` is delivered as ``None`` by ``Dispatch`` and by the helpers alike
    (the helpers used to turn it into ``{}``); no payload at all means ``{}`` for both."""
    with factory() as session, session.begin():
        session.add(Dispatch("audit", None, idempotency_key="class-none"))
        session.add(Dispatch("audit", idempotency_key="class-missing"))
        sqla_outbox.dispatch(session, "audit", None, idempotency_key="helper-none")
        sqla_outbox.dispatch(session, "audit", idempotency_key="helper-missing")
    with engine.connect() as conn:
        keys = dict(conn.execute(sa.text("SELECT run_id, idempotency_key FROM task_runs")).all())
    delivered = {keys[r.run_id]: json.loads(r.envelope["payload"]) for r in outbox_rows(engine)}
    assert delivered == {"class-none": None, "class-missing": {}, "helper-none": None, "helper-missing": {}}


# --- bad input ----------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("make", "error", "fragment"),
    [
        (lambda: Dispatch("ghost_task"), errors.UnknownTask, "'ghost_task'"),
        (lambda: Publish("ghost.event"), errors.UnknownEvent, "'ghost.event'"),
        (lambda: Dispatch("charge_card", {"amount": 1}), errors.InvalidDispatch, "pass tenant_id"),
        (lambda: Dispatch("rebuild_cache", tenant_id=1), errors.InvalidDispatch, "takes no tenant_id"),
        (lambda: Dispatch("audit", {"blob": "x" * 300_000}), errors.EnvelopeTooLarge, "262144"),
    ],
)
def test_bad_input_is_refused_at_add_and_nothing_is_written(
    factory: sessionmaker[Session], engine: sa.Engine, make, error, fragment: str
) -> None:
    with factory() as session, session.begin():
        session.add(Dispatch("audit", {"kept": True}))  # committed work must survive
        bad = make()
        with pytest.raises(error) as caught:
            session.add(bad)
        assert bad not in session
        assert fragment in str(caught.value)
    assert [json.loads(r.envelope["payload"]) for r in outbox_rows(engine)] == [{"kept": True}]


@pytest.mark.parametrize(
    ("kwargs", "error", "fragment"),
    [
        ({"payload": {"raw": b"\x00"}}, errors.PayloadNotSerializable, "bytes at $.raw"),
        ({"payload": {"s": {1}}}, errors.PayloadNotSerializable, "set at $.s"),
        ({"payload": {"x": float("nan")}}, errors.PayloadNotSerializable, "NaN"),
        ({"payload": [float("-inf")]}, errors.PayloadNotSerializable, "JSON has no NaN/Infinity"),
        ({"payload": {"o": object()}}, errors.PayloadNotSerializable, "object at $.o"),
        ({"queue": "urgent!"}, errors.UnknownQueue, "unknown queue 'urgent!'"),  # undeclared names: at add
        ({"delay": -1}, errors.InvalidDispatch, "must not be negative"),
        ({"delay": dt.timedelta(seconds=-5)}, errors.InvalidDispatch, "must not be negative, got -5 s"),
        ({"delay": float("nan")}, errors.InvalidDispatch, "finite"),
        ({"delay": dt.timedelta(days=999_999_999)}, errors.InvalidDispatch, "past year 9999"),
        ({"available_at": dt.datetime(2030, 1, 1)}, errors.InvalidDispatch, "naive"),
        (
            {"delay": 5, "available_at": dt.datetime(2030, 1, 1, tzinfo=dt.UTC)},
            errors.InvalidDispatch,
            "not both",
        ),
        ({"tenant_id": "3"}, errors.InvalidDispatch, "tenant_id must be an integer"),
        ({"tenant_id": True}, errors.InvalidDispatch, "tenant_id must be an integer"),
        ({"idempotency_key": ""}, errors.InvalidDispatch, "idempotency_key"),
        ({"idempotency_key": "a\x00b"}, errors.InvalidDispatch, "NUL"),
        ({"idempotency_key": "\ud800"}, errors.InvalidDispatch, "lone surrogate"),
        ({"run_id": "not-a-uuid"}, errors.InvalidDispatch, "run_id"),
    ],
)
def test_bad_options_fail_at_construction_naming_the_task(kwargs, error, fragment: str) -> None:
    payload = kwargs.pop("payload", {})
    with pytest.raises(error) as caught:
        Dispatch("audit", payload, **kwargs)
    assert "'audit'" in str(caught.value)
    assert fragment in str(caught.value)
    assert caught.value.task == "audit"


def test_bad_task_name_is_refused() -> None:
    with pytest.raises(errors.InvalidDispatch):
        Dispatch("no spaces allowed")


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda: Dispatch(None), "Dispatch() takes the task name (a str) first, got NoneType None"),  # type: ignore[arg-type]
        (lambda: Dispatch(42), "Dispatch() takes the task name (a str) first, got int 42"),  # type: ignore[arg-type]
        (lambda: Publish(None), "Publish() takes the event name (a str) first, got NoneType None"),  # type: ignore[arg-type]
    ],
)
def test_a_name_that_is_not_a_string_is_named_as_what_it_is(build: Any, message: str) -> None:
    # not "task 'None': ...", which reads as a task called None
    with pytest.raises(errors.InvalidDispatch) as caught:
        build()
    assert str(caught.value) == message
    assert caught.value.task is None


def test_an_overlong_name_is_shortened_in_the_message_and_kept_whole_on_the_error() -> None:
    name = "x" * 5000
    with pytest.raises(errors.InvalidDispatch) as caught:
        Dispatch(name)
    assert len(str(caught.value)) < 200
    assert caught.value.task == name


def test_a_wrong_keyword_names_the_class() -> None:
    # SQLAlchemy's instrumented __init__ is called plain "__init__"
    with pytest.raises(
        TypeError, match=r"^Dispatch\.__init__\(\) got an unexpected keyword argument 'tenant'"
    ):
        Dispatch("audit", tenant=1)  # type: ignore[call-arg]
    with pytest.raises(TypeError, match=r"^Cancel\.__init__\(\) got an unexpected keyword argument"):
        Cancel(tenant=1)  # type: ignore[call-arg]


def test_payload_over_a_raised_limit_is_accepted(
    engine: sa.Engine, settings: OutboxSettings, catalog: Catalog
) -> None:
    maker = sessionmaker(engine)
    sqla_outbox.install(maker, settings.replace(max_message_bytes=1_048_576), catalog=catalog)
    try:
        with maker() as session, session.begin():
            session.add(Dispatch("audit", {"blob": "x" * 500_000}))
        assert count(engine, "platform_outbox_messages") == 1
    finally:
        sqla_outbox.uninstall(maker)


def test_unknown_tenant_violates_the_foreign_key_at_flush(
    factory: sessionmaker[Session], engine: sa.Engine
) -> None:
    with pytest.raises(sa.exc.IntegrityError, match="outbox_messages_tenant_id_fkey"):
        with factory() as session, session.begin():
            session.add(Dispatch("audit", tenant_id=999_999))
    assert count(engine, "task_runs") == 0


def test_merge_is_refused_clearly_and_writes_nothing(
    factory: sessionmaker[Session], engine: sa.Engine
) -> None:
    with factory() as session, pytest.raises(TypeError, match=r"session.merge\(\) of a Dispatch"):
        session.merge(Dispatch("audit", {}))
    with factory() as session, pytest.raises(TypeError, match=r"session.merge\(\) of a Publish"):
        session.merge(Publish("user.created", {"u": 1}))
    assert count(engine, "task_runs") == 0


@pytest.mark.parametrize(("script", "char"), [("ascii", "a"), ("latin", "é"), ("cjk", "中"), ("emoji", "😀")])
def test_payload_size_is_counted_in_utf8_bytes_whatever_the_script(
    factory: sessionmaker[Session],
    engine: sa.Engine,
    catalog: Catalog,
    settings: OutboxSettings,
    sqs_endpoint: str,
    queues: dict[str, str],
    sqs: object,
    script: str,
    char: str,
) -> None:
    """``Dispatch("t", {"s": "中" * 80000})`` (240 KB of UTF-8) was refused as 560,310 bytes:
    each non-ASCII character was escaped twice (7 bytes; an emoji 14). The limit applies to
    the UTF-8 bytes SQS counts; a payload up to the limit less the envelope's overhead is
    accepted in any script, goes through (strict) SQS and arrives byte for byte."""
    from sqla_outbox import envelope
    from sqla_outbox.relay import Relay

    limit = settings.max_message_bytes
    width = len(char.encode("utf-8"))
    (probe,) = Dispatch("audit", {"s": ""}).prepare(catalog, max_message_bytes=10**9)
    overhead = (
        envelope.message_size_bytes(
            probe.envelope_json, envelope.message_attributes(probe.run_id, "audit", None)
        )
        + envelope.SIGNATURE_SIZE_BYTES
    )
    fits = (limit - overhead) // width
    assert fits * width > 0.99 * limit - 1000  # nearly the whole limit, whatever the script
    with pytest.raises(errors.EnvelopeTooLarge) as refused:
        Dispatch("audit", {"s": char * (fits + 1)}).prepare(catalog, max_message_bytes=limit)
    assert refused.value.size_bytes == overhead + (fits + 1) * width
    payload = {"s": char * fits}
    with factory() as session, session.begin():
        item = Dispatch("audit", payload)
        session.add(item)
    relay = Relay(settings.replace(sqs_endpoint_url=sqs_endpoint), engine=engine)
    assert relay.run_once().sent == 1  # the strict SQS layer counts the same bytes and takes it
    [message] = sqs.receive_message(QueueUrl=queues["default"], MessageAttributeNames=["All"])["Messages"]  # type: ignore[attr-defined]
    received = envelope.decode(message["Body"], max_bytes=limit)
    assert received.run_id == item.run_id
    assert json.dumps(received.payload) == json.dumps(payload)
    if script == "cjk":  # the issue's own example is accepted now
        (run,) = Dispatch("audit", {"s": "中" * 80_000}).prepare(catalog, max_message_bytes=limit)
        assert len(run.envelope_json.encode("utf-8")) < 241_000


def test_a_flush_of_several_runs_stores_every_value_exactly(
    factory: sessionmaker[Session], engine: sa.Engine
) -> None:
    """The multi-run statement reads its rows from JSON: keys, offsets and microseconds survive."""
    odd_offset = dt.timezone(dt.timedelta(hours=5, minutes=30, seconds=15))
    due = dt.datetime(2031, 4, 5, 6, 7, 8, 123456, tzinfo=odd_offset)
    key = 'ключ "quoted" \\ back\\slash {brace}, comma 🙂'
    with factory() as session, session.begin():
        session.add(Dispatch("send_welcome", {"n": 1}, tenant_id=5, idempotency_key=key))
        session.add(Dispatch("audit", {"n": 2}, available_at=due, priority=7))
        session.add(Dispatch("audit", {"n": 3}, delay=dt.timedelta(days=2, seconds=3, microseconds=7)))
    by_payload = {json.loads(r.envelope["payload"])["n"]: r for r in outbox_rows(engine)}
    assert by_payload[2].available_at == due
    with engine.connect() as conn:
        stored_key = conn.execute(
            sa.text("SELECT idempotency_key FROM task_runs WHERE tenant_id = 5")
        ).scalar()
        priorities = conn.execute(sa.text("SELECT priority FROM platform_outbox_messages")).scalars().all()
    assert 7 in priorities
    assert stored_key == key
    assert by_payload[1].envelope["idempotency_key"] == key


@pytest.mark.parametrize(
    "delay",
    [
        dt.timedelta(0),
        dt.timedelta(microseconds=1),
        dt.timedelta(days=2, seconds=3, microseconds=7),
        dt.timedelta(days=999_999_999, seconds=86_399, microseconds=999_999),
    ],
)
def test_delays_reach_postgresql_exactly(engine: sa.Engine, delay: dt.timedelta) -> None:
    from sqla_outbox.write import _interval

    with engine.connect() as conn:
        assert conn.execute(sa.text("SELECT CAST(:d AS interval)"), {"d": _interval(delay)}).scalar() == delay
