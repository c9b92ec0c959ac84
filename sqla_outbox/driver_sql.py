"""Running the library's fixed ``text()`` statements as the driver's own SQL.

``Connection.execute(text(...))`` looks the statement up in SQLAlchemy's compiled cache and
builds its parameters through the dialect's bind handling on every call. For the write a
dispatching flush makes (one statement per flush, on the application's own connection)
that is about a quarter of the statement's client-side instructions (measured with
callgrind: 235,000 against 166,000 per statement; ADR 0017, item 9;
``docs/benchmarks.md``). :func:`execute` compiles each statement once per dialect and runs it with
``Connection.exec_driver_sql``, which keeps the same connection and transaction, the
cursor-level events (``before_cursor_execute``, ``after_cursor_execute``, ``handle_error``),
``echo`` logging, and SQLAlchemy's error translation (a foreign-key violation is still
``sqlalchemy.exc.IntegrityError`` with the statement attached).

It does so only where the two are equivalent, and otherwise runs ``Connection.execute``:

* the connection has no ``before_execute`` or ``after_execute`` listener (SQLAlchemy does
  not fire those two for ``exec_driver_sql``; an application that guards or counts
  statements with them keeps seeing the write);
* the dialect takes named parameters in a dict (paramstyle ``pyformat`` or ``named``), so
  the parameters pass through unchanged: psycopg 3 and psycopg2 (whose ``UUID`` is adapted
  natively: SQLAlchemy registers the adapter, so no bind processor is involved); asyncpg
  (``$1``) and pg8000 (``format``) always take ``Connection.execute``;
* no bind parameter of the statement has a bind processor on that dialect, a value or
  callable of its own, or is expanding, literal-rendered or post-compiled, and no name
  needed escaping (each would need SQLAlchemy's parameter handling). In ``write.py`` that
  leaves the single-run and multi-run INSERTs (``ARRAY`` parameters, as in the webhook
  variant and the follow-up lookups, have processors).

What a listener can tell apart: ``context.compiled`` is None in ``before_cursor_execute``
and ``handle_error`` (as for any ``exec_driver_sql`` call), and ``echo`` labels the
parameters ``[raw sql]`` instead of ``[cached since ...]``.
"""

from __future__ import annotations

import weakref
from typing import Any

from sqlalchemy.engine import Connection, CursorResult, Dialect
from sqlalchemy.sql.elements import TextClause

_DICT_PARAMSTYLES = frozenset({"pyformat", "named"})

_compiled: weakref.WeakKeyDictionary[Dialect, dict[TextClause, str | None]] = weakref.WeakKeyDictionary()
"""Per dialect: each statement's driver SQL, or None where the ordinary path must serve."""

_last: tuple[weakref.ref[Any], dict[TextClause, str | None]] = (weakref.ref(_compiled), {})
"""The last dialect asked for and its entry in :data:`_compiled` (an application has one
engine, as a rule); the placeholder's referent is never a dialect."""


def driver_sql(statement: TextClause, dialect: Dialect) -> str | None:
    """The SQL the driver receives for ``statement`` on ``dialect``, when running it with
    ``exec_driver_sql`` and the parameters unchanged is exactly equivalent; else None.

    Compiled once per (dialect, statement) and kept while the dialect (its engine) lives.
    """
    global _last
    last_dialect, per_dialect = _last
    if last_dialect() is not dialect:  # a WeakKeyDictionary lookup makes a weakref each time
        per_dialect = _compiled.setdefault(dialect, {})
        _last = (weakref.ref(dialect), per_dialect)
    try:
        return per_dialect[statement]
    except KeyError:
        pass
    sql: str | None = None
    if dialect.paramstyle in _DICT_PARAMSTYLES:
        compiled = statement.compile(dialect=dialect)
        plain_binds = not any(
            bind.type.dialect_impl(dialect).bind_processor(dialect) is not None
            or bind.value is not None
            or bind.callable is not None
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

    ``parameters`` must name every bind parameter of the statement (on the driver path a
    missing one is the driver's error, ``sqlalchemy.exc.ProgrammingError``, where
    ``Connection.execute`` raises ``StatementError``).

    Returns:
        What ``connection.execute(statement, parameters)`` returns: rows by position and by
        column name, and ``rowcount``.

    Raises:
        sqlalchemy.exc.DBAPIError: From the database, as ``Connection.execute`` raises it.
    """
    sql = None if _execute_listeners(connection) else driver_sql(statement, connection.dialect)
    if sql is None:
        return connection.execute(statement, parameters)
    return connection.exec_driver_sql(sql, parameters)


def _execute_listeners(connection: Connection) -> bool:
    """Whether a ``before_execute`` or ``after_execute`` listener would fire on ``connection``.

    Asked the way SQLAlchemy asks before it fires a connection event (``_has_events`` of the
    connection or its engine): the connection's own dispatch is made per connection, and
    looking into it costs more than the statement saves, so it is read only when some
    listener exists.
    """
    if not (connection._has_events or connection.engine._has_events):
        return False
    events = connection.dispatch
    return bool(events.before_execute or events.after_execute)
