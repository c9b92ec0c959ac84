"""The body of the standalone Alembic environment, shared by ``sqla_outbox/migrations/env.py``
and this repository's top-level ``alembic/env.py``."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

from sqlalchemy import Connection, MetaData, Table, create_engine, inspect, pool

from alembic import context
from sqla_outbox.config import sqlalchemy_url
from sqla_outbox.migrations import VERSION_TABLE


def _url() -> str:
    url = context.config.get_main_option("sqlalchemy.url")
    if url:
        return url
    for name in ("SQLA_OUTBOX_DATABASE_URL", "DATABASE_URL"):
        if os.environ.get(name):
            return sqlalchemy_url(os.environ[name])
    return "postgresql+psycopg://postgres@127.0.0.1:5432/postgres"


def _only_our_tables(name: str | None, type_: str, parent_names: object) -> bool:
    """Autogenerate in the standalone environment looks at sqla_outbox's tables only."""
    from sqla_outbox import models

    return type_ != "table" or name in models.metadata.tables


@contextlib.contextmanager
def _tenant_foreign_key_bound(connection: Connection) -> Iterator[None]:
    """Resolve the tenant FK against the live database while migrations run.

    Autogenerate resolves foreign keys, and the tenants table is not ours; reflecting it
    into a scratch ``MetaData`` lets ``alembic check`` compare our constraint. The
    string target is restored afterwards.
    """
    from sqla_outbox import models

    target = models.tenant_foreign_key_target()
    if target is None:
        yield
        return
    table_name, _, column_name = target.rpartition(".")
    schema, _, table_name = table_name.rpartition(".")
    ours = not connection.in_transaction()
    table: Table | None = None
    if inspect(connection).has_table(table_name, schema=schema or None):
        table = Table(table_name, MetaData(), schema=schema or None, autoload_with=connection)
    if ours:  # leave the connection as Alembic expects it: no transaction begun
        connection.rollback()
    if table is None or column_name not in table.c:
        yield  # nothing to bind; the first revision reports the missing target clearly
        return
    models.set_tenant_foreign_key(table.c[column_name])
    try:
        yield
    finally:
        models.set_tenant_foreign_key(target)


def run() -> None:
    """Run the migrations online or offline (``--sql``) per Alembic's context."""
    from sqla_outbox import models

    options: dict[str, Any] = {
        "target_metadata": models.metadata,
        "version_table": VERSION_TABLE,
        "compare_type": True,
        "include_name": _only_our_tables,
    }
    if context.is_offline_mode():
        context.configure(url=_url(), literal_binds=True, **options)
        with context.begin_transaction():
            context.run_migrations()
        return
    connection = context.config.attributes.get("connection")
    if connection is not None:
        _run_online(connection, options)
        return
    engine = create_engine(_url(), poolclass=pool.NullPool, hide_parameters=True)
    with engine.connect() as connection:
        _run_online(connection, options)
    engine.dispose()


def _run_online(connection: Connection, options: dict[str, Any]) -> None:
    with _tenant_foreign_key_bound(connection):
        context.configure(connection=connection, **options)
        with context.begin_transaction():
            context.run_migrations()
