"""Every public function that takes a session, with every kind of session (issue 11, item 8).

Kinds: a ``Session`` from an installed ``sessionmaker``, a ``scoped_session``, a session
bound to a connection (``Session(bind=op.get_bind())`` in an Alembic migration), an
``AsyncSession`` and an ``async_scoped_session``. Functions: ``session.add(Dispatch)``,
``sqla_outbox.dispatch``/``publish`` and their ``_async`` variants, and the reading helpers
of ``sqla_outbox.testing`` (free and bound to an ``Outbox``). Each works with the kind, or
refuses it with a clear error before touching the session.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy import event
from sqlalchemy.ext.asyncio import async_scoped_session, async_sessionmaker, create_async_engine
from sqlalchemy.orm import Session, scoped_session, sessionmaker

import sqla_outbox
from sqla_outbox import Dispatch, errors, testing
from sqla_outbox.catalog import Catalog
from sqla_outbox.config import OutboxSettings
from tests.support import count, runs

SYNC = ["session", "scoped", "connection"]
ASYNC = ["async", "async_scoped"]


@pytest.fixture
def open_session(
    engine: sa.Engine,
    app: sessionmaker[Session],
    settings: OutboxSettings,
    catalog: Catalog,
    database_url: str,
) -> Iterator[Callable[[str, Callable[[Any], Any]], Any]]:
    """``open_session(kind, work)``: run ``work(session)`` (awaited for asyncio kinds) in a
    transaction of a session of that kind, then commit; return what ``work`` returned."""
    async_engine = create_async_engine(database_url)
    async_maker = async_sessionmaker(async_engine)
    sqla_outbox.install(async_maker, settings, catalog=catalog)

    def run(kind: str, work: Callable[[Any], Any]) -> Any:
        if kind == "session":
            with app() as session, session.begin():
                return work(session)
        if kind == "scoped":
            scoped = scoped_session(app)
            try:
                with scoped.begin():
                    return work(scoped)
            finally:
                scoped.remove()
        if kind == "connection":
            with engine.connect() as connection, connection.begin():
                session = Session(bind=connection)
                sqla_outbox.install(session, settings, catalog=catalog)
                result = work(session)
                session.commit()
                return result

        async def scenario() -> Any:
            holder: Any = (
                async_maker() if kind == "async" else async_scoped_session(async_maker, asyncio.current_task)
            )
            session = holder
            try:
                async with session.begin():
                    value = work(session)
                    return await value if isinstance(value, Awaitable) else value
            finally:
                await (holder.close() if kind == "async" else holder.remove())

        return asyncio.run(scenario())

    yield run
    asyncio.run(async_engine.dispose())
    sqla_outbox.uninstall(async_maker)


@pytest.mark.parametrize("kind", SYNC + ASYNC)
def test_session_add_of_a_dispatch_writes_its_rows_with_the_commit(
    open_session: Any, engine: sa.Engine, kind: str
) -> None:
    item = Dispatch("audit", {"kind": kind})
    open_session(kind, lambda session: session.add(item))
    assert [run.run_id for run in runs(engine)] == [item.run_id]


@pytest.mark.parametrize("kind", SYNC)
def test_the_dispatch_and_publish_helpers_take_sync_sessions(
    open_session: Any, engine: sa.Engine, kind: str
) -> None:
    def work(session: Any) -> tuple[uuid.UUID, dict[str, uuid.UUID]]:
        return sqla_outbox.dispatch(session, "audit", {"n": 1}), sqla_outbox.publish(session, "user.created")

    run_id, fanned = open_session(kind, work)
    assert {run.run_id for run in runs(engine)} == {run_id, *fanned.values()}
    assert set(fanned) == {"send_welcome", "index_user"}
    with pytest.raises(TypeError, match=r"dispatch_async\(\) takes an AsyncSession"):
        open_session(kind, lambda session: asyncio.run(sqla_outbox.dispatch_async(session, "audit")))


@pytest.mark.parametrize("kind", ASYNC)
def test_the_sync_helpers_refuse_an_asyncio_session_before_touching_it(
    open_session: Any, engine: sa.Engine, kind: str
) -> None:
    """The issue's input: ``sqla_outbox.dispatch(async_session, ...)`` warned "coroutine
    'AsyncSession.flush' was never awaited", raised a bare AssertionError, and left the
    Dispatch in the session, so the commit scheduled it anyway."""

    def work(session: Any) -> list[str]:
        refusals = []
        for helper, name in ((sqla_outbox.dispatch, "audit"), (sqla_outbox.publish, "user.created")):
            with pytest.raises(TypeError) as refused:
                helper(session, name, {"n": 1}, tenant_id=2)
            refusals.append(str(refused.value))
        assert list(session.new) == []
        return refusals

    refusals = open_session(kind, work)
    assert "use `await sqla_outbox.dispatch_async(session, ...)`" in refusals[0]
    assert "use `await sqla_outbox.publish_async(session, ...)`" in refusals[1]
    assert count(engine, "task_runs") == 0  # nothing was scheduled by the commit


@pytest.mark.parametrize("kind", ASYNC)
def test_the_async_helpers_take_asyncio_sessions(open_session: Any, engine: sa.Engine, kind: str) -> None:
    async def work(session: Any) -> tuple[uuid.UUID, uuid.UUID, dict[str, uuid.UUID]]:
        first = await sqla_outbox.dispatch_async(session, "audit", {"n": 1}, idempotency_key="k")
        again = await sqla_outbox.dispatch_async(session, "audit", {"n": 2}, idempotency_key="k")
        return first, again, await sqla_outbox.publish_async(session, "user.created")

    first, again, fanned = open_session(kind, work)
    assert first == again  # the key resolved to the first run at flush
    assert {run.run_id for run in runs(engine)} == {first, *fanned.values()}


@pytest.mark.parametrize("kind", SYNC)
def test_the_reading_helpers_see_the_sessions_own_transaction(
    open_session: Any, app: sessionmaker[Session], kind: str
) -> None:
    outbox = testing.Outbox(app)

    def work(session: Any) -> None:
        session.add(Dispatch("audit", {"n": 1}))
        session.add(sqla_outbox.Publish("user.created", {}))
        assert len(testing.assert_dispatched(session, "audit")) == 1
        testing.assert_not_dispatched(session, "charge_card")
        testing.assert_published(session, "user.created", subscribers=["send_welcome", "index_user"])
        assert [run.task for run in outbox.dispatched(task="audit", session=session)] == ["audit"]

    open_session(kind, work)


@pytest.mark.parametrize("kind", ASYNC)
def test_the_reading_helpers_refuse_an_asyncio_session_and_say_how(
    open_session: Any, app: sessionmaker[Session], kind: str
) -> None:
    async def work(session: Any) -> None:
        session.add(Dispatch("audit", {"n": 1}))
        with pytest.raises(errors.ConfigurationError, match=r"await session.run_sync\(testing.dispatched"):
            testing.dispatched(session, task="audit")
        with pytest.raises(errors.ConfigurationError, match="run_sync"):
            testing.Outbox(app).assert_dispatched("audit", session=session)
        target = session() if isinstance(session, async_scoped_session) else session
        runs = await target.run_sync(testing.assert_dispatched, "audit")
        assert len(runs) == 1

    open_session(kind, work)


@pytest.mark.parametrize("registered", ["before install", "after install"])
def test_a_dispatch_added_by_the_applications_before_flush_listener_is_written(
    engine: sa.Engine, settings: OutboxSettings, catalog: Catalog, registered: str
) -> None:
    """The audit pattern: the application's own before_flush listener adds a Dispatch for
    each new object. The commit failed with NotInstalled ("listeners not installed"), which
    was false, and lost the business transaction."""
    maker = sessionmaker(engine)
    audited: list[Dispatch] = []

    def audit(session: Session, flush_context: Any, instances: Any) -> None:
        for obj in list(session.new):
            if not isinstance(obj, Dispatch):
                item = Dispatch("audit", {"table": type(obj).__table__.name})
                audited.append(item)
                session.add(item)

    if registered == "before install":
        event.listen(maker, "before_flush", audit)
    sqla_outbox.install(maker, settings, catalog=catalog)
    if registered == "after install":
        event.listen(maker, "before_flush", audit)
    tenants = sa.Table("tenants", sa.MetaData(), autoload_with=engine)

    class Tenant:
        pass

    registry = sa.orm.registry()
    registry.map_imperatively(Tenant, tenants)
    try:
        with maker() as session, session.begin():
            tenant = Tenant()
            tenant.id, tenant.name = 900, "new tenant"  # type: ignore[attr-defined]
            session.add(tenant)
            session.add(Dispatch("send_welcome", {"tenant": 900}))
        with engine.connect() as conn:
            assert conn.execute(sa.text("SELECT count(*) FROM tenants WHERE id = 900")).scalar_one() == 1
        assert {run.task for run in runs(engine)} == {"audit", "send_welcome"}
        assert [run.run_id for run in runs(engine) if run.task == "audit"] == [a.run_id for a in audited]
    finally:
        registry.dispose()
        sqla_outbox.uninstall(maker)
