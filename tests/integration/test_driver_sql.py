"""The dispatch write as driver SQL: used where it is exactly equivalent, and only there.

On psycopg 3 the flush's statement runs through ``Connection.exec_driver_sql`` (compiled
once per dialect); the engine's events and SQLAlchemy's error translation still apply.
Dialects where the parameters would need conversion (asyncpg's positional ``$1``, a type
with a bind processor, an expanding parameter) keep ``Connection.execute``.
"""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.ext.asyncio import async_sessionmaker, create_async_engine
from sqlalchemy.orm import Session, sessionmaker

import sqla_outbox
from sqla_outbox import Dispatch, driver_sql, write
from sqla_outbox.catalog import Catalog
from sqla_outbox.config import OutboxSettings
from tests.support import count, outbox_rows, runs


def executed(engine: sa.Engine, work: Any) -> list[tuple[str, Any]]:
    """``(statement, compiled)`` of every cursor execution ``work()`` caused."""
    seen: list[tuple[str, Any]] = []

    def record(conn: Any, cursor: Any, statement: str, parameters: Any, context: Any, many: bool) -> None:
        seen.append((statement, context.compiled))

    sa.event.listen(engine, "before_cursor_execute", record)
    try:
        work()
    finally:
        sa.event.remove(engine, "before_cursor_execute", record)
    return seen


@pytest.mark.parametrize("size", [1, 3])
def test_on_psycopg_the_write_is_driver_sql_and_the_engines_events_see_it(
    factory: sessionmaker[Session], engine: sa.Engine, size: int
) -> None:
    def work() -> None:
        with factory() as session, session.begin():
            session.add_all([Dispatch("send_welcome", {"n": n}, tenant_id=3) for n in range(size)])

    seen = executed(engine, work)
    [(statement, compiled)] = [s for s in seen if "INSERT INTO task_runs" in s[0]]
    assert compiled is None  # exec_driver_sql: no SQLAlchemy compilation per call
    assert statement == driver_sql.driver_sql(
        write._INSERT_ONE["outbox_messages", False, True] if size == 1 else write._INSERT[False],
        engine.dialect,
    )
    assert count(engine, "task_runs") == size
    assert [row.envelope["payload"] for row in outbox_rows(engine)] == [f'{{"n":{n}}}' for n in range(size)]


def test_a_database_error_on_the_driver_path_is_still_sqlalchemys(
    factory: sessionmaker[Session], engine: sa.Engine
) -> None:
    with pytest.raises(sa.exc.IntegrityError, match="outbox_messages_tenant_id_fkey") as raised:
        with factory() as session, session.begin():
            session.add(Dispatch("audit", tenant_id=999_999))
    assert raised.value.statement is not None and "INSERT INTO task_runs" in raised.value.statement
    assert count(engine, "task_runs") == 0


def test_an_asyncpg_session_takes_the_ordinary_path_and_writes_the_same_rows(
    engine: sa.Engine, settings: OutboxSettings, catalog: Catalog
) -> None:
    """asyncpg binds ``$1``-style positional parameters: no driver SQL; every write path
    (one run, several, an idempotency key's second statement) still works on it."""
    url = sa.make_url(settings.sqlalchemy_url).set(drivername="postgresql+asyncpg")
    chosen = uuid.uuid4()

    async def scenario() -> tuple[Dispatch, Dispatch, Dispatch]:
        async_engine = create_async_engine(url)
        maker = async_sessionmaker(async_engine)
        sqla_outbox.install(maker, settings, catalog=catalog)
        try:
            assert (
                driver_sql.driver_sql(write._INSERT_ONE["outbox_messages", False, True], async_engine.dialect)
                is None
            )
            async with maker() as session, session.begin():
                session.add(Dispatch("send_welcome", {"one": 1}, tenant_id=3))
            async with maker() as session, session.begin():
                session.add_all([Dispatch("audit", {"n": n}) for n in range(3)])
            first = Dispatch("send_welcome", {"k": 1}, tenant_id=3, idempotency_key="once", run_id=chosen)
            again = Dispatch("send_welcome", {"k": 2}, tenant_id=3, idempotency_key="once")
            async with maker() as session, session.begin():
                session.add(first)
            async with maker() as session, session.begin():
                session.add(again)
            return first, again, Dispatch("audit")
        finally:
            sqla_outbox.uninstall(maker)
            await async_engine.dispose()

    first, again, _ = asyncio.run(scenario())
    assert first.resolved_run_id == chosen and first.deduplicated is False
    assert again.resolved_run_id == chosen and again.deduplicated is True
    assert count(engine, "task_runs") == 5
    assert count(engine, "outbox_messages") == 2 and count(engine, "platform_outbox_messages") == 3
    assert {run.task for run in runs(engine)} == {"send_welcome", "audit"}


class _Upper(sa.types.TypeDecorator[str]):
    impl = sa.Text
    cache_ok = True

    def process_bind_param(self, value: str | None, dialect: Any) -> str | None:
        return None if value is None else value.upper()


@pytest.mark.parametrize("on", ["engine", "connection"])
@pytest.mark.parametrize("event_name", ["before_execute", "after_execute"])
def test_with_an_execute_listener_the_write_takes_the_ordinary_path(
    factory: sessionmaker[Session], engine: sa.Engine, on: str, event_name: str
) -> None:
    """SQLAlchemy fires ``before_execute``/``after_execute`` only for ``Connection.execute``:
    an application that guards or counts statements with them must still see the write,
    whether it listens on the engine or on the one connection its session is bound to."""
    seen: list[str] = []

    def listener(conn: Any, clauseelement: Any, *args: Any) -> None:
        seen.append(str(clauseelement))

    def work() -> None:
        with engine.connect() as connection:
            target = engine if on == "engine" else connection
            sa.event.listen(target, event_name, listener)
            try:
                with factory(bind=connection) as session, session.begin():
                    session.add(Dispatch("send_welcome", {"n": 1}, tenant_id=3))
            finally:
                sa.event.remove(target, event_name, listener)

    cursor_level = executed(engine, work)
    assert [s for s in seen if "INSERT INTO task_runs" in s]
    [(_, compiled)] = [s for s in cursor_level if "INSERT INTO task_runs" in s[0]]
    assert compiled is not None
    assert count(engine, "task_runs") == 1


@pytest.mark.parametrize(
    ("statement", "parameters", "expected"),
    [
        pytest.param(
            sa.text("SELECT :v").bindparams(sa.bindparam("v", type_=_Upper())),
            {"v": "a"},
            [("A",)],
            id="a bind processor",
        ),
        pytest.param(
            sa.text("SELECT 1 WHERE 'b' IN :v").bindparams(sa.bindparam("v", expanding=True)),
            {"v": ["a", "b"]},
            [(1,)],
            id="an expanding parameter",
        ),
        pytest.param(
            sa.text("SELECT CAST(:v AS text), CAST(:w AS text)").bindparams(sa.bindparam("w", value="own")),
            {"v": "given"},
            [("given", "own")],
            id="a value of its own",
        ),
    ],
)
def test_statements_whose_parameters_need_sqlalchemy_keep_the_ordinary_path(
    engine: sa.Engine, statement: Any, parameters: dict[str, Any], expected: list[tuple[Any, ...]]
) -> None:
    assert driver_sql.driver_sql(statement, engine.dialect) is None
    with engine.connect() as conn:
        assert driver_sql.execute(conn, statement, parameters).all() == expected


def test_each_dialect_keeps_its_own_answer_when_engines_alternate(engine: sa.Engine) -> None:
    """The last dialect is remembered for speed; asking for another one in between (an
    application with a psycopg and an asyncpg engine) never hands out the other's SQL."""
    from sqlalchemy.dialects.postgresql import asyncpg, psycopg

    statement = write._INSERT_ONE["outbox_messages", False, True]
    other_psycopg = psycopg.dialect()
    answers = [
        driver_sql.driver_sql(statement, dialect)
        for dialect in (engine.dialect, asyncpg.dialect(), engine.dialect, other_psycopg, engine.dialect)
    ]
    assert answers[0] is not None and "%(run_id)s" in answers[0]
    assert answers[1] is None  # positional $1 parameters: the ordinary path
    assert answers[2] == answers[3] == answers[4] == answers[0]
    assert driver_sql._compiled[other_psycopg] is not driver_sql._compiled[engine.dialect]
