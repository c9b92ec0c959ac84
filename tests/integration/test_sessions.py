"""Every way an application holds a session: savepoints, async, scoped, joined, bulk paths."""

from __future__ import annotations

import asyncio
import itertools
import time

import pytest
import redis
import sqlalchemy as sa
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column, scoped_session, sessionmaker

import sqla_outbox
from sqla_outbox import Dispatch, Publish, errors
from sqla_outbox.catalog import Catalog
from sqla_outbox.config import OutboxSettings
from sqla_outbox.models import TaskRun
from tests.support import black_hole, count, drain_wakes, outbox_rows


class AppBase(DeclarativeBase):
    pass


class Tenant(AppBase):
    __tablename__ = "tenants"
    id: Mapped[int] = mapped_column(primary_key=True)
    name: Mapped[str | None]


def wakes(valkey: redis.Redis, settings: OutboxSettings) -> int:
    drain_wakes()  # wakes go out on the waker's thread, just after the commit
    return int(valkey.llen(settings.wake_key))


# --- installation -----------------------------------------------------------------------
def test_session_without_listeners_refuses_instead_of_dropping(engine: sa.Engine) -> None:
    with Session(engine) as session:
        session.add(Dispatch("audit", {}))
        with pytest.raises(errors.NotInstalled, match=r"sqla_outbox\.install"):
            session.commit()
    assert count(engine, "task_runs") == 0


def test_bulk_save_objects_is_refused(factory: sessionmaker[Session], engine: sa.Engine) -> None:
    with factory() as session:
        with pytest.raises((errors.NotInstalled, sa.exc.StatementError)) as caught:
            session.bulk_save_objects([Dispatch("audit", {})])
        assert "bypass flush events" in str(caught.value)
        session.rollback()
    assert count(engine, "task_runs") == 0


def test_installing_twice_writes_rows_once(
    factory: sessionmaker[Session],
    engine: sa.Engine,
    settings: OutboxSettings,
    catalog: Catalog,
    valkey: redis.Redis,
) -> None:
    again = sqla_outbox.install(factory, settings, catalog=catalog)
    assert again is sqla_outbox.installation_for(factory)
    with factory() as session, session.begin():
        session.add(Dispatch("audit", {}))
    assert count(engine, "task_runs") == 1
    assert wakes(valkey, settings) == 1


def test_overlapping_installs_write_rows_once(
    engine: sa.Engine, settings: OutboxSettings, catalog: Catalog, valkey: redis.Redis
) -> None:
    class AppSession(Session):
        pass

    maker = sessionmaker(engine, class_=AppSession)
    sqla_outbox.install(AppSession, settings, catalog=catalog)
    sqla_outbox.install(maker, settings, catalog=catalog)
    try:
        with maker() as session, session.begin():
            session.add(Dispatch("audit", {}))
            session.add(Publish("user.created", {}))
        assert count(engine, "task_runs") == 3
        assert wakes(valkey, settings) == 1
    finally:
        sqla_outbox.uninstall(maker)
        sqla_outbox.uninstall(AppSession)


def test_install_on_a_single_session_instance(
    engine: sa.Engine, settings: OutboxSettings, catalog: Catalog
) -> None:
    session = Session(engine)
    sqla_outbox.install(session, settings, catalog=catalog)
    with session.begin():
        session.add(Dispatch("audit", {}))
    session.close()
    assert count(engine, "task_runs") == 1


def test_install_refuses_things_that_are_not_sessions(settings: OutboxSettings, catalog: Catalog) -> None:
    with pytest.raises(errors.ConfigurationError, match="cannot install"):
        sqla_outbox.install(object(), settings, catalog=catalog)


# --- session life cycle -------------------------------------------------------------------
def test_savepoint_rollback_takes_its_dispatches_and_release_keeps_them(
    factory: sessionmaker[Session], engine: sa.Engine
) -> None:
    with factory() as session, session.begin():
        session.add(Dispatch("audit", {"where": "outer"}))
        with session.begin_nested():
            session.add(Dispatch("audit", {"where": "kept"}))
        savepoint = session.begin_nested()
        session.add(Dispatch("audit", {"where": "dropped"}))
        session.flush()
        savepoint.rollback()
    payloads = sorted(r.envelope["payload"] for r in outbox_rows(engine))
    assert payloads == ['{"where":"kept"}', '{"where":"outer"}']
    assert count(engine, "task_runs") == 2


def test_only_rolled_back_savepoint_rows_means_no_wake(
    factory: sessionmaker[Session], valkey: redis.Redis, settings: OutboxSettings
) -> None:
    with factory() as session, session.begin():
        savepoint = session.begin_nested()
        session.add(Dispatch("audit", {}))
        session.flush()
        savepoint.rollback()
    assert wakes(valkey, settings) == 0
    with factory() as session, session.begin():
        with session.begin_nested():
            with session.begin_nested():
                session.add(Dispatch("audit", {}))
    assert wakes(valkey, settings) == 1


def test_several_flushes_and_autoflush_before_commit(
    factory: sessionmaker[Session], engine: sa.Engine, valkey: redis.Redis, settings: OutboxSettings
) -> None:
    with factory() as session, session.begin():
        session.add(Dispatch("audit", {"n": 1}))
        session.flush()
        session.add(Dispatch("audit", {"n": 2}))
        # autoflush: an ORM query sees the row the pending Dispatch becomes (SQLAlchemy
        # 2.0.30 runs a plain text() query without autoflush; 2.1 flushes first)
        assert session.scalar(sa.select(sa.func.count()).select_from(TaskRun)) == 2
        session.add(Dispatch("audit", {"n": 3}))
    assert count(engine, "task_runs") == 3
    assert wakes(valkey, settings) == 1


def test_new_tenant_and_its_dispatch_in_the_same_flush(
    factory: sessionmaker[Session], engine: sa.Engine
) -> None:
    with factory() as session, session.begin():
        session.add(Dispatch("charge_card", {"amount": 5}, tenant_id=777))
        session.add(Tenant(id=777, name="new"))  # INSERTed by the same flush, before the row
    [row] = outbox_rows(engine)
    assert row.tenant_id == 777


def test_dispatch_beside_dirty_objects(factory: sessionmaker[Session], engine: sa.Engine) -> None:
    with factory() as session, session.begin():
        tenant = session.get(Tenant, 1)
        assert tenant is not None
        tenant.name = "renamed"
        session.add(Dispatch("charge_card", {}, tenant_id=1))
    with factory() as session:
        tenant_name = session.get(Tenant, 1).name  # type: ignore[union-attr]
    assert tenant_name == "renamed"
    assert count(engine, "outbox_messages") == 1


def test_expunged_before_flush_writes_nothing(factory: sessionmaker[Session], engine: sa.Engine) -> None:
    with factory() as session, session.begin():
        item = Dispatch("audit", {})
        session.add(item)
        session.expunge(item)
    assert count(engine, "task_runs") == 0
    assert item.resolved_run_id is None


@pytest.mark.parametrize("expire_on_commit", [True, False])
def test_expire_on_commit_either_way(
    engine: sa.Engine, settings: OutboxSettings, catalog: Catalog, expire_on_commit: bool
) -> None:
    maker = sessionmaker(engine, expire_on_commit=expire_on_commit)
    sqla_outbox.install(maker, settings, catalog=catalog)
    try:
        with maker() as session:
            item = Dispatch("audit", {"x": 1})
            session.add(item)
            session.commit()
            assert item.resolved_run_id == item.run_id  # plain attributes survive commit
            assert item not in session
        assert count(engine, "task_runs") == 1
    finally:
        sqla_outbox.uninstall(maker)


def test_readding_after_rollback_writes_once(factory: sessionmaker[Session], engine: sa.Engine) -> None:
    item = Dispatch("audit", {})
    with factory() as session:
        session.add(item)
        session.flush()
        session.rollback()
        session.add(item)
        session.commit()
    assert count(engine, "task_runs") == 1


def test_scoped_session(engine: sa.Engine, settings: OutboxSettings, catalog: Catalog) -> None:
    registry = scoped_session(sessionmaker(engine))
    sqla_outbox.install(registry, settings, catalog=catalog)
    try:
        registry.add(Dispatch("audit", {}))
        registry.commit()
        registry.remove()
        assert count(engine, "task_runs") == 1
    finally:
        sqla_outbox.uninstall(registry)


def test_a_dispatch_added_before_the_listeners_is_checked_and_written_at_flush(
    engine: sa.Engine, settings: OutboxSettings, catalog: Catalog
) -> None:
    """No before_attach saw it (nothing was installed yet): the flush checks it against the
    catalog then, and writes it; an unknown task is refused there, writing nothing."""
    session = Session(engine)
    early = Dispatch("audit", {"early": True})
    session.add(early)
    sqla_outbox.install(session, settings, catalog=catalog)
    session.commit()
    session.close()
    assert early.resolved_run_id == early.run_id
    assert [row.envelope["task"] for row in outbox_rows(engine)] == ["audit"]

    other = Session(engine)
    other.add(Dispatch("no_such_task"))
    sqla_outbox.install(other, settings, catalog=catalog)
    with pytest.raises(errors.UnknownTask):
        other.commit()
    other.close()
    assert count(engine, "task_runs") == 1


def test_session_joined_to_an_outer_transaction(
    engine: sa.Engine, settings: OutboxSettings, catalog: Catalog
) -> None:
    """The usual test-fixture pattern: the outer transaction decides."""
    with engine.connect() as connection:
        outer = connection.begin()
        session = Session(bind=connection, join_transaction_mode="create_savepoint")
        sqla_outbox.install(session, settings, catalog=catalog)
        session.add(Dispatch("audit", {}))
        session.commit()  # releases the session's savepoint only
        inside = connection.execute(sa.text("SELECT count(*) FROM task_runs")).scalar_one()
        session.close()
        outer.rollback()
    assert inside == 1
    assert count(engine, "task_runs") == 0


# --- asyncio ------------------------------------------------------------------------------
def test_async_session_dispatch_commit_and_wake(
    database_url: str, settings: OutboxSettings, catalog: Catalog, valkey: redis.Redis
) -> None:
    from sqlalchemy.ext.asyncio import async_sessionmaker, create_async_engine

    async def scenario() -> None:
        async_engine = create_async_engine(database_url)
        maker = async_sessionmaker(async_engine)
        sqla_outbox.install(maker, settings, catalog=catalog)
        try:
            async with maker() as session, session.begin():
                session.add(Dispatch("audit", {"async": True}))
                session.add(Publish("user.created", {}))
            async with maker() as session:
                session.add(Dispatch("audit", {"rolled": "back"}))
                await session.flush()
                await session.rollback()
        finally:
            sqla_outbox.uninstall(maker)
            await async_engine.dispose()

    asyncio.run(scenario())
    engine = sa.create_engine(database_url)
    assert count(engine, "task_runs") == 3
    engine.dispose()
    assert wakes(valkey, settings) == 1


def test_async_commit_does_not_block_the_event_loop_on_a_hung_valkey(
    database_url: str, settings: OutboxSettings, catalog: Catalog
) -> None:
    from sqlalchemy.ext.asyncio import AsyncSession, create_async_engine

    async def scenario(url: str) -> tuple[float, float, int]:
        async_engine = create_async_engine(database_url)
        session = AsyncSession(async_engine)
        installation = sqla_outbox.install(
            session, settings.replace(valkey_url=url, wake_timeout_ms=2000), catalog=catalog
        )
        ticks: list[float] = []
        stop = asyncio.Event()

        async def ticker() -> None:
            while not stop.is_set():
                ticks.append(time.monotonic())
                await asyncio.sleep(0.005)

        task = asyncio.create_task(ticker())
        await asyncio.sleep(0.02)
        started = time.monotonic()
        session.add(Dispatch("audit", {}))
        await session.commit()
        elapsed = time.monotonic() - started
        await asyncio.sleep(0.5)  # the hung LPUSH runs its course on the waker's thread meanwhile
        stop.set()
        await task
        await session.close()
        installation.waker.drain(5)
        failed = installation.waker.stats.failed
        installation.detach()
        await async_engine.dispose()
        gaps = [b - a for a, b in itertools.pairwise(ticks)]
        return elapsed, max(gaps), failed

    with black_hole() as url:
        elapsed, worst_gap, failed = asyncio.run(scenario(url))
    # bounds far below the 2 s wake timeout, far above scheduling noise on a busy machine
    assert elapsed < 1.0  # the commit did not wait for the hung Valkey ...
    assert worst_gap < 0.5  # ... nor did anything else on the loop
    assert failed == 1  # the wake itself timed out, on its own thread
