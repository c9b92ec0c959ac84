"""Groups on real PostgreSQL: the completion run is written once, by the last member's
finishing transaction, whichever finishing path and however the members race."""

from __future__ import annotations

import threading
import uuid
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.orm import Session, sessionmaker

from sqla_outbox import Dispatch, Group, errors, groups
from sqla_outbox.lifecycle import attempts


def add_group(app: sessionmaker[Session], size: int, **completion: Any) -> Group:
    with app() as session, session.begin():
        group = Group(
            [Dispatch("audit", {"seat": i}) for i in range(size)],
            on_complete=Dispatch("send_welcome", {"booking": 7}, **completion),
        )
        session.add(group)
    return group


def member_ids(engine: sa.Engine, group: Group) -> list[uuid.UUID]:
    with engine.connect() as conn:
        return list(
            conn.execute(
                sa.text("SELECT run_id FROM task_runs WHERE group_id = :g ORDER BY created_at"),
                {"g": group.group_id},
            ).scalars()
        )


def completion_rows(engine: sa.Engine, group: Group) -> tuple[int, int]:
    """(task_runs rows, outbox rows) of the group's completion run."""
    with engine.connect() as conn:
        run_rows = conn.execute(
            sa.text("SELECT count(*) FROM task_runs WHERE run_id = :r"), {"r": group.completion_run_id}
        ).scalar_one()
        outbox = conn.execute(
            sa.text(
                "SELECT (SELECT count(*) FROM platform_outbox_messages WHERE run_id = :r) "
                "+ (SELECT count(*) FROM outbox_messages WHERE run_id = :r)"
            ),
            {"r": group.completion_run_id},
        ).scalar_one()
    return int(run_rows), int(outbox)


def take(conn: sa.Connection, run_id: uuid.UUID, worker: str) -> attempts.Attempt:
    claim = attempts.take_lease(
        conn,
        run_id=run_id,
        task="audit",
        tenant_id=None,
        worker_id=worker,
        lease_seconds=60,
        receive_count=1,
        honour_due_time=False,
    )
    assert claim.status is attempts.ClaimStatus.CLAIMED, claim
    return attempts.Attempt(run_id=run_id, attempt=claim.attempt, receive_count=1, worker_id=worker)


def test_a_group_writes_its_members_and_holds_the_completion_back(
    app: sessionmaker[Session], engine: sa.Engine
) -> None:
    group = add_group(app, 3)
    members = member_ids(engine, group)
    assert len(members) == 3
    assert completion_rows(engine, group) == (0, 0)
    state = groups.get_group(engine.connect(), group.group_id)
    assert state is not None
    assert (state.total, state.finished, state.completed_at) == (3, 0, None)
    assert [m.status for m in state.members] == ["queued"] * 3


def test_the_last_member_to_finish_writes_the_completion_once_with_every_status(
    app: sessionmaker[Session], engine: sa.Engine
) -> None:
    group = add_group(app, 3)
    first, second, third = member_ids(engine, group)
    with engine.begin() as conn:
        attempts.mark_succeeded(conn, take(conn, first, "w1"))
    with engine.begin() as conn:  # failed and given up: finished too
        attempts.mark_failed(
            conn, take(conn, second, "w1"), attempts.Failure("ValueError", "no seat"), reason="permanent"
        )
    assert completion_rows(engine, group) == (0, 0)
    with engine.begin() as conn:
        attempt = take(conn, third, "w1")
        attempts.mark_retrying(
            conn, attempt, attempts.Failure("OSError", "busy"), backoff_seconds=1
        )  # not finished
    assert completion_rows(engine, group) == (0, 0)
    with engine.begin() as conn:
        attempts.mark_succeeded(conn, take(conn, third, "w1"))
    assert completion_rows(engine, group) == (1, 1)
    with engine.connect() as conn:
        state = groups.outcome(conn, group.completion_run_id)
        envelope = conn.execute(
            sa.text("SELECT envelope FROM platform_outbox_messages WHERE run_id = :r"),
            {"r": group.completion_run_id},
        ).scalar_one()
    assert state is not None
    assert state.statuses == {str(first): "succeeded", str(second): "failed", str(third): "succeeded"}
    assert (state.finished, state.total, state.completion_status) == (3, 3, "queued")
    assert not state.all_succeeded
    assert envelope["task"] == "send_welcome" and envelope["run_id"] == str(group.completion_run_id)


def test_a_member_finishing_twice_is_counted_once(app: sessionmaker[Session], engine: sa.Engine) -> None:
    """A failed member requeued (dlq requeue moves it back to queued) and failing again
    must not count twice: a group of 2 would otherwise complete with one member unfinished."""
    group = add_group(app, 2)
    first, _second = member_ids(engine, group)
    for _ in range(2):
        with engine.begin() as conn:
            attempts.mark_failed(
                conn, take(conn, first, "w1"), attempts.Failure("E", "x"), reason="permanent"
            )
        with engine.begin() as conn:
            conn.execute(sa.text("UPDATE task_runs SET status = 'queued' WHERE run_id = :r"), {"r": first})
    assert completion_rows(engine, group) == (0, 0)
    with engine.connect() as conn:
        assert (
            conn.execute(
                sa.text("SELECT remaining FROM task_groups WHERE id = :g"), {"g": group.group_id}
            ).scalar_one()
            == 1
        )


def test_a_final_status_unknown_to_this_code_counts_as_finished(
    app: sessionmaker[Session], engine: sa.Engine
) -> None:
    """Any status outside queued/running/retrying finishes a member (a ``cancelled`` status
    added by another feature, here simulated by widening the CHECK)."""
    group = add_group(app, 1)
    (only,) = member_ids(engine, group)
    with engine.begin() as conn:
        conn.execute(sa.text("ALTER TABLE task_runs DROP CONSTRAINT task_runs_status_check"))
        conn.execute(sa.text("UPDATE task_runs SET status = 'cancelled' WHERE run_id = :r"), {"r": only})
    assert completion_rows(engine, group) == (1, 1)


@pytest.mark.parametrize("round_", range(5))
def test_members_finishing_at_the_same_moment_write_the_completion_once(
    app: sessionmaker[Session], engine: sa.Engine, round_: int
) -> None:
    """Four members finish in four transactions that run their finishing statements at the
    same moment (a barrier) and commit together: the group row lock serialises them, so
    exactly one sees ``remaining = 0``."""
    group = add_group(app, 4)
    members = member_ids(engine, group)
    barrier = threading.Barrier(len(members))
    failures: list[BaseException] = []

    def finish(run_id: uuid.UUID) -> None:
        try:
            with engine.connect() as conn:
                attempt = take(conn, run_id, f"w-{run_id.hex[:4]}")
                conn.commit()
                barrier.wait(timeout=10)
                assert attempts.mark_succeeded(conn, attempt)
                conn.commit()
        except BaseException as exc:  # reported below
            failures.append(exc)

    threads = [threading.Thread(target=finish, args=(m,)) for m in members]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert failures == []
    assert completion_rows(engine, group) == (1, 1)
    with engine.connect() as conn:
        state = groups.get_group(conn, group.group_id)
    assert state is not None and state.all_succeeded and state.finished == 4


def test_a_rolled_back_finish_leaves_the_group_unfinished(
    app: sessionmaker[Session], engine: sa.Engine
) -> None:
    """The finishing transaction of the last member rolls back (the worker died before its
    COMMIT): no completion; the attempt that commits later writes it."""
    group = add_group(app, 1)
    (only,) = member_ids(engine, group)
    with engine.connect() as conn:
        attempt = take(conn, only, "w1")
        conn.commit()
        attempts.mark_succeeded(conn, attempt)
        conn.rollback()
    assert completion_rows(engine, group) == (0, 0)
    with engine.begin() as conn:
        attempts.mark_succeeded(conn, attempt)
    assert completion_rows(engine, group) == (1, 1)


def test_group_refuses_members_that_could_be_counted_twice() -> None:
    with pytest.raises(errors.InvalidDispatch, match="idempotency_key or run_id"):
        Group([Dispatch("audit", idempotency_key="k")], on_complete=Dispatch("send_welcome"))
    with pytest.raises(errors.InvalidDispatch, match="at least one member"):
        Group([], on_complete=Dispatch("send_welcome"))
    twice = Dispatch("audit")
    with pytest.raises(errors.InvalidDispatch, match="appears twice"):
        Group([twice, twice], on_complete=Dispatch("send_welcome"))
    with pytest.raises(errors.InvalidDispatch, match="appears twice"):
        Group([twice], on_complete=twice)
    with pytest.raises(errors.InvalidDispatch, match="no available_at or idempotency_key"):
        Group([Dispatch("audit")], on_complete=Dispatch("send_welcome", idempotency_key="k"))


def test_an_unknown_completion_task_is_refused_at_add(app: sessionmaker[Session]) -> None:
    with app() as session, pytest.raises(errors.UnknownTask):
        session.add(Group([Dispatch("audit")], on_complete=Dispatch("no_such_task")))


def test_a_rolled_back_group_writes_nothing(app: sessionmaker[Session], engine: sa.Engine) -> None:
    with app() as session:
        session.begin()
        session.add(Group([Dispatch("audit")], on_complete=Dispatch("send_welcome")))
        session.flush()
        session.rollback()
    with engine.connect() as conn:
        assert conn.execute(sa.text("SELECT count(*) FROM task_groups")).scalar_one() == 0
        assert conn.execute(sa.text("SELECT count(*) FROM task_runs")).scalar_one() == 0


def test_a_tenant_completion_goes_to_the_tenant_outbox(app: sessionmaker[Session], engine: sa.Engine) -> None:
    with app() as session, session.begin():
        group = Group(
            [Dispatch("charge_card", {"seat": 1}, tenant_id=3)],
            on_complete=Dispatch("charge_card", {"confirm": True}, tenant_id=3),
        )
        session.add(group)
    (only,) = member_ids(engine, group)
    with engine.begin() as conn:
        claim = attempts.take_lease(
            conn,
            run_id=only,
            task="charge_card",
            tenant_id=3,
            worker_id="w",
            lease_seconds=60,
            receive_count=1,
            honour_due_time=False,
        )
        attempts.mark_succeeded(conn, attempts.Attempt(only, claim.attempt, 1, "w"))
    with engine.connect() as conn:
        tenant = conn.execute(
            sa.text("SELECT tenant_id FROM outbox_messages WHERE run_id = :r"), {"r": group.completion_run_id}
        ).scalar_one()
    assert tenant == 3


def test_a_group_added_through_an_async_session(engine: sa.Engine, settings: Any, catalog: Any) -> None:
    import asyncio

    from sqlalchemy.ext.asyncio import async_sessionmaker, create_async_engine

    import sqla_outbox

    async def scenario() -> Group:
        async_engine = create_async_engine(settings.sqlalchemy_url)
        maker = async_sessionmaker(async_engine)
        sqla_outbox.install(maker, settings, catalog=catalog)
        try:
            async with maker() as session, session.begin():
                group = Group([Dispatch("audit"), Dispatch("audit")], on_complete=Dispatch("send_welcome"))
                session.add(group)
            return group
        finally:
            sqla_outbox.uninstall(maker)
            await async_engine.dispose()

    group = asyncio.run(scenario())
    assert len(member_ids(engine, group)) == 2
    with engine.connect() as conn:
        state = groups.get_group(conn, group.group_id)
    assert state is not None and state.total == 2


def test_purge_keeps_groups_until_completed_and_their_completion_ran(
    app: sessionmaker[Session], engine: sa.Engine, settings: Any
) -> None:
    from sqla_outbox import maintenance

    waiting, done = add_group(app, 2), add_group(app, 1)
    (only,) = member_ids(engine, done)
    with engine.begin() as conn:
        attempts.mark_succeeded(conn, take(conn, only, "w1"))
    with engine.begin() as conn:  # all of it long ago
        conn.execute(sa.text("UPDATE task_groups SET created_at = created_at - interval '30 days'"))
        conn.execute(
            sa.text(
                "UPDATE task_groups SET completed_at = clock_timestamp() - interval '30 days' WHERE id = :g"
            ),
            {"g": done.group_id},
        )
    counts = maintenance.purge(engine, settings).by_category()
    assert counts["completed_groups"].deleted == 0  # the completion run is still queued
    with engine.begin() as conn:
        conn.execute(
            sa.text(
                "UPDATE task_runs SET status = 'succeeded', finished_at = clock_timestamp() WHERE run_id = :r"
            ),
            {"r": done.completion_run_id},
        )
    counts = maintenance.purge(engine, settings).by_category()
    assert counts["completed_groups"].deleted == 1
    with engine.connect() as conn:
        left = conn.execute(sa.text("SELECT id FROM task_groups")).scalars().all()
    assert left == [waiting.group_id]  # never completed: kept, however old


def test_groups_complete_under_the_inline_test_runner(app: sessionmaker[Session], engine: sa.Engine) -> None:
    """Users' tests run groups with ``sqla_outbox.testing.run_pending``: the members run in
    round 1, the completion (written by the trigger) in round 2, with the members' statuses."""
    from sqla_outbox import errors as outbox_errors
    from sqla_outbox import testing
    from sqla_outbox.worker import Registry

    registry = Registry()
    seen: list[dict[str, str]] = []

    @registry.task("audit")
    def reserve(payload: Any, ctx: Any) -> None:
        if payload.get("seat") == 1:
            raise outbox_errors.PermanentError("seat 1 is taken")

    @registry.task("send_welcome")
    def confirm(payload: Any, ctx: Any) -> None:
        state = groups.outcome(ctx.session, ctx.run_id)
        assert state is not None
        seen.append(state.statuses)

    group = add_group(app, 3)
    report = testing.run_pending(app, registry=registry)
    completion = report.by_run_id(group.completion_run_id)
    assert (completion.status, completion.round) == ("succeeded", 2)
    (statuses,) = seen
    assert sorted(statuses.values()) == ["failed", "succeeded", "succeeded"]


def test_a_completion_whose_tenant_is_gone_fails_without_blocking_the_member(
    app: sessionmaker[Session], engine: sa.Engine
) -> None:
    with app() as session, session.begin():
        group = Group([Dispatch("audit")], on_complete=Dispatch("charge_card", {}, tenant_id=20))
        session.add(group)
    with engine.begin() as conn:
        conn.execute(sa.text("DELETE FROM tenants WHERE id = 20"))
    (only,) = member_ids(engine, group)
    with engine.begin() as conn:
        assert attempts.mark_succeeded(conn, take(conn, only, "w1"))
    with engine.connect() as conn:
        member = conn.execute(
            sa.text("SELECT status FROM task_runs WHERE run_id = :r"), {"r": only}
        ).scalar_one()
        completion = conn.execute(
            sa.text("SELECT status, last_error FROM task_runs WHERE run_id = :r"),
            {"r": group.completion_run_id},
        ).one()
    assert member == "succeeded"
    assert completion.status == "failed" and "no longer exists" in completion.last_error
    assert completion_rows(engine, group) == (1, 0)


def test_the_completion_reads_members_results_and_a_cancelled_member_counts_as_finished(
    app: sessionmaker[Session], engine: sa.Engine
) -> None:
    """Results (``task_runs.result``, issue 14 part 3) reach the completion's context; a
    member cancelled before it ran finishes it like any final status."""
    from sqla_outbox import Cancel

    group = add_group(app, 2)
    first, second = member_ids(engine, group)
    with engine.begin() as conn:
        attempts.mark_succeeded(conn, take(conn, first, "w1"), result='{"seat": "12A"}')
    with app() as session, session.begin():
        session.add(Cancel(second))
    with engine.connect() as conn:
        state = groups.outcome(conn, group.completion_run_id)
    assert state is not None
    assert state.statuses == {str(first): "succeeded", str(second): "cancelled"}
    assert {str(m.run_id): m.result for m in state.members}[str(first)] == {"seat": "12A"}
    assert completion_rows(engine, group) == (1, 1)
