"""The bundled Alembic migrations, usable standalone or from an application's Alembic.

Standalone (this package's own environment, its own version table
``sqla_outbox_alembic_version``)::

    python -m sqla_outbox migrate                       # or: sqla_outbox.migrations.upgrade(url)
    alembic -c alembic.ini upgrade head       # from a checkout of this repository

From an application's Alembic environment (its own migrations plus ours, one head per
branch; see ``docs/alembic.md``)::

    # alembic.ini
    version_locations = %(here)s/versions sqla_outbox:migrations/versions
    # env.py
    from sqla_outbox.migrations import target_metadata as outbox_target_metadata
    target_metadata = outbox_target_metadata(Base.metadata)   # [Base.metadata, ours]
    # then: alembic upgrade heads

Two values shape the first revision; both come from the environment so the revision
file never imports the models:

* ``SQLA_OUTBOX_TENANT_FOREIGN_KEY`` — ``table.column`` that ``outbox_messages.tenant_id``
  references (default ``tenants.id``; ``none`` for no foreign key). An Alembic
  ``-x tenant_foreign_key=...`` argument wins over it.
* ``sqla_outbox_depends_on`` in the application's ``alembic.ini`` ``[alembic]`` section
  (or ``SQLA_OUTBOX_MIGRATIONS_DEPENDS_ON``) — revision ids of the application's that
  must run before ours (the one that creates the tenants table), so a database built
  from scratch with ``upgrade heads`` creates ``tenants`` first.
"""

from __future__ import annotations

import os
from typing import Any

BRANCH_LABEL = "sqla_outbox"
SCRIPT_LOCATION = "sqla_outbox:migrations"
VERSION_LOCATION = "sqla_outbox:migrations/versions"
VERSION_TABLE = "sqla_outbox_alembic_version"

_NONE = {"", "none", "null", "off"}

OUTBOX_TABLES = (
    "outbox_messages",
    "platform_outbox_messages",
    "task_runs",
    "task_run_trail",
    "webhook_endpoints",
    "worker_presence",
    "schedule_slots",
    "task_groups",
    "schedule_tenant_slots",
    "flow_pauses",
    "tenant_flow",
    "dashboard_sessions",
)
"""The tables the migrations create (the version table aside)."""

CONCURRENT_INDEX_MIN_ROWS = 100_000
"""A revision that adds an index to a table at least this large (planner estimate,
``pg_class.reltuples``) builds it with ``CREATE INDEX CONCURRENTLY``, so dispatches are not
blocked while it runs (PostgreSQL: a plain ``CREATE INDEX`` holds a SHARE lock that blocks
writes to the table until the build ends)."""


def tenant_foreign_key() -> str | None:
    """The FK target for ``outbox_messages.tenant_id`` while a migration runs.

    Precedence: ``-x tenant_foreign_key=...`` > ``SQLA_OUTBOX_TENANT_FOREIGN_KEY`` >
    ``tenants.id``. ``none`` (or empty) means no foreign key.
    """
    raw: str | None = None
    try:
        from alembic import context

        raw = context.get_x_argument(as_dictionary=True).get("tenant_foreign_key")
    except Exception:
        raw = None
    if raw is None:
        raw = os.environ.get("SQLA_OUTBOX_TENANT_FOREIGN_KEY", "tenants.id")
    raw = raw.strip()
    return None if raw.lower() in _NONE else raw


def depends_on() -> tuple[str, ...] | None:
    """Application revisions our base revision must follow.

    Read from ``SQLA_OUTBOX_MIGRATIONS_DEPENDS_ON``, else from the ``sqla_outbox_depends_on``
    option of the running Alembic config (comma- or space-separated revision ids).
    """
    raw = os.environ.get("SQLA_OUTBOX_MIGRATIONS_DEPENDS_ON")
    if raw is None:
        try:
            from alembic import context

            raw = context.config.get_main_option("sqla_outbox_depends_on")
        except Exception:
            raw = None
    revisions = tuple(part for part in (raw or "").replace(",", " ").split() if part)
    return revisions or None


def check_tenant_foreign_key_target(connection: Any, target: str) -> None:
    """Fail early, and clearly, when the tenant foreign key would reference nothing.

    PostgreSQL refuses ``CREATE TABLE outbox_messages (... REFERENCES tenants (id))`` when
    ``tenants`` or its ``id`` column does not exist, with a long ``ProgrammingError``;
    the first revision calls this first (online mode only) so the message says what to do.

    Args:
        connection: The migration's connection (``op.get_bind()``).
        target: ``table.column`` or ``schema.table.column``.

    Raises:
        ConfigurationError: Naming ``SQLA_OUTBOX_TENANT_FOREIGN_KEY``: the table or the
            column is missing.
    """
    import sqlalchemy as sa

    from sqla_outbox import errors
    from sqla_outbox.urls import redact_url

    table_path, _, column = target.rpartition(".")
    schema, _, table = table_path.rpartition(".")
    inspector = sa.inspect(connection)
    # shown as the user configured it (no ``+psycopg`` driver name), password masked
    database = redact_url(
        connection.engine.url.set(drivername="postgresql").render_as_string(hide_password=False)
    )
    fixes = (
        "create that table first (run your application's migrations before ours; see "
        "sqla_outbox_depends_on in docs/alembic.md), point SQLA_OUTBOX_TENANT_FOREIGN_KEY at "
        "your tenants table (e.g. accounts.id), or set SQLA_OUTBOX_TENANT_FOREIGN_KEY=none "
        "for no foreign key"
    )
    if not inspector.has_table(table, schema=schema or None):
        raise errors.ConfigurationError(
            f"outbox_messages.tenant_id references {target}, but {database} has no table "
            f"{table_path!r}: {fixes}",
            option="SQLA_OUTBOX_TENANT_FOREIGN_KEY",
        )
    columns = {c["name"] for c in inspector.get_columns(table, schema=schema or None)}
    if column not in columns:
        raise errors.ConfigurationError(
            f"outbox_messages.tenant_id references {target}, but table {table_path!r} in "
            f"{database} has no column {column!r}: {fixes}",
            option="SQLA_OUTBOX_TENANT_FOREIGN_KEY",
        )


def missing_tables(connection: Any) -> list[str]:
    """Which of :data:`OUTBOX_TABLES` the connection's database lacks (on its search path).

    Args:
        connection: A SQLAlchemy ``Connection``; one query, no transaction left open by
            the caller's choice (the caller commits or rolls back).

    Returns:
        Table names in :data:`OUTBOX_TABLES` order; empty when every table exists.
    """
    import sqlalchemy as sa

    rows = connection.execute(
        sa.text(
            "SELECT name FROM unnest(CAST(:names AS text[])) WITH ORDINALITY AS t(name, n) "
            "WHERE to_regclass(name) IS NULL ORDER BY n"
        ),
        {"names": list(OUTBOX_TABLES)},
    )
    return [str(name) for name in rows.scalars()]


def is_missing_outbox_table(exc: BaseException) -> bool:
    """Whether ``exc`` is PostgreSQL's undefined_table (SQLSTATE 42P01) on a statement that
    uses one of :data:`OUTBOX_TABLES`: the database was never migrated. Decided on the
    SQLSTATE and the statement text, not on the server's (possibly translated) message."""
    import sqlalchemy as sa

    if not isinstance(exc, sa.exc.DBAPIError) or getattr(exc.orig, "sqlstate", None) != "42P01":
        return False
    statement = str(exc.statement or "")
    return any(table in statement for table in OUTBOX_TABLES)


MIGRATE_ADVICE = (
    "run `python -m sqla_outbox migrate`, or `alembic upgrade heads` if your application's "
    "Alembic environment holds sqla_outbox's migrations (docs/alembic.md)"
)
"""What to do about missing outbox tables when it is not known who migrates the database."""


def migrate_advice(connection: Any = None) -> str:
    """How to create the outbox tables in the connection's database.

    Decided by the version tables present: ``sqla_outbox_alembic_version`` (the standalone
    ``python -m sqla_outbox migrate``) → ``migrate``; only the application's
    ``alembic_version`` → its own ``alembic upgrade heads`` (our revisions belong in its
    environment, docs/alembic.md); neither, or no connection → :data:`MIGRATE_ADVICE`.
    """
    if connection is None:
        return MIGRATE_ADVICE
    import sqlalchemy as sa

    try:
        standalone, application = connection.execute(
            sa.text("SELECT to_regclass(:ours) IS NOT NULL, to_regclass('alembic_version') IS NOT NULL"),
            {"ours": VERSION_TABLE},
        ).one()
    except sa.exc.DBAPIError:
        return MIGRATE_ADVICE
    if standalone:
        return "run `python -m sqla_outbox migrate`"
    if application:
        return (
            "your application's Alembic environment manages this database: add sqla_outbox's "
            "migrations to it and run `alembic upgrade heads` there (docs/alembic.md)"
        )
    return MIGRATE_ADVICE


def missing_tables_message(database: str, missing: list[str] | None = None, *, connection: Any = None) -> str:
    """The one-line explanation for a database whose outbox tables do not exist.

    Args:
        database: The database URL with its password masked.
        missing: The tables not found, when only some are missing.
        connection: A connection to that database, to tell who migrates it
            (:func:`migrate_advice`); None gives both ways.
    """
    which = f" ({', '.join(missing)} not found)" if missing and len(missing) < len(OUTBOX_TABLES) else ""
    return f"the outbox tables are missing in {database}{which}: {migrate_advice(connection)}"


def current_revisions(target: Any) -> tuple[str, ...]:
    """Revisions recorded in ``sqla_outbox_alembic_version`` (standalone version table).

    Args:
        target: A database URL (``postgresql://`` gets the psycopg 3 driver) or an ``Engine``.

    Returns:
        Revision ids, sorted; empty when the database was never migrated standalone.
    """
    import sqlalchemy as sa
    from alembic.runtime.migration import MigrationContext

    from sqla_outbox.config import sqlalchemy_url

    engine = target if isinstance(target, sa.Engine) else None
    owned = engine is None
    if engine is None:
        engine = sa.create_engine(
            sqlalchemy_url(str(target)), poolclass=sa.pool.NullPool, hide_parameters=True
        )
    try:
        with engine.connect() as connection:
            context = MigrationContext.configure(connection, opts={"version_table": VERSION_TABLE})
            return tuple(sorted(context.get_current_heads()))
    finally:
        if owned:
            engine.dispose()


def head_revisions() -> tuple[str, ...]:
    """The head revisions of the bundled migrations, sorted (one head: the revisions form a single chain)."""
    from alembic.script import ScriptDirectory

    return tuple(sorted(ScriptDirectory.from_config(alembic_config()).get_heads()))


def target_metadata(*application_metadata: Any) -> list[Any]:
    """``target_metadata`` for an application's Alembic ``env.py``: its metadata plus ours.

    Alembic's autogenerate resolves foreign keys, and ``outbox_messages.tenant_id``
    references the application's tenants table, which lives in the application's
    metadata. This binds our foreign key to that table's column object so
    ``alembic check`` / ``revision --autogenerate`` propose nothing for our tables.

    Args:
        *application_metadata: The application's ``MetaData`` objects.

    Returns:
        ``[*application_metadata, sqla_outbox.metadata]``.

    Raises:
        ConfigurationError: The tenant foreign key names a table that none of the given
            metadata objects holds (set ``SQLA_OUTBOX_TENANT_FOREIGN_KEY=none`` if your
            tenants table is not mapped, and create the constraint yourself).
    """
    from sqla_outbox import errors, models

    target = models.tenant_foreign_key_target()
    if target is not None:
        table_name, _, column_name = target.rpartition(".")
        for metadata in application_metadata:
            table = metadata.tables.get(table_name)
            if table is not None and column_name in table.c:
                models.set_tenant_foreign_key(table.c[column_name])
                break
        else:
            raise errors.ConfigurationError(
                f"outbox_messages.tenant_id references {target}, but no given metadata "
                f"has a table {table_name!r} with column {column_name!r}",
                option="SQLA_OUTBOX_TENANT_FOREIGN_KEY",
            )
    return [*application_metadata, models.metadata]


def include_object(object_: Any, name: str | None, type_: str, reflected: bool, compare_to: Any) -> bool:
    """Alembic ``include_object`` hook that keeps sqla_outbox's tables out of an
    application's autogenerate.

    Autogenerate proposes dropping every table it finds in the database but not in
    ``target_metadata``. An application whose ``target_metadata`` does not hold ours
    (it does not call :func:`target_metadata`), or whose database has the standalone
    version table ``sqla_outbox_alembic_version`` (tables created by ``python -m
    sqla_outbox migrate``), would see ``remove_table`` for them in every
    ``alembic revision --autogenerate`` and ``alembic check``. Pass this as
    ``context.configure(..., include_object=include_object)``, or call it from your own
    hook: it returns False for those tables (and their indexes and constraints) when they
    are reflected from the database and not in your metadata, True for everything else.
    """
    if not reflected or compare_to is not None:
        return True
    table = name if type_ == "table" else getattr(getattr(object_, "table", None), "name", None)
    return table not in (*OUTBOX_TABLES, VERSION_TABLE)


def alembic_config(url: str | None = None, **attributes: Any) -> Any:
    """An Alembic ``Config`` for the standalone environment (no ini file needed).

    Args:
        url: SQLAlchemy database URL; default from ``SQLA_OUTBOX_DATABASE_URL`` /
            ``DATABASE_URL`` (read by the environment script).
        **attributes: Put into ``config.attributes`` (``connection=...`` runs the
            migrations on an existing connection).
    """
    from alembic.config import Config

    config = Config()
    config.set_main_option("script_location", SCRIPT_LOCATION)
    if url:
        config.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    config.attributes.update(attributes)
    return config


def upgrade(target: Any = None, revision: str = "heads", *, sql: bool = False) -> None:
    """Upgrade the sqla_outbox tables (standalone version table).

    Args:
        target: A database URL, an ``Engine`` or a ``Connection``; None reads the URL
            from the environment.
        revision: Alembic revision to upgrade to.
        sql: Print the SQL instead of running it (offline mode; needs a URL).
    """
    from alembic import command

    command.upgrade(_config_for(target), revision, sql=sql)


def downgrade(target: Any = None, revision: str = "base", *, sql: bool = False) -> None:
    """Downgrade the sqla_outbox tables (``base`` drops them all)."""
    from alembic import command

    command.downgrade(_config_for(target), revision, sql=sql)


def _config_for(target: Any) -> Any:
    from sqlalchemy.engine import Connection, Engine

    from sqla_outbox.config import sqlalchemy_url

    if isinstance(target, Connection):
        return alembic_config(connection=target)
    if isinstance(target, Engine):
        return alembic_config(target.url.render_as_string(hide_password=False))
    if isinstance(target, str):
        return alembic_config(sqlalchemy_url(target))
    return alembic_config()
