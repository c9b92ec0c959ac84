"""Operations commands of the ``sqla-outbox`` CLI (registered on :data:`sqla_outbox.cli.main`).

::

    sqla-outbox status                     pending rows, runs by status, stale runs, SQS depths
    sqla-outbox runs show RUN_ID           one run and its trail
    sqla-outbox runs list --status failed  runs matching filters
    sqla-outbox dlq list                   dead-lettered messages (never their payloads)
    sqla-outbox dlq requeue --task T       failed runs back to queued, through the outbox
    sqla-outbox purge --dry-run            what maintenance.purge would delete

Every command prints rich tables for humans and, with ``--json``, one JSON document on
stdout for scripts (timestamps ISO 8601 UTC, durations in seconds). Logs go to stderr.
Exit codes are those of :mod:`sqla_outbox.cli`: 0 ok, 1 a check failed (unknown run, a
requested run not requeued), 2 bad option or configuration, 3 a service unreachable.
The logic lives in :mod:`sqla_outbox.ops.status`, :mod:`~sqla_outbox.ops.runs`,
:mod:`~sqla_outbox.ops.dlq`, :mod:`~sqla_outbox.ops.requeue` and
:mod:`sqla_outbox.maintenance`; this module only parses options and renders.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import sys
import uuid
from collections.abc import Callable, Iterable
from typing import Any

import click

from sqla_outbox import errors
from sqla_outbox.cli import (
    EXIT_CHECK_FAILED,
    common_options,
    console,
    handle_errors,
    load_settings,
    main,
    missing_tables_message,
    print_json,
    setting,
    setup_logging,
    styled,
)
from sqla_outbox.config import OutboxSettings, redact_url
from sqla_outbox.ops.durations import format_age, parse_duration
from sqla_outbox.types import QUEUE_NAMES, RUN_STATUSES

# --- option types and helpers -------------------------------------------------------------


def _duration(ctx: click.Context, param: click.Parameter, value: Any) -> dt.timedelta | None:
    """Option callback: ``10m``, ``2h``, ``7d``, ``1h30m`` (see :mod:`sqla_outbox.ops.durations`)."""
    if value is None or isinstance(value, dt.timedelta):
        return value
    try:
        return parse_duration(str(value))
    except errors.ConfigurationError:
        raise click.BadParameter(
            f"{value!r} is not a duration (examples: 90s, 10m, 2h, 7d, 1h30m)", ctx, param
        ) from None


def _tenant(ctx: click.Context, param: click.Parameter, value: Any) -> int | str | None:
    """Option callback: a tenant id, or ``platform`` for runs without a tenant."""
    if value is None or value == "platform":
        return value  # type: ignore[no-any-return]
    try:
        return int(str(value))
    except ValueError:
        raise click.BadParameter(f"{value!r} is neither a tenant id nor 'platform'", ctx, param) from None


QUEUE_CHOICE = click.Choice(QUEUE_NAMES)


def _json_option(func: Callable[..., Any]) -> Callable[..., Any]:
    return click.option("--json", "as_json", is_flag=True, help="Print one JSON document instead of tables.")(
        func
    )


def _jsonable(value: Any) -> Any:
    """Dataclasses, datetimes (ISO 8601), UUIDs and timedeltas (seconds) as JSON values."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _jsonable(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        return [_jsonable(v) for v in value]
    if isinstance(value, dt.datetime):
        return value.astimezone(dt.UTC).isoformat()
    if isinstance(value, dt.timedelta):
        return value.total_seconds()
    if isinstance(value, uuid.UUID):
        return str(value)
    return value


def _console() -> Any:
    return console()


def _table(title: str, columns: Iterable[str]) -> Any:
    from rich.table import Table

    table = Table(title=title, title_justify="left")
    for column in columns:
        table.add_column(column, overflow="fold")
    return table


def _when(value: dt.datetime | None) -> str:
    return "-" if value is None else value.astimezone(dt.UTC).strftime("%Y-%m-%d %H:%M:%S")


def _text(value: Any) -> str:
    return "-" if value is None else str(value)


def _engine(settings: OutboxSettings) -> Any:
    """An engine on the outbox database, after checking that the outbox tables exist.

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
        connect_args={"connect_timeout": 10, "application_name": "sqla_outbox-ops"},
    )
    try:
        with engine.connect() as connection:
            missing = migrations.missing_tables(connection)
    except BaseException:
        engine.dispose()
        raise
    if missing:
        engine.dispose()
        raise errors.ConfigurationError(missing_tables_message(redact_url(settings.database_url), missing))
    return engine


def _sqs(settings: OutboxSettings) -> Any:
    from sqla_outbox.sqs.client import make_client

    return make_client(settings, max_pool_connections=4, read_timeout_seconds=15, max_attempts=2)


def _dlq_filter_options(func: Callable[..., Any]) -> Callable[..., Any]:
    for decorator in reversed(
        [
            click.option("--task", "tasks", multiple=True, help="Only this task (repeatable)."),
            click.option(
                "--queue",
                "queues",
                multiple=True,
                type=QUEUE_CHOICE,
                help="Only this queue's DLQ (repeatable).",
            ),
            click.option(
                "--older-than",
                callback=_duration,
                metavar="DURATION",
                help="Only messages dead-lettered longer ago (10m, 2h, 7d).",
            ),
        ]
    ):
        func = decorator(func)
    return func


# --- status -------------------------------------------------------------------------------


@main.command("status")
@common_options
@click.option(
    "--stale-after",
    callback=_duration,
    metavar="DURATION",
    default="15m",
    show_default=True,
    help="Flag running runs whose lease expired longer ago than this.",
)
@click.option(
    "--sqs/--no-sqs", "with_sqs", default=True, show_default=True, help="Also read the SQS queue depths."
)
@_json_option
def status_command(
    verbose: int,
    log_format: str,
    traceback: bool,
    stale_after: dt.timedelta,
    with_sqs: bool,
    as_json: bool,
    **options: Any,
) -> None:
    """Pending outbox rows, runs by status (stale running runs flagged), queue and DLQ depths."""
    setup_logging(verbose, log_format)
    with handle_errors(traceback):
        from sqla_outbox.ops import status

        settings = load_settings(**options)
        engine = _engine(settings)
        try:
            with engine.connect() as connection:
                report = status.collect(
                    connection,
                    settings,
                    client=_sqs(settings) if with_sqs else None,
                    stale_after_seconds=stale_after.total_seconds(),
                )
        finally:
            engine.dispose()
        if as_json:
            print_json(_jsonable(report))
            return
        _render_status(report)


def _render_status(report: Any) -> None:
    console = _console()
    console.print(f"database time {_when(report.database_time)} UTC")
    if report.pending:
        table = _table(
            "Pending outbox rows",
            ("table", "queue", "pending", "due", "oldest pending", "oldest due (lag)", "max send attempts"),
        )
        for p in report.pending:
            lag = format_age(p.oldest_due_age_seconds)
            table.add_row(
                p.table,
                p.queue,
                str(p.pending),
                str(p.due),
                format_age(p.oldest_pending_age_seconds),
                lag,
                str(p.max_attempts),
            )
        console.print(table)
    else:
        console.print("Pending outbox rows: none")
    runs = _table("Runs by status", ("status", "runs"))
    for name, count in report.runs_by_status.items():
        runs.add_row(name, str(count))
    stale = f"running, lease expired > {format_age(report.stale_after_seconds)}"
    runs.add_row(
        styled(stale, "red") if report.stale_running_count else stale, str(report.stale_running_count)
    )
    console.print(runs)
    if report.stale_running:
        table = _table(
            "Stale running runs", ("run_id", "task", "queue", "tenant", "lease owner", "lease expired")
        )
        for r in report.stale_running:
            table.add_row(
                r.run_id,
                r.task,
                r.queue,
                _text(r.tenant_id),
                _text(r.lease_owner),
                format_age(r.lease_expired_seconds_ago) + " ago",
            )
        console.print(table)
    if report.queues is not None:
        table = _table("SQS queues", ("queue", "SQS name", "kind", "visible", "in flight", "delayed"))
        for q in report.queues:
            kind = "DLQ" if q.dead_letter else "source"
            if q.error:
                table.add_row(q.queue, q.name, kind, styled(q.error, "red"), "", "")
                continue
            visible: Any = str(q.visible)
            if q.dead_letter and q.visible:
                visible = styled(visible, "red")
            table.add_row(q.queue, q.name, kind, visible, str(q.not_visible), str(q.delayed))
        console.print(table)


# --- runs ---------------------------------------------------------------------------------


@main.group("runs")
def runs_group() -> None:
    """Runs and their trail (task_runs, task_run_trail)."""


@runs_group.command("show")
@click.argument("run_id", type=click.UUID)
@common_options
@click.option("--with-tracebacks", is_flag=True, help="Also print the traceback excerpt of each failure.")
@_json_option
def runs_show_command(
    run_id: uuid.UUID,
    verbose: int,
    log_format: str,
    traceback: bool,
    with_tracebacks: bool,
    as_json: bool,
    **options: Any,
) -> None:
    """Show one run and every status change and error of its trail.

    Exit code 1 when there is no such run.
    """
    setup_logging(verbose, log_format)
    with handle_errors(traceback):
        from sqla_outbox.ops import runs

        settings = load_settings(**options)
        engine = _engine(settings)
        try:
            with engine.connect() as connection:
                detail = runs.get_run(connection, run_id, with_traceback=with_tracebacks)
        finally:
            engine.dispose()
        if as_json:
            print_json(_jsonable(detail))
            return
        _render_run(detail, with_tracebacks)


def _render_run(detail: Any, with_tracebacks: bool) -> None:
    from rich.table import Table

    console = _console()
    run = detail.run
    grid = Table.grid(padding=(0, 2))
    grid.add_column(style="bold")
    grid.add_column()
    rows = [
        ("run_id", str(run.run_id)),
        ("task", run.task + (f" (event {run.event})" if run.event else "")),
        ("queue", run.queue),
        ("tenant", _text(run.tenant_id)),
        ("status", run.status),
        ("attempts", str(run.attempts)),
        ("idempotency key", _text(run.idempotency_key)),
        ("created", f"{_when(run.created_at)} ({format_age(run.age_seconds)} ago)"),
        ("available", _when(run.available_at)),
        ("started", _when(run.started_at)),
        ("finished", _when(run.finished_at)),
        ("dead-lettered", _when(run.dead_lettered_at)),
        (
            "lease",
            f"{_text(run.lease_owner)} until {_when(run.lease_expires_at)}" if run.lease_owner else "-",
        ),
        ("last error", f"{run.last_error_type}: {run.last_error}" if run.last_error_type else "-"),
    ]
    for key, value in rows:
        grid.add_row(key, value)
    console.print(grid)
    table = _table(
        "Trail",
        ("at (UTC)", "status", "attempt", "receive", "worker", "error type", "error message", "detail"),
    )
    for t in detail.trail:
        table.add_row(
            _when(t.at),
            t.status,
            _text(t.attempt),
            _text(t.receive_count),
            _text(t.worker_id),
            _text(t.error_type),
            _text(t.error_message),
            ", ".join(f"{k}={v}" for k, v in (t.detail or {}).items()) or "-",
        )
    console.print(table)
    if with_tracebacks:
        for t in detail.trail:
            if t.traceback:
                console.rule(f"traceback, attempt {_text(t.attempt)} ({_when(t.at)})")
                console.print(t.traceback, markup=False, highlight=False)


@runs_group.command("list")
@common_options
@click.option("--task", "tasks", multiple=True, help="Only this task (repeatable).")
@click.option(
    "--status",
    "statuses",
    multiple=True,
    type=click.Choice(RUN_STATUSES),
    help="Only this status (repeatable).",
)
@click.option("--queue", "queues", multiple=True, type=QUEUE_CHOICE, help="Only this queue (repeatable).")
@click.option(
    "--tenant",
    "tenant_id",
    callback=_tenant,
    metavar="ID|platform",
    help="Only this tenant id, or 'platform' (no tenant).",
)
@click.option(
    "--older-than",
    callback=_duration,
    metavar="DURATION",
    help="Only runs created longer ago than this (10m, 2h, 7d).",
)
@click.option(
    "--newer-than", callback=_duration, metavar="DURATION", help="Only runs created more recently than this."
)
@click.option("--limit", type=click.IntRange(min=1), default=50, show_default=True, help="Most runs shown.")
@_json_option
def runs_list_command(
    verbose: int,
    log_format: str,
    traceback: bool,
    tasks: tuple[str, ...],
    statuses: tuple[str, ...],
    queues: tuple[str, ...],
    tenant_id: int | str | None,
    older_than: dt.timedelta | None,
    newer_than: dt.timedelta | None,
    limit: int,
    as_json: bool,
    **options: Any,
) -> None:
    """List runs matching the filters, newest first."""
    setup_logging(verbose, log_format)
    with handle_errors(traceback):
        from sqla_outbox.ops import runs

        settings = load_settings(**options)
        filters = runs.RunFilter(
            tasks=tasks,
            statuses=statuses,
            queues=queues,
            tenant_id=tenant_id,
            older_than=older_than,
            newer_than=newer_than,
            limit=limit,
        )
        engine = _engine(settings)
        try:
            with engine.connect() as connection:
                found = runs.list_runs(connection, filters)
        finally:
            engine.dispose()
        if as_json:
            print_json(_jsonable(found))
            return
        table = _table(
            f"Runs ({len(found)}{', limit reached' if len(found) == limit else ''})",
            ("run_id", "task", "queue", "tenant", "status", "attempts", "created (UTC)", "age", "last error"),
        )
        for r in found:
            table.add_row(
                str(r.run_id),
                r.task,
                r.queue,
                _text(r.tenant_id),
                r.status,
                str(r.attempts),
                _when(r.created_at),
                format_age(r.age_seconds),
                _text(r.last_error_type),
            )
        _console().print(table)


# --- dlq ----------------------------------------------------------------------------------


@main.group("dlq")
def dlq_group() -> None:
    """Dead-letter queues: list their messages, requeue failed runs."""


@dlq_group.command("list")
@common_options
@_dlq_filter_options
@click.option(
    "--limit", type=click.IntRange(min=1), default=200, show_default=True, help="Most messages shown."
)
@_json_option
def dlq_list_command(
    verbose: int,
    log_format: str,
    traceback: bool,
    tasks: tuple[str, ...],
    queues: tuple[str, ...],
    older_than: dt.timedelta | None,
    limit: int,
    as_json: bool,
    **options: Any,
) -> None:
    """List DLQ messages: run, task, tenant, reason, error type and age; never payloads.

    Messages are received with a 30 s visibility and made visible again at the end;
    nothing is deleted. The run's current status is read from the database.
    """
    setup_logging(verbose, log_format)
    with handle_errors(traceback):
        from sqla_outbox.ops import dlq

        settings = load_settings(**options)
        filters = dlq.DeadLetterFilter(tasks=tasks, queues=queues, older_than=older_than)
        engine = _engine(settings)
        try:
            with engine.connect() as connection:
                listing = dlq.list_dead_letters(
                    _sqs(settings), settings, filters, connection=connection, limit=limit
                )
        finally:
            engine.dispose()
        if as_json:
            print_json(_jsonable(listing))
            return
        table = _table(
            f"DLQ messages ({len(listing.letters)}{', truncated' if listing.truncated else ''})",
            ("queue", "run_id", "task", "tenant", "reason", "error type", "age", "run status"),
        )
        for x in listing.letters:
            table.add_row(
                x.queue,
                _text(x.run_id),
                _text(x.task),
                _text(x.tenant_id),
                x.reason,
                _text(x.error_type),
                format_age(x.age_seconds),
                _text(x.run_status),
            )
        console = _console()
        console.print(table)
        for name in listing.missing_queues:
            console.print(styled(f"missing DLQ {name} (run `sqla-outbox provision`)", "yellow"))


@dlq_group.command("requeue")
@common_options
@_dlq_filter_options
@click.option(
    "--run-id",
    "run_ids",
    multiple=True,
    type=click.UUID,
    help="Only this run (repeatable); found in the DLQs, or requeued from the database when its "
    "DLQ message is gone.",
)
@click.option(
    "--all", "select_all", is_flag=True, help="Requeue every failed run in the DLQs (no other filter needed)."
)
@click.option("--dry-run", is_flag=True, help="Decide and report; change nothing.")
@_json_option
def dlq_requeue_command(
    verbose: int,
    log_format: str,
    traceback: bool,
    tasks: tuple[str, ...],
    queues: tuple[str, ...],
    older_than: dt.timedelta | None,
    run_ids: tuple[uuid.UUID, ...],
    select_all: bool,
    dry_run: bool,
    as_json: bool,
    **options: Any,
) -> None:
    """Put failed runs back to queued through the outbox, then delete their DLQ messages.

    Only runs whose status is `failed` are requeued; others are reported as skipped
    with the reason. Give at least one filter, or --all. Exit code 1 when a --run-id
    was not requeued.
    """
    setup_logging(verbose, log_format)
    if not (tasks or queues or older_than or run_ids or select_all):
        raise click.UsageError("give --task, --queue, --older-than or --run-id to choose runs, or --all")
    with handle_errors(traceback):
        from sqla_outbox.ops import dlq, requeue
        from sqla_outbox.wakeup import Waker

        settings = load_settings(**options)
        filters = dlq.DeadLetterFilter(
            tasks=tasks, queues=queues, older_than=older_than, run_ids=frozenset(run_ids)
        )
        engine = _engine(settings)
        waker = None if dry_run else Waker(settings)
        try:
            report = requeue.requeue(engine, _sqs(settings), settings, filters, dry_run=dry_run, waker=waker)
        finally:
            engine.dispose()
            if waker is not None:
                waker.close()
        if as_json:
            document = _jsonable(report)
            document.update(requeued=report.requeued, skipped=report.skipped)
            print_json(document)
        else:
            _render_requeue(report)
        selected = {item.run_id for item in report.items if item.selected}
        if any(run_id not in selected for run_id in run_ids):
            sys.exit(EXIT_CHECK_FAILED)


def _render_requeue(report: Any) -> None:
    console = _console()
    verb = "would requeue" if report.dry_run else "requeued"
    table = _table(
        f"DLQ requeue{' (dry run: nothing changed)' if report.dry_run else ''}",
        ("run_id", "task", "queue", "tenant", "action", "outbox", "DLQ copies", "reason"),
    )
    for item in report.items:
        action = item.action if item.selected else styled(item.action, "yellow")
        copies = f"{item.dlq_deleted}/{len(item.dlq_message_ids)} deleted" if item.dlq_message_ids else "-"
        why = f"{item.reason}: {item.detail}" if item.reason else "-"
        table.add_row(
            _text(item.run_id),
            _text(item.task),
            _text(item.queue),
            _text(item.tenant_id),
            action,
            _text(item.outbox),
            copies,
            why,
        )
    console.print(table)
    wake = ""
    if report.requeued and not report.dry_run:  # the note is about the runs just requeued
        wake = " (relay woken)" if report.woke else " (the relay's sweep will send them)"
    console.print(f"{verb} {report.requeued}, skipped {report.skipped}{wake}")
    for name in report.missing_queues:
        console.print(styled(f"missing DLQ {name} (run `sqla-outbox provision`)", "yellow"))


# --- purge --------------------------------------------------------------------------------


@main.command("purge")
@common_options
@setting("purge_sent_after_days", "--sent-after-days", type=float)
@setting("purge_succeeded_after_days", "--succeeded-after-days", type=float)
@setting("purge_failed_after_days", "--failed-after-days", type=float)
@setting("purge_batch_size", "--batch-size", type=int)
@click.option("--dry-run", is_flag=True, help="Count what would be deleted; delete nothing.")
@_json_option
def purge_command(
    verbose: int, log_format: str, traceback: bool, dry_run: bool, as_json: bool, **options: Any
) -> None:
    """Run maintenance.purge now: delete sent outbox rows and finished runs past retention.

    Pending outbox rows and unfinished runs are never deleted. Batches use
    FOR UPDATE SKIP LOCKED, so the relay and workers are never blocked.
    """
    setup_logging(verbose, log_format)
    with handle_errors(traceback):
        from sqla_outbox import maintenance

        settings = load_settings(**options)
        engine = _engine(settings)
        try:
            report = maintenance.purge(engine, settings, dry_run=dry_run)
        finally:
            engine.dispose()
        if as_json:
            document = _jsonable(report)
            document["deleted"] = report.deleted
            print_json(document)
            return
        title = "Purge (dry run: nothing deleted)" if dry_run else "Purge"
        table = _table(
            title,
            (
                "category",
                "older than (UTC)",
                "would delete" if dry_run else "deleted",
                "trail rows",
                "batches",
            ),
        )
        for c in report.counts:
            table.add_row(c.category, _when(c.cutoff), str(c.deleted), str(c.trail_rows), str(c.batches))
        console = _console()
        console.print(table)
        console.print(f"batch size {report.batch_size}, {report.duration_ms:.0f} ms")
