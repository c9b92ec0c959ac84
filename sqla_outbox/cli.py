"""Command line: ``sqla-outbox`` and the ``python -m sqla_outbox.relay|worker`` entry points.

Every option that sets a field of :class:`~sqla_outbox.config.OutboxSettings` names its
environment twin in ``--help``; precedence is option > ``SQLA_OUTBOX_*`` variable > bare
alias (``DATABASE_URL``, ``REDIS_URL``, ``QUEUES``) > default. Human output is tables;
``--json`` prints one JSON document for scripts. Exit codes: 0 ok, 1 a check failed,
2 bad configuration, 3 a service could not be reached.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import signal
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import click

from sqla_outbox import errors
from sqla_outbox import logging as outbox_logging
from sqla_outbox.config import OutboxSettings, env_names, redact_url

EXIT_OK = 0
EXIT_CHECK_FAILED = 1
EXIT_CONFIG = 2
EXIT_CONNECT = 3


# --- shared option helpers ----------------------------------------------------------------
def _field(name: str) -> dataclasses.Field[Any]:
    return {f.name: f for f in dataclasses.fields(OutboxSettings)}[name]


_FLAGS: dict[str, str] = {}
"""Settings field → the command-line flag that sets it (for error messages)."""


def setting(name: str, *flags: str, **kwargs: Any) -> Callable[[Any], Any]:
    """A click option for settings field ``name``, its help naming the env twins."""
    field = _field(name)
    _FLAGS.setdefault(name, next((f for f in flags if f.startswith("--")), "--" + name.replace("_", "-")))
    unit = f" [{field.metadata['unit']}]" if field.metadata["unit"] else ""
    envs = ", ".join(env_names(name))
    kwargs.setdefault("default", None)
    kwargs.setdefault("show_default", False)
    return click.option(
        *(flags or ("--" + name.replace("_", "-"),)),
        name,
        help=f"{field.metadata['doc']}{unit} (env: {envs})",
        **kwargs,
    )


def common_options(func: Callable[..., Any]) -> Callable[..., Any]:
    """Options every service command takes: database, Valkey, SQS endpoint, logging."""
    for decorator in reversed(
        [
            setting("database_url", "--database-url"),
            setting("valkey_url", "--valkey-url"),
            setting("sqs_endpoint_url", "--sqs-endpoint-url"),
            setting("queue_prefix", "--queue-prefix"),
            click.option("-v", "--verbose", count=True, help="More log output (-v: debug)."),
            click.option(
                "--log-format",
                type=click.Choice(["auto", "json", "text"]),
                default="auto",
                show_default=True,
                help="Log lines as JSON objects (default when stderr is not a terminal) or text.",
            ),
            click.option("--traceback", is_flag=True, help="Show the stack trace of errors."),
        ]
    ):
        func = decorator(func)
    return func


_loaded: dict[str, str] = {}
"""``database``: the URL (password masked) of the settings the command loaded, for errors."""


def load_settings(**overrides: Any) -> OutboxSettings:
    """Settings from the environment with CLI overrides (``None`` means not given).

    Raises:
        ConfigurationError: A value is invalid (see :meth:`OutboxSettings.from_env`).
    """
    known = {f.name for f in dataclasses.fields(OutboxSettings)}
    given = {k: v for k, v in overrides.items() if k in known and v is not None}
    try:
        settings = OutboxSettings.from_env(**given)
    except errors.ConfigurationError as exc:
        # a value that came from a flag is named by the flag, not by its environment twin
        field = next((name for name in given if exc.option == env_names(name)[0]), None)
        if field is None or field not in _FLAGS:
            raise
        message = str(exc).removeprefix(f"{exc.option}: ")
        raise errors.ConfigurationError(message, option=_FLAGS[field]) from None
    _loaded["database"] = redact_url(settings.database_url)
    return settings


def missing_tables_message(database: str, missing: list[str] | None = None) -> str:
    """The one-line explanation for a database whose outbox tables do not exist.

    Args:
        database: The database URL with its password masked.
        missing: The tables not found, when only some are missing.
    """
    which = f" ({', '.join(missing)} not found)" if missing and len(missing) < 4 else ""
    return f"the outbox tables are missing in {database}{which}: run `sqla-outbox migrate`"


def setup_logging(verbose: int, log_format: str) -> None:
    json_lines = log_format == "json" or (log_format == "auto" and not sys.stderr.isatty())
    outbox_logging.configure(verbose=verbose, json_lines=json_lines)


@contextmanager
def handle_errors(show_traceback: bool) -> Iterator[None]:
    """Turn library errors into ``error: <message>`` and the documented exit codes."""
    try:
        yield
    except errors.ConfigurationError as exc:
        if show_traceback:
            raise
        click.echo(f"error: {exc}", err=True)
        sys.exit(EXIT_CONFIG)
    except errors.OutboxError as exc:
        if show_traceback:
            raise
        click.echo(f"error: {exc}", err=True)
        sys.exit(EXIT_CHECK_FAILED)
    except Exception as exc:
        if show_traceback:
            raise
        from sqla_outbox.migrations import is_missing_outbox_table

        if is_missing_outbox_table(exc):
            database = _loaded.get("database", "the configured database")
            click.echo(f"error: {missing_tables_message(database)}", err=True)
            sys.exit(EXIT_CONFIG)
        if not _is_connection_error(exc):
            raise
        click.echo(f"error: cannot reach a service: {_connection_error_summary(exc)}", err=True)
        sys.exit(EXIT_CONNECT)


def _connection_error_summary(exc: BaseException) -> str:
    """``<type>: <first line>`` of the driver's own error (SQLAlchemy wraps it in a
    multi-line message with the statement and a documentation link); passwords masked."""
    cause = getattr(exc, "orig", None) or exc
    lines = [line.strip() for line in str(cause).splitlines() if line.strip()]
    first = lines[0] if lines else ""
    return redact_url(f"{type(cause).__name__}: {first}"[:400])


def _is_connection_error(exc: BaseException) -> bool:
    import botocore.exceptions
    import redis
    import sqlalchemy.exc

    return isinstance(
        exc,
        (
            sqlalchemy.exc.OperationalError,
            sqlalchemy.exc.InterfaceError,
            botocore.exceptions.EndpointConnectionError,
            botocore.exceptions.NoCredentialsError,
            redis.ConnectionError,
            ConnectionError,
        ),
    )


def console(*, stderr: bool = False, quiet: bool = False) -> Any:
    """A rich console that prints every string literally.

    Markup and emoji codes are off: run ids, task names, idempotency keys, error messages,
    URLs and queue names come from users and the database, and ``[/7]``, ``[bold]`` or
    ``:warning:`` in them must show as typed (with markup on, rich raises ``MarkupError``
    on some and silently drops others). Colour goes through :func:`styled` instead.

    Args:
        stderr: Print to stderr (progress and notices) instead of stdout.
        quiet: Print nothing (the ``--json`` mode of commands that also show progress).

    Returns:
        A ``rich.console.Console``. Output that is not a terminal (less, a file) is 200
        columns wide instead of 80, unless ``COLUMNS`` sets the width.
    """
    import os

    from rich.console import Console

    options: dict[str, Any] = {"markup": False, "emoji": False, "stderr": stderr, "quiet": quiet}
    terminal = Console(**options)
    if terminal.is_terminal or os.environ.get("COLUMNS", "").isdigit():
        return terminal
    return Console(width=200, **options)


def styled(text: str, style: str) -> Any:
    """``text`` as a ``rich.text.Text`` in ``style`` (``"red"``), never parsed as markup."""
    from rich.text import Text

    return Text(text, style=style)


def print_json(document: Any) -> None:
    click.echo(json.dumps(document, indent=2, default=str))


class _Abandon(BaseException):
    """Raised by a second SIGTERM/SIGINT: abandon the work in progress now."""


def install_stop_signals(stop: Callable[[], None]) -> None:
    """First SIGTERM/SIGINT calls ``stop`` (finish cleanly); a second one abandons."""
    received = {"count": 0}

    def handler(signum: int, frame: Any) -> None:
        received["count"] += 1
        if received["count"] == 1:
            stop()
        else:
            raise _Abandon

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)


# --- the command group ---------------------------------------------------------------------
@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(package_name="sqla-outbox")
def main() -> None:
    """sqla_outbox: transactional outbox for SQLAlchemy, relayed to AWS SQS."""


@main.command("relay")
@common_options
@setting("relay_sweep_interval_seconds", "--sweep-interval", type=float)
@setting("relay_batch_size", "--batch-size", type=int)
@setting("relay_send_concurrency", "--send-concurrency", type=int)
@setting("health_port", "--health-port", type=int)
@click.option(
    "--once",
    is_flag=True,
    help="Run one pass and exit; when another relay is active, do nothing (exit code 0, "
    '"leader": false in --json).',
)
@click.option("--check", is_flag=True, help="Check the database, Valkey and SQS, then exit.")
@click.option("--json", "as_json", is_flag=True, help="With --once/--check: print JSON.")
def relay_command(
    verbose: int, log_format: str, traceback: bool, once: bool, check: bool, as_json: bool, **options: Any
) -> None:
    """Move committed outbox rows to SQS (the one active relay; others stand by)."""
    setup_logging(verbose, log_format)
    with handle_errors(traceback):
        settings = load_settings(**options)
        if check:
            from sqla_outbox import health

            report = health.check_services(settings, need_queues=True)
            schedules = health.check_schedules(settings)
            report.results.append(schedules)
            health.print_report(report, as_json=as_json)
            if not report.ok:  # 3: a service did not answer; 2: only the catalog is wrong
                sys.exit(EXIT_CONFIG if report.ok_without(schedules) else EXIT_CONNECT)
            sys.exit(EXIT_OK)
        from sqla_outbox.relay import Relay

        relay = Relay(settings)
        if once:
            result = relay.run_once()
            if as_json:
                print_json(dataclasses.asdict(result))
            elif not result.leader:
                click.echo("another relay is active; nothing done (it sends the pending rows)")
            else:
                click.echo(f"claimed {result.claimed}, sent {result.sent}, failed {result.failed}")
            return  # exit code 0 either way: the active relay does the work
        probe = None
        if settings.health_port is not None:
            from sqla_outbox.health import ProbeServer

            probe = ProbeServer(settings.health_port, ready=lambda: not relay.stopping)
            probe.start()
        install_stop_signals(relay.stop)
        try:
            relay.run()
        except _Abandon:
            click.echo("relay: abandoned the batch in progress (its rows stay pending)", err=True)
        finally:
            if probe is not None:
                probe.stop()


@main.command("provision")
@common_options
@setting("max_receive_count", "--max-receive-count", type=int)
@setting("max_message_bytes", "--max-message-bytes", type=int)
@setting("sqs_managed_sse", "--sse/--no-sse")
@setting("sqs_kms_key_id", "--kms-key-id")
@click.option("--fix", is_flag=True, help="Apply the desired attributes to queues that drifted.")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
def provision_command(
    verbose: int, log_format: str, traceback: bool, fix: bool, as_json: bool, **options: Any
) -> None:
    """Create the four queues and their DLQs (idempotent); report attribute drift.

    Exit code 1 when an existing queue drifted and --fix was not given.
    """
    setup_logging(verbose, log_format)
    with handle_errors(traceback):
        settings = load_settings(**options)
        from sqla_outbox.sqs.client import make_client
        from sqla_outbox.sqs.provision import provision

        reports = provision(make_client(settings), settings, fix=fix)
        if as_json:
            print_json([dataclasses.asdict(r) for r in reports])
        else:
            from rich.table import Table

            table = Table(title="SQS queues")
            for column in ("queue", "SQS name", "kind", "action", "differences"):
                table.add_column(column)
            for r in reports:
                diffs = "; ".join(
                    f"{k}: {v['actual']!r} → {v['expected']!r}" for k, v in r.differences.items()
                )
                table.add_row(r.queue, r.name, "DLQ" if r.dead_letter else "source", r.action, diffs)
            console().print(table)
        if any(r.action == "drift" for r in reports):
            sys.exit(EXIT_CHECK_FAILED)


@main.command("migrate")
@common_options
@click.option("--revision", default="heads", show_default=True, help="Target revision.")
@click.option("--sql", is_flag=True, help="Print the SQL instead of running it.")
@click.option("--downgrade", is_flag=True, help="Downgrade to --revision (e.g. base) instead.")
def migrate_command(
    verbose: int,
    log_format: str,
    traceback: bool,
    revision: str,
    sql: bool,
    downgrade: bool,
    **options: Any,
) -> None:
    """Apply sqla_outbox's bundled migrations (standalone version table).

    Prints what it did: `migrated <database> from <revision> to <revision> (head)`, or
    that the database is already there. Applications with their own Alembic environment
    should add our revisions to it instead (docs/alembic.md).
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
        engine = sa.create_engine(settings.sqlalchemy_url, poolclass=sa.pool.NullPool)
        try:
            before = migrations.current_revisions(engine)
            if not before and not downgrade:
                with engine.connect() as connection:
                    missing = migrations.missing_tables(connection)
                if len(missing) < len(migrations.OUTBOX_TABLES):
                    raise errors.ConfigurationError(
                        f"the outbox tables already exist in {database}, but not through "
                        f"`sqla-outbox migrate` (its {migrations.VERSION_TABLE} table records "
                        "nothing): your application's Alembic environment manages them; run "
                        "`alembic upgrade heads` there (docs/alembic.md)",
                        option="sqla-outbox migrate",
                    )
            (migrations.downgrade if downgrade else migrations.upgrade)(engine, revision)
            after = migrations.current_revisions(engine)
        finally:
            engine.dispose()
        click.echo(_migration_summary(database, before, after, downgrade))


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


@main.command("worker")
@common_options
@setting("worker_queues", "--queues", "-Q", callback=lambda ctx, param, value: _split(value))
@setting("worker_concurrency", "--concurrency", "-c", type=int)
@setting("worker_imports", "--imports", "-I", callback=lambda ctx, param, value: _split(value))
@setting("worker_wait_seconds", "--wait-seconds", type=int)
@setting("worker_stop_budget_seconds", "--stop-budget", type=float)
@setting("worker_run_relay", "--with-relay/--without-relay")
@setting("worker_id", "--worker-id")
@setting("health_port", "--health-port", type=int)
@setting("catalog_path", "--catalog")
@click.option("--check", is_flag=True, help="Check the database, Valkey, SQS and the handlers, then exit.")
@click.option("--json", "as_json", is_flag=True, help="With --check: print JSON.")
def worker_command(
    verbose: int, log_format: str, traceback: bool, check: bool, as_json: bool, **options: Any
) -> None:
    """Run task handlers from SQS: heartbeats, retries, DLQ, run history, graceful stop."""
    setup_logging(verbose, log_format)
    with handle_errors(traceback):
        settings = load_settings(**options)
        from sqla_outbox.worker.consumer import Worker, import_task_modules

        import_task_modules(settings.worker_imports)
        if check:
            from sqla_outbox import health

            report = health.check_services(settings, need_queues=True)
            handlers = health.check_handlers(settings)
            report.results.append(handlers)
            health.print_report(report, as_json=as_json)
            if not report.ok:  # 3: a service did not answer; 2: only the configuration is wrong
                sys.exit(EXIT_CONFIG if report.ok_without(handlers) else EXIT_CONNECT)
            sys.exit(EXIT_OK)
        from sqla_outbox.logging import log_extra
        from sqla_outbox.worker.registry import registry

        for warning in registry.preflight(settings, queues=settings.worker_queues):
            logging.getLogger("sqla_outbox.worker").warning(
                warning, extra=log_extra(action="worker.preflight")
            )
        worker = Worker(settings)
        probe = None
        if settings.health_port is not None:
            from sqla_outbox.health import ProbeServer

            probe = ProbeServer(
                settings.health_port,
                ready=lambda: worker.ready and not worker.stopping,
                alive=worker.is_alive,
            )
            probe.start()
        try:
            worker.run()
        finally:
            if probe is not None:
                probe.stop()


@main.group("catalog")
def catalog_group() -> None:
    """The task catalog (tasks.json) the API side reads."""


@catalog_group.command("write")
@setting("worker_imports", "--imports", "-I", callback=lambda ctx, param, value: _split(value))
@setting("catalog_path", "--output", "-o")
@click.option("--check", is_flag=True, help="Exit 1 if the file on disk differs (for CI).")
def catalog_write_command(check: bool, **options: Any) -> None:
    """Write tasks.json from the @task registrations in --imports modules."""
    with handle_errors(False):
        settings = load_settings(**options)
        import sqla_outbox.maintenance  # registers the built-in tasks
        from sqla_outbox.worker.consumer import import_task_modules
        from sqla_outbox.worker.registry import registry

        import_task_modules(settings.worker_imports)
        if not set(registry.tasks) - set(sqla_outbox.maintenance.BUILTIN_TASKS):
            raise errors.ConfigurationError(
                "no tasks registered; pass the modules that define them with --imports",
                option="SQLA_OUTBOX_WORKER_IMPORTS",
            )
        from pathlib import Path

        text = registry.catalog().to_json()
        path = Path(settings.catalog_path)
        if check:
            current = path.read_text(encoding="utf-8") if path.exists() else ""
            if current != text:
                import difflib

                diff = difflib.unified_diff(
                    current.splitlines(keepends=True),
                    text.splitlines(keepends=True),
                    fromfile=f"{path} (on disk)",
                    tofile=f"{path} (from the registered tasks)",
                )
                click.echo("".join(diff), nl=False)
                click.echo(f"error: {path} is stale; run `sqla-outbox catalog write`", err=True)
                sys.exit(EXIT_CHECK_FAILED)
            click.echo(f"{path} is up to date ({len(registry.tasks)} tasks)")
            return
        path.write_text(text, encoding="utf-8")
        click.echo(f"wrote {path} ({len(registry.tasks)} tasks)")


@main.command("config")
@click.option("--json", "as_json", is_flag=True, help="Print the settings as JSON.")
@click.option("--reference", is_flag=True, help="Print the configuration reference (Markdown).")
def config_command(as_json: bool, reference: bool) -> None:
    """Show the settings in effect here (from the environment; passwords and keys masked)."""
    from sqla_outbox.config import reference_markdown

    if reference:
        click.echo(reference_markdown(), nl=False)
        return
    with handle_errors(False):
        values = OutboxSettings.from_env().redacted()
    if as_json:
        print_json(values)
        return
    from rich.table import Table

    table = Table(title="sqla_outbox settings")
    table.add_column("setting")
    table.add_column("value")
    table.add_column("environment")
    for name, value in values.items():
        shown = ",".join(value) if isinstance(value, (list, tuple)) else str(value)
        table.add_row(name, shown, env_names(name)[0])
    console().print(table)


def _split(value: Any) -> tuple[str, ...] | None:
    if value is None:
        return None
    if isinstance(value, (list, tuple)):
        value = ",".join(value)
    return tuple(part.strip() for part in str(value).split(",") if part.strip())


def main_worker() -> None:
    """``python -m sqla_outbox.worker`` / ``sqla-outbox-worker``."""
    worker_command.main(args=sys.argv[1:], prog_name="python -m sqla_outbox.worker")


def main_relay() -> None:
    """``python -m sqla_outbox.relay`` / ``sqla-outbox-relay``."""
    relay_command.main(args=sys.argv[1:], prog_name="python -m sqla_outbox.relay")


# Command modules that attach to ``main`` (imported last: they import ``main`` from here).
from sqla_outbox import demo as _demo  # noqa: E402,F401
from sqla_outbox.ops import cli as _ops_cli  # noqa: E402,F401
