"""``python -m sqla_outbox runs show|list|cancel``: runs and their trail; cancel runs."""

from __future__ import annotations

import datetime as dt
import json
import sys
import uuid
from pathlib import Path
from typing import Any

import click

from sqla_outbox.cli.options import (
    EXIT_CHECK_FAILED,
    common_options,
    duration,
    handle_errors,
    json_option,
    load_settings,
    outbox_connection,
    queue_names,
    refuse_unknown_names,
    setup_logging,
    tenant,
)
from sqla_outbox.cli.terminal import console, grid, jsonable, print_json, styled, table, text, when
from sqla_outbox.ops.durations import format_age
from sqla_outbox.types import RUN_STATUSES, UNFINISHED_STATUSES


@click.group("runs")
def runs_group() -> None:
    """Runs and their trail (task_runs, task_run_trail)."""


def _run_id_or_prefix(ctx: click.Context, param: click.Parameter, value: str) -> uuid.UUID | str:
    """A whole run id, or the first hex digits of one (resolved against the database)."""
    from sqla_outbox.ops.runs import run_id_range

    try:
        return uuid.UUID(value)
    except ValueError:
        pass
    try:
        run_id_range(value)
    except ValueError:
        raise click.BadParameter(f"{value!r} is neither a run id nor the start of one (hex digits)") from None
    return value


@runs_group.command("show")
@click.argument("run_id", callback=_run_id_or_prefix)
@common_options
@click.option("--with-tracebacks", is_flag=True, help="Also print the traceback excerpt of each failure.")
@json_option
def runs_show_command(
    run_id: uuid.UUID | str,
    verbose: int,
    log_format: str,
    traceback: bool,
    with_tracebacks: bool,
    as_json: bool,
    **options: Any,
) -> None:
    """Show one run and every status change and error of its trail.

    RUN_ID is a run id, or its first hex digits when they name one run only. Exit code 1
    when there is no such run, 2 when several runs start with the digits given.
    """
    setup_logging(verbose, log_format)
    with handle_errors(traceback):
        from sqla_outbox import errors
        from sqla_outbox.ops import runs

        settings = load_settings(**options)
        with outbox_connection(settings) as connection:
            if isinstance(run_id, str):
                found = runs.list_runs(connection, runs.RunFilter(run_id_prefix=run_id, limit=3))
                if not found:
                    raise errors.OutboxError(f"no run starts with {run_id!r}")
                if len(found) > 1:
                    shown = ", ".join(str(r.run_id) for r in found[:2])
                    raise errors.ConfigurationError(
                        f"several runs start with {run_id!r} ({shown}, ...): give more digits",
                        option="RUN_ID",
                    )
                run_id = found[0].run_id
            detail = runs.get_run(connection, run_id, with_traceback=with_tracebacks)
        if as_json:
            print_json(jsonable(detail))
            return
        _render_run(detail, with_tracebacks)


def _render_run(detail: Any, with_tracebacks: bool) -> None:
    out = console()
    run = detail.run
    shown_run = grid()
    shown_run.add_column(style="bold")
    shown_run.add_column()
    rows = [
        ("run_id", str(run.run_id)),
        ("task", run.task + (f" (event {run.event})" if run.event else "")),
        ("queue", run.queue),
        ("tenant", text(run.tenant_id)),
        ("status", f"{run.status} (outbox row parked: SQS refused it)" if run.parked else run.status),
        ("attempts", str(run.attempts)),
        ("idempotency key", text(run.idempotency_key)),
        ("created", f"{when(run.created_at)} ({format_age(run.age_seconds)} ago)"),
        ("available", when(run.available_at)),
        ("started", when(run.started_at)),
        ("finished", when(run.finished_at)),
        ("dead-lettered", when(run.dead_lettered_at)),
        (
            "lease",
            f"{text(run.lease_owner)} until {when(run.lease_expires_at)}" if run.lease_owner else "-",
        ),
        (
            "earlier attempt's error" if run.status == "succeeded" else "last error",
            f"{run.last_error_type}: {run.last_error}" if run.last_error_type else "-",
        ),
        ("cancel requested", when(run.cancel_requested_at)),
        ("result", "-" if run.result is None else text(_shortened(json.dumps(run.result)))),
    ]
    for key, value in rows:
        shown_run.add_row(key, value)
    out.print(shown_run)
    shown = table(
        "Trail",
        ("at (UTC)", "status", "attempt", "receive", "worker", "error type", "error message", "detail"),
    )
    for t in detail.trail:
        shown.add_row(
            when(t.at),
            t.status,
            text(t.attempt),
            text(t.receive_count),
            text(t.worker_id),
            text(t.error_type),
            text(t.error_message),
            ", ".join(f"{k}={v}" for k, v in (t.detail or {}).items()) or "-",
        )
    out.print(shown)
    if with_tracebacks:
        for t in detail.trail:
            if t.traceback:
                out.rule(f"traceback, attempt {text(t.attempt)} ({when(t.at)})")
                out.print(t.traceback, markup=False, highlight=False)


RESULT_SHOWN_CHARS = 2000
"""``runs show`` prints at most this much of a result (``--json`` prints all of it)."""


def _shortened(value: str) -> str:
    if len(value) <= RESULT_SHOWN_CHARS:
        return value
    return f"{value[:RESULT_SHOWN_CHARS]}… ({len(value)} characters; --json shows all)"


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
@click.option("--queue", "queues", multiple=True, callback=queue_names, help="Only this queue (repeatable).")
@click.option(
    "--tenant",
    "tenant_id",
    callback=tenant,
    metavar="ID|platform",
    help="Only this tenant id, or 'platform' (no tenant).",
)
@click.option(
    "--older-than",
    callback=duration,
    metavar="DURATION",
    help="Only runs created longer ago than this (10m, 2h, 7d).",
)
@click.option(
    "--newer-than", callback=duration, metavar="DURATION", help="Only runs created more recently than this."
)
@click.option(
    "--parked/--not-parked",
    "parked",
    default=None,
    help="Only runs whose outbox row the relay parked (SQS refused the message), or only the others.",
)
@click.option(
    "--limit",
    type=click.IntRange(min=1, max=1_000_000),
    default=50,
    show_default=True,
    help="Most runs shown.",
)
@json_option
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
    parked: bool | None,
    limit: int,
    as_json: bool,
    **options: Any,
) -> None:
    """List runs matching the filters, newest first."""
    setup_logging(verbose, log_format)
    with handle_errors(traceback):
        from sqla_outbox.ops import runs

        settings = load_settings(**options)
        if Path(settings.catalog_path).exists():  # without the catalog, runs may name declared queues
            for queue in queues:
                refuse_unknown_names(settings, task=None, queue=queue)
        filters = runs.RunFilter(
            tasks=tasks,
            statuses=statuses,
            queues=queues,
            tenant_id=tenant_id,
            older_than=older_than,
            newer_than=newer_than,
            limit=limit,
            parked=parked,
        )
        with outbox_connection(settings) as connection:
            found = runs.list_runs(connection, filters)
        if as_json:
            print_json(jsonable(found))
            return
        shown = table(
            f"Runs ({len(found)}{', limit reached' if len(found) == limit else ''})",
            ("run_id", "task", "queue", "tenant", "status", "attempts", "created (UTC)", "age", "last error"),
        )
        for r in found:
            shown.add_row(
                str(r.run_id),
                r.task,
                r.queue,
                text(r.tenant_id),
                f"{r.status} (parked)" if r.parked else r.status,
                str(r.attempts),
                when(r.created_at),
                format_age(r.age_seconds),
                text(r.standing_error_type),
            )
        console().print(shown)


@runs_group.command("cancel")
@common_options
@click.option("--run-id", "run_ids", multiple=True, type=click.UUID, help="This run (repeatable).")
@click.option("--task", help="Runs of this task (with --idempotency-key: the keyed run's task).")
@click.option(
    "--tenant",
    "tenant_id",
    callback=tenant,
    metavar="ID|platform",
    help="Runs of this tenant; with --idempotency-key, the key's tenant ('platform' or absent: none).",
)
@click.option("--idempotency-key", help="The run dispatched with this key (needs --task).")
@click.option(
    "--status",
    "statuses",
    multiple=True,
    type=click.Choice(UNFINISHED_STATUSES),
    help="With --task/--tenant: only runs in this status (repeatable; default all unfinished).",
)
@click.option("--reason", help="Free text recorded in each run's trail (at most 200 characters).")
@click.option("--dry-run", is_flag=True, help="Run the cancel and roll it back: report, change nothing.")
@json_option
def runs_cancel_command(
    verbose: int,
    log_format: str,
    traceback: bool,
    run_ids: tuple[uuid.UUID, ...],
    task: str | None,
    tenant_id: int | str | None,
    idempotency_key: str | None,
    statuses: tuple[str, ...],
    reason: str | None,
    dry_run: bool,
    as_json: bool,
    **options: Any,
) -> None:
    """Cancel runs: queued and retrying runs never run (an unsent message is never sent),
    running runs are asked to stop and end cancelled, finished runs are left alone.

    Choose runs with --run-id, with --task and --idempotency-key (and --tenant), or with
    --task and/or --tenant (every unfinished run of them, narrowed by --status). The
    trail records who cancelled (operator:<user>@<host>). Exit code 1 when a --run-id or
    key names no run. docs/cancellation.md.
    """
    setup_logging(verbose, log_format)
    if not (run_ids or task or tenant_id is not None):
        raise click.UsageError("give --run-id, --task (with or without --idempotency-key) or --tenant")
    if tenant_id == "platform" and idempotency_key is None:
        raise click.UsageError(
            "--tenant platform only goes with --idempotency-key; filter platform runs by --task"
        )
    with handle_errors(traceback):
        from sqla_outbox.cli.options import outbox_engine
        from sqla_outbox.ops import cancel

        settings = load_settings(**options)
        refuse_unknown_names(settings, task=task, queue=None)
        with outbox_engine(settings) as engine:
            report = cancel.cancel_runs(
                engine,
                run_ids=run_ids,
                task=task,
                tenant_id=tenant_id if isinstance(tenant_id, int) else None,
                idempotency_key=idempotency_key,
                statuses=statuses or None,
                reason=reason,
                dry_run=dry_run,
            )
        if as_json:
            print_json(jsonable(report))
        else:
            _render_cancel(report)
        if any(r.outcome.value == "not_found" for r in report.results) or (
            idempotency_key is not None and not report.results
        ):
            sys.exit(EXIT_CHECK_FAILED)


def _render_cancel(report: Any) -> None:
    out = console()
    shown = table(
        f"Cancel{' (dry run: nothing changed)' if report.dry_run else ''}",
        ("run_id", "task", "tenant", "was", "outcome", "message sent", "handler may have acted"),
    )
    for r in report.results:
        outcome = r.outcome.value
        shown.add_row(
            text(r.run_id),
            text(r.task),
            text(r.tenant_id),
            text(r.previous_status),
            outcome if outcome in ("cancelled", "stop_requested") else styled(outcome, "yellow"),
            ("yes: the worker acknowledges it unrun" if r.was_sent else "no")
            if outcome == "cancelled"
            else "-",
            styled("yes", "yellow") if r.external_effects_possible else "no",
        )
    out.print(shown)
    if any(r.external_effects_possible for r in report.results):
        out.print(
            "A handler of the runs marked 'handler may have acted' ran (or runs now): what it did "
            "outside the database before it saw the cancel (an e-mail, a charge) stays done; "
            "only its ctx.session work rolls back."
        )
    verb = "would be" if report.dry_run else "were"
    counts = {
        o: sum(1 for r in report.results if r.outcome.value == o) for o in ("cancelled", "stop_requested")
    }
    out.print(
        f"{counts['cancelled']} run(s) {verb} cancelled, {counts['stop_requested']} running run(s) "
        f"{verb} asked to stop; by {text(report.by)}"
    )
