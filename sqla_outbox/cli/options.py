"""What every command shares: settings options with env twins, exit codes, error handling.

Every option that sets a field of :class:`~sqla_outbox.config.OutboxSettings` names its
environment twin in ``--help``; precedence is option > ``SQLA_OUTBOX_*`` variable > bare
alias (``DATABASE_URL``, ``REDIS_URL``, ``QUEUES``) > default. Exit codes: 0 ok, 1 a check
failed, 2 bad configuration, 3 a service could not be reached.

This module sits below every command module (``sqla_outbox.cli.*``) and imports none of
them.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import click

from sqla_outbox import errors
from sqla_outbox import logging as outbox_logging
from sqla_outbox.cli.terminal import echo
from sqla_outbox.config import OutboxSettings, env_names, redact_text, redact_url
from sqla_outbox.ops.durations import MAX_DURATION_DAYS, parse_duration
from sqla_outbox.types import QUEUE_NAMES, is_queue_name

EXIT_OK = 0
EXIT_CHECK_FAILED = 1
EXIT_CONFIG = 2
EXIT_CONNECT = 3


# --- settings options ------------------------------------------------------------------------
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


def json_option(func: Callable[..., Any]) -> Callable[..., Any]:
    """``--json``: print one JSON document instead of tables (parameter ``as_json``)."""
    return click.option("--json", "as_json", is_flag=True, help="Print one JSON document instead of tables.")(
        func
    )


_loaded: dict[str, str] = {}
"""``database``: the URL (password masked) of the settings the command loaded, for errors."""


def load_settings(**overrides: Any) -> OutboxSettings:
    """Settings from the environment with CLI overrides (``None`` means not given).

    Raises:
        ConfigurationError: A value is invalid (see :meth:`OutboxSettings.from_env`); a
            value given by a flag is named by the flag, not by its environment twin.
    """
    known = {f.name for f in dataclasses.fields(OutboxSettings)}
    given = {k: v for k, v in overrides.items() if k in known and v is not None}
    try:
        settings = OutboxSettings.from_env(**given)
    except errors.ConfigurationError as exc:
        field = next((name for name in given if exc.option == env_names(name)[0]), None)
        if field is None or field not in _FLAGS:
            raise
        message = str(exc).removeprefix(f"{exc.option}: ")
        raise errors.ConfigurationError(message, option=_FLAGS[field]) from None
    _loaded["database"] = redact_url(settings.database_url)
    return settings


def setup_logging(verbose: int, log_format: str) -> None:
    """Send the library's logs to stderr: JSON lines unless stderr is a terminal."""
    json_lines = log_format == "json" or (log_format == "auto" and not sys.stderr.isatty())
    outbox_logging.configure(verbose=verbose, json_lines=json_lines)


# --- option values ---------------------------------------------------------------------------
def split_list(value: Any) -> tuple[str, ...] | None:
    """Option callback helper: ``a,b`` or repeated values as a tuple (None stays None)."""
    if value is None:
        return None
    if isinstance(value, (list, tuple)):
        value = ",".join(value)
    return tuple(part.strip() for part in str(value).split(",") if part.strip())


def duration(ctx: click.Context, param: click.Parameter, value: Any) -> dt.timedelta | None:
    """Option callback: ``10m``, ``2h``, ``7d``, ``1h30m`` (see :mod:`sqla_outbox.ops.durations`)."""
    if value is None or isinstance(value, dt.timedelta):
        return value
    try:
        return parse_duration(str(value))
    except errors.ConfigurationError as exc:
        too_long = "years" in str(exc)
        raise click.BadParameter(
            f"{value!r} is longer than {MAX_DURATION_DAYS // 365} years: check the number"
            if too_long
            else f"{value!r} is not a duration (examples: 90s, 10m, 2h, 7d, 1h30m)",
            ctx,
            param,
        ) from None


def refuse_unknown_names(settings: Any, *, task: str | None, queue: str | None) -> None:
    """Refuse a task or queue the catalog does not know (exit code 2): an operator's pause or
    cancel naming it would match nothing and still report success. Without a catalog file,
    nothing to check.

    Raises:
        ConfigurationError: The task or queue is not in the catalog.
    """
    from sqla_outbox.catalog import Catalog

    if task is not None:
        problem = Catalog.unknown_task_at(settings.catalog_path, task)
        if problem:
            raise errors.ConfigurationError(problem, option="--task")
    if queue is not None and queue not in Catalog.queue_names_at(settings.catalog_path):
        raise errors.ConfigurationError(
            f"no queue {queue!r} among the default queues and the catalog's "
            f"{settings.catalog_path!r} (check the name: it would match nothing)",
            option="--queue",
        )


def tenant(ctx: click.Context, param: click.Parameter, value: Any) -> int | str | None:
    """Option callback: a tenant id, or ``platform`` for runs without a tenant."""
    if value is None or value == "platform":
        return value  # type: ignore[no-any-return]
    try:
        number = int(str(value))
    except ValueError:
        raise click.BadParameter(f"{value!r} is neither a tenant id nor 'platform'", ctx, param) from None
    if not -(2**63) <= number < 2**63:  # tenant_id is a PostgreSQL bigint
        raise click.BadParameter(f"{value!r} is outside the range of a tenant id (bigint)", ctx, param)
    return number


def queue_names(ctx: click.Context, param: click.Parameter, values: tuple[str, ...]) -> tuple[str, ...]:
    """Option callback: each value is a default or declared queue name (filters of rows in
    the database; the catalog is not needed to filter)."""
    for value in values:
        if not is_queue_name(value):
            raise click.BadParameter(
                f"{value!r} is not a queue name (one of {', '.join(QUEUE_NAMES)} or a declared queue: "
                "1..40 letters, digits, '-' and '_')",
                ctx,
                param,
            )
    return values


# --- errors and exit codes -------------------------------------------------------------------
@contextmanager
def handle_errors(show_traceback: bool) -> Iterator[None]:
    """Turn library errors into ``error: <message>`` and the documented exit codes."""
    try:
        yield
    except errors.ConfigurationError as exc:
        if show_traceback:
            raise
        echo(f"error: {exc}", err=True)
        sys.exit(EXIT_CONFIG)
    except errors.OutboxError as exc:
        if show_traceback:
            raise
        echo(f"error: {exc}", err=True)
        sys.exit(EXIT_CHECK_FAILED)
    except BrokenPipeError:
        # the reader of stdout went away (`... --sql | head`): stop quietly, as cat does;
        # point stdout at devnull so the interpreter's final flush does not fail again
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        sys.exit(EXIT_OK)
    except Exception as exc:
        if show_traceback:
            raise
        from sqla_outbox import migrations

        missing_database = _missing_database(exc)
        if missing_database:
            echo(f"error: {missing_database}", err=True)
            sys.exit(EXIT_CONFIG)

        if migrations.is_missing_outbox_table(exc):
            database = _loaded.get("database", "the configured database")
            echo(f"error: {migrations.missing_tables_message(database)}", err=True)
            sys.exit(EXIT_CONFIG)
        if type(exc).__name__ == "NoCredentialsError":  # botocore's: configuration, not a service down
            echo(
                "error: no AWS credentials found (boto3's chain: AWS_ACCESS_KEY_ID and "
                "AWS_SECRET_ACCESS_KEY, ~/.aws, or an instance or task role; for moto, any values)",
                err=True,
            )
            sys.exit(EXIT_CONFIG)
        if is_connection_error(exc):
            echo(f"error: cannot reach a service: {_connection_error_summary(exc)}", err=True)
            sys.exit(EXIT_CONNECT)
        if outbox_logging.is_database_error(exc):
            # its text may quote statement parameters or a row (a payload): say what failed
            # by type, SQLSTATE and constraint only (--traceback shows the rest)
            echo(f"error: the database refused the operation: {outbox_logging.describe_error(exc)}", err=True)
            sys.exit(EXIT_CHECK_FAILED)
        # a bug: the stack helps, but a database error among its causes keeps its text hidden
        echo(outbox_logging.safe_traceback(exc), err=True)
        sys.exit(EXIT_CHECK_FAILED)


def _missing_database(exc: BaseException) -> str | None:
    """The server answered, but the database the URL names does not exist (a configuration
    error, exit 2, not an outage): the message to show, or None."""
    import re

    cause = getattr(exc, "orig", None) or exc
    found = re.search(r'database "([^"]{1,200})" does not exist', str(cause))
    if found is None:
        return None
    return (
        f"database {found.group(1)!r} does not exist on the server of "
        f"{_loaded.get('database', 'the configured URL')}: create it, or point "
        "SQLA_OUTBOX_DATABASE_URL (or DATABASE_URL) at the application's database"
    )


def _connection_error_summary(exc: BaseException) -> str:
    """``<type>: <first line>`` of the driver's own error (SQLAlchemy wraps it in a
    multi-line message with the statement, its parameters and a documentation link);
    passwords masked."""
    cause = getattr(exc, "orig", None) or exc
    lines = [line.strip() for line in str(cause).splitlines() if line.strip()]
    first = lines[0] if lines else ""
    return redact_text(f"{type(cause).__name__}: {first}"[:400])


def is_connection_error(exc: BaseException) -> bool:
    """Whether ``exc`` means PostgreSQL, Valkey or SQS could not be reached (exit 3)."""
    import sqlalchemy.exc

    from sqla_outbox import wakeup
    from sqla_outbox.sqs import client

    return (
        isinstance(exc, (sqlalchemy.exc.OperationalError, sqlalchemy.exc.InterfaceError, ConnectionError))
        or client.is_unreachable(exc)
        or wakeup.is_unreachable(exc)
    )


# --- signals ---------------------------------------------------------------------------------
class Abandon(BaseException):
    """Raised by a second SIGTERM/SIGINT: abandon the work in progress now."""


class StopSignals:
    """SIGTERM/SIGINT as a graceful stop, from the moment a service command starts.

    Made at the start of the command, before settings, task imports and the database
    check: the first signal sets :attr:`requested` instead of ending the process by its
    default action. Once the service exists, :meth:`attach` gives it its ``stop`` (called
    at once if a signal came during start-up); then a second signal raises
    :class:`Abandon` in the main thread. A second signal before :meth:`attach` ends the
    process by the default action (exit status 143 for SIGTERM), so a start-up that hangs
    still yields to a repeated stop. The worker's event loop takes the signals over itself
    and reads :attr:`requested` (``Worker.run(stop_requested=...)``).

    Attributes:
        requested: Set by the first signal.
    """

    def __init__(self) -> None:
        self.requested = threading.Event()
        self._stop: Callable[[], None] | None = None
        signal.signal(signal.SIGTERM, self._handle)
        signal.signal(signal.SIGINT, self._handle)

    def attach(self, stop: Callable[[], None]) -> None:
        """From now on the first signal calls ``stop``; called at once if one came already."""
        self._stop = stop
        if self.requested.is_set():
            stop()

    def _handle(self, signum: int, frame: Any) -> None:
        if not self.requested.is_set():
            self.requested.set()
            if self._stop is not None:
                self._stop()
            return
        if self._stop is not None:
            raise Abandon
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)


# --- connections for the operations commands -------------------------------------------------
@contextmanager
def outbox_engine(settings: OutboxSettings) -> Iterator[Any]:
    """An engine on the outbox database, after checking that the outbox tables exist;
    disposed of when the block ends.

    Raises:
        ConfigurationError: Some outbox table is missing (the database was never migrated).
        sqlalchemy.exc.OperationalError: The database cannot be reached.
    """
    import sqlalchemy as sa

    from sqla_outbox import migrations

    engine = sa.create_engine(
        settings.sqlalchemy_url,
        pool_size=1,
        max_overflow=1,
        hide_parameters=True,  # a failed statement's error never carries an envelope
        connect_args={"connect_timeout": 10, "application_name": "sqla_outbox-ops"},
    )
    try:
        with engine.connect() as connection:
            missing = migrations.missing_tables(connection)
            message = (
                migrations.missing_tables_message(
                    redact_url(settings.database_url), missing, connection=connection
                )
                if missing
                else ""
            )
    except BaseException:
        engine.dispose()
        raise
    if missing:
        engine.dispose()
        raise errors.ConfigurationError(message)
    try:
        yield engine
    finally:
        engine.dispose()


@contextmanager
def outbox_connection(settings: OutboxSettings) -> Iterator[Any]:
    """A connection of :func:`outbox_engine` (same checks), closed when the block ends."""
    with outbox_engine(settings) as engine, engine.connect() as connection:
        yield connection


def sqs_client(settings: OutboxSettings) -> Any:
    """A boto3 SQS client for one-shot operator commands (short timeouts, one retry)."""
    from sqla_outbox.sqs.client import make_client

    return make_client(settings, max_pool_connections=4, read_timeout_seconds=15, max_attempts=2)
