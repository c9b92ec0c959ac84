"""``python -m sqla_outbox migrate``: apply the bundled migrations (standalone version table)."""

from __future__ import annotations

from typing import Any

import click

from sqla_outbox import errors
from sqla_outbox.cli.options import common_options, handle_errors, load_settings, setup_logging
from sqla_outbox.cli.terminal import echo
from sqla_outbox.config import redact_url


@click.command("migrate")
@common_options
@click.option("--revision", default="heads", show_default=True, help="Target revision.")
@click.option("--sql", is_flag=True, help="Print the SQL instead of running it.")
@click.option("--downgrade", is_flag=True, help="Downgrade to --revision (e.g. base) instead.")
@click.option(
    "--yes",
    is_flag=True,
    help="Downgrade without asking, even when the outbox tables hold rows (a downgrade may drop them).",
)
def migrate_command(
    verbose: int,
    log_format: str,
    traceback: bool,
    revision: str,
    sql: bool,
    downgrade: bool,
    yes: bool,
    **options: Any,
) -> None:
    """Apply sqla_outbox's bundled migrations (standalone version table).

    Prints what it did: `migrated <database> from <revision> to <revision> (head)`, or
    that the database is already there. Applications with their own Alembic environment
    should add our revisions to it instead (docs/alembic.md). A downgrade of a database
    whose outbox tables hold rows asks first (a downgrade to base drops the tables and the
    only copy of unsent payloads); without a terminal it needs --yes (exit code 2 otherwise).
    """
    setup_logging(verbose, log_format)
    with handle_errors(traceback):
        settings = load_settings(**options)
        from sqla_outbox import migrations

        if sql:  # offline: the SQL goes to stdout, nothing is applied
            (migrations.downgrade if downgrade else migrations.upgrade)(
                settings.sqlalchemy_url, revision, sql=True
            )
            return
        import sqlalchemy as sa

        database = redact_url(settings.database_url)
        engine = sa.create_engine(settings.sqlalchemy_url, poolclass=sa.pool.NullPool, hide_parameters=True)
        try:
            before = migrations.current_revisions(engine)
            if not before and not downgrade:
                with engine.connect() as connection:
                    missing = migrations.missing_tables(connection)
                if len(missing) < len(migrations.OUTBOX_TABLES):
                    raise errors.ConfigurationError(
                        f"the outbox tables already exist in {database}, but not through "
                        f"`python -m sqla_outbox migrate` (its {migrations.VERSION_TABLE} table records "
                        "nothing): your application's Alembic environment manages them; run "
                        "`alembic upgrade heads` there (docs/alembic.md)",
                        option="python -m sqla_outbox migrate",
                    )
            if downgrade and before and not yes:
                _confirm_downgrade(engine, database, revision)
            (migrations.downgrade if downgrade else migrations.upgrade)(engine, revision)
            after = migrations.current_revisions(engine)
        finally:
            engine.dispose()
        echo(_migration_summary(database, before, after, downgrade))


def _confirm_downgrade(engine: Any, database: str, revision: str) -> None:
    """Ask before a downgrade when the outbox tables hold rows.

    Raises:
        ConfigurationError: rows exist, and there is no terminal to ask on (exit code 2).
        click.exceptions.Exit: the operator answered no (exit code 1).
    """
    import sys

    import sqlalchemy as sa

    from sqla_outbox import migrations

    counts: dict[str, int] = {}
    with engine.connect() as connection:
        present = set(sa.inspect(connection).get_table_names())
        for table in migrations.OUTBOX_TABLES:
            if table in present:
                counts[table] = connection.execute(
                    sa.select(sa.func.count()).select_from(sa.table(table))
                ).scalar_one()
        pending = sum(
            connection.execute(
                sa.select(sa.func.count())
                .select_from(sa.table(table, sa.column("sent_at")))
                .where(sa.column("sent_at").is_(None))
            ).scalar_one()
            for table in ("outbox_messages", "platform_outbox_messages")
            if table in present
        )
    held = {table: n for table, n in counts.items() if n}
    if not held:
        return
    summary = (
        f"the outbox tables of {database} hold rows ("
        + ", ".join(f"{table} {n}" for table, n in held.items())
        + f"; {pending} outbox rows not yet sent, whose payloads exist nowhere else); a downgrade "
        f"to {revision} may drop them"
    )
    if not sys.stdin.isatty():
        raise errors.ConfigurationError(f"{summary}. Run it with --yes to downgrade anyway", option="--yes")
    echo(summary + ".", err=True)
    if not click.confirm("Downgrade?", default=False, err=True):
        raise click.exceptions.Exit(1)


def _migration_summary(
    database: str, before: tuple[str, ...], after: tuple[str, ...], downgrade: bool
) -> str:
    from sqla_outbox import migrations

    def shown(revisions: tuple[str, ...]) -> str:
        label = ", ".join(revisions) or "base"
        return f"{label} (head)" if revisions and revisions == migrations.head_revisions() else label

    if before == after:
        return f"{database} is already at {shown(after)}; nothing to do"
    return f"{'downgraded' if downgrade else 'migrated'} {database} from {shown(before)} to {shown(after)}"
