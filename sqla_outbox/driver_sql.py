"""Running the library's fixed ``text()`` statements as the driver's own SQL.

``Connection.execute(text(...))`` looks the statement up in SQLAlchemy's compiled cache and
builds its parameters through the dialect's bind handling on every call. For the write a
dispatching flush makes (one statement per flush, on the application's own connection)
that is about a quarter of the statement's client-side instructions (measured with
callgrind: 235,000 against 166,000 per statement; ``docs/benchmarks.md``, issue 17 part 4,
fourth pass). :func:`execute` compiles each statement once per dialect and runs it with
``Connection.exec_driver_sql``, which keeps what matters to the application: the same
connection and transaction, the engine's events (``before_cursor_execute``, so query
logging and tracing still see the statement), ``echo`` logging, and SQLAlchemy's error
translation (a foreign-key violation is still ``sqlalchemy.exc.IntegrityError``).

It does so only where the two are exactly equivalent, and otherwise runs
``Connection.execute`` as before:

* the dialect takes named parameters in a dict (paramstyle ``pyformat`` or ``named``:
  psycopg 3, psycopg2, pg8000), so the parameters pass through unchanged;
* no bind parameter of the statement has a bind processor on that dialect (psycopg 3
  adapts ``uuid.UUID``, ``int``, ``str`` and ``datetime`` itself; psycopg2's ``UUID`` type
  converts to ``str`` in a processor, so psycopg2 keeps the ordinary path);
* the compiled statement has no expanding or literal-rendered parameters and no escaped
  parameter names (none of the library's statements do; the check keeps it so).

asyncpg's paramstyle is positional (``$1``), so asyncpg sessions always take the ordinary
path.
"""

from __future__ import annotations

import weakref
from typing import Any

from sqlalchemy.engine import Connection, CursorResult, Dialect
from sqlalchemy.sql.elements import TextClause

_DICT_PARAMSTYLES = frozenset({"pyformat", "named"})

_compiled: weakref.WeakKeyDictionary[Dialect, dict[TextClause, str | None]] = weakref.WeakKeyDictionary()
"""Per dialect: each statement's driver SQL, or None where the ordinary path must serve."""


def driver_sql(statement: TextClause, dialect: Dialect) -> str | None:
    """The SQL the driver receives for ``statement`` on ``dialect``, when running it with
    ``exec_driver_sql`` and the parameters unchanged is exactly equivalent; else None.

    Compiled once per (dialect, statement) and kept while the dialect (its engine) lives.
    """
    per_dialect = _compiled.get(dialect)
    if per_dialect is None:
        per_dialect = _compiled[dialect] = {}
    try:
        return per_dialect[statement]
    except KeyError:
        pass
    sql: str | None = None
    if dialect.paramstyle in _DICT_PARAMSTYLES:
        compiled = statement.compile(dialect=dialect)
        plain_binds = not any(
            bind.type.dialect_impl(dialect).bind_processor(dialect) is not None
            for bind in compiled.binds.values()
        )
        if (
            plain_binds
            and not compiled.literal_execute_params
            and not compiled.post_compile_params
            and not compiled.escaped_bind_names
            and compiled.positiontup is None
        ):
            sql = compiled.string
    per_dialect[statement] = sql
    return sql


def execute(
    connection: Connection, statement: TextClause, parameters: dict[str, Any]
) -> CursorResult[*tuple[Any, ...]]:
    """Run ``statement`` with ``parameters`` (one row of named values) on ``connection``.

    The result is what ``connection.execute(statement, parameters)`` returns: rows by
    position and by column name, and ``rowcount``.

    Raises:
        sqlalchemy.exc.DBAPIError: From the database, as ``Connection.execute`` raises it.
    """
    sql = driver_sql(statement, connection.dialect)
    if sql is None:
        return connection.execute(statement, parameters)
    return connection.exec_driver_sql(sql, parameters)
