"""``python -m sqla_outbox outbox parked|unpark|resend``: outbox rows that never reached a worker."""

from __future__ import annotations

import datetime as dt
import sys
import uuid
from collections.abc import Callable
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
    outbox_engine,
    queue_names,
    setup_logging,
)
from sqla_outbox.cli.terminal import console, jsonable, print_json, styled, table, text, when


def _selection_options(func: Callable[..., Any]) -> Callable[..., Any]:
    for decorator in reversed(
        [
            click.option(
                "--run-id", "run_ids", multiple=True, type=click.UUID, help="Only this run (repeatable)."
            ),
            click.option("--task", "tasks", multiple=True, help="Only this task (repeatable)."),
            click.option(
                "--queue", "queues", multiple=True, callback=queue_names, help="Only this queue (repeatable)."
            ),
        ]
    ):
        func = decorator(func)
    return func


@click.group("outbox")
def outbox_group() -> None:
    """Outbox rows whose message never reached a worker: parked rows, expired messages."""


@outbox_group.command("parked")
@common_options
@_selection_options
@json_option
def parked_command(
    verbose: int,
    log_format: str,
    traceback: bool,
    run_ids: tuple[uuid.UUID, ...],
    tasks: tuple[str, ...],
    queues: tuple[str, ...],
    as_json: bool,
    **options: Any,
) -> None:
    """List parked outbox rows: messages SQS refused for good, with the SQS error; never payloads."""
    setup_logging(verbose, log_format)
    with handle_errors(traceback):
        from sqla_outbox.ops import resend

        settings = load_settings(**options)
        selection = resend.Selection(run_ids=run_ids, tasks=tasks, queues=queues)
        with outbox_connection(settings) as connection:
            found = resend.parked_runs(connection, selection)
        if as_json:
            print_json(jsonable(found))
            return
        shown = table(
            f"Parked outbox rows ({len(found)})",
            ("run_id", "task", "queue", "tenant", "run status", "parked at (UTC)", "SQS error"),
        )
        for p in found:
            shown.add_row(
                str(p.run_id),
                p.task,
                p.queue,
                text(p.tenant_id),
                p.status,
                when(p.parked_at),
                text(p.last_error),
            )
        console().print(shown)


@outbox_group.command("unpark")
@common_options
@_selection_options
@click.option("--all", "select_all", is_flag=True, help="Every parked row (no other filter needed).")
@click.option("--dry-run", is_flag=True, help="Decide and report; change nothing.")
@json_option
def unpark_command(
    verbose: int,
    log_format: str,
    traceback: bool,
    run_ids: tuple[uuid.UUID, ...],
    tasks: tuple[str, ...],
    queues: tuple[str, ...],
    select_all: bool,
    dry_run: bool,
    as_json: bool,
    **options: Any,
) -> None:
    """Put parked rows back to pending (after fixing why SQS refused them); their runs become queued.

    Only parked rows of failed runs are unparked, and not when another unfinished run holds
    the run's idempotency key; others are reported as skipped with the reason. Give at
    least one filter, or --all. Exit code 1 when a --run-id was not unparked.
    """
    _put_back(
        "unpark",
        lambda engine, selection, waker: _resend().unpark(engine, selection, dry_run=dry_run, waker=waker),
        verbose=verbose,
        log_format=log_format,
        traceback=traceback,
        selection=(run_ids, tasks, queues, select_all),
        dry_run=dry_run,
        as_json=as_json,
        options=options,
    )


@outbox_group.command("resend")
@common_options
@_selection_options
@click.option(
    "--older-than",
    callback=duration,
    metavar="DURATION",
    default="1d",
    show_default=True,
    help="Only runs whose message has waited in SQS at least this long.",
)
@click.option("--all", "select_all", is_flag=True, help="Every unreceived run (no other filter needed).")
@click.option("--dry-run", is_flag=True, help="Decide and report; change nothing.")
@json_option
def resend_command(
    verbose: int,
    log_format: str,
    traceback: bool,
    run_ids: tuple[uuid.UUID, ...],
    tasks: tuple[str, ...],
    queues: tuple[str, ...],
    older_than: dt.timedelta,
    select_all: bool,
    dry_run: bool,
    as_json: bool,
    **options: Any,
) -> None:
    """Send queued runs again whose message has waited in SQS longer than --older-than.

    SQS drops a message its queue kept longer than its retention period without telling
    anyone; `status` flags such runs (unreceived). Resending makes their outbox rows
    pending again; the relay sends them. A message that was only late, not gone, still
    runs its run once (the second copy is acknowledged). Give at least one filter, or
    --all. Exit code 1 when a --run-id was not resent.
    """
    _put_back(
        "resend",
        lambda engine, selection, waker: _resend().resend_unreceived(
            engine, selection, older_than=older_than, dry_run=dry_run, waker=waker
        ),
        verbose=verbose,
        log_format=log_format,
        traceback=traceback,
        selection=(run_ids, tasks, queues, select_all),
        dry_run=dry_run,
        as_json=as_json,
        options=options,
    )


def _resend() -> Any:
    from sqla_outbox.ops import resend

    return resend


def _put_back(
    name: str,
    work: Callable[[Any, Any, Any], Any],
    *,
    verbose: int,
    log_format: str,
    traceback: bool,
    selection: tuple[tuple[uuid.UUID, ...], tuple[str, ...], tuple[str, ...], bool],
    dry_run: bool,
    as_json: bool,
    options: dict[str, Any],
) -> None:
    """What unpark and resend share: the selection, the waker, the report, the exit code."""
    setup_logging(verbose, log_format)
    run_ids, tasks, queues, select_all = selection
    if not (run_ids or tasks or queues or select_all):
        raise click.UsageError("give --run-id, --task or --queue to choose runs, or --all")
    with handle_errors(traceback):
        from sqla_outbox.wakeup import Waker

        settings = load_settings(**options)
        chosen = _resend().Selection(run_ids=run_ids, tasks=tasks, queues=queues)
        waker = None if dry_run else Waker(settings)
        try:
            with outbox_engine(settings) as engine:
                report = work(engine, chosen, waker)
        finally:
            if waker is not None:
                waker.close()
        _show(report, as_json, name, {"unpark": "unparked", "resend": "resent"}[name])
        selected = {item.run_id for item in report.items if item.selected}
        if any(run_id not in selected for run_id in run_ids):
            sys.exit(EXIT_CHECK_FAILED)


def _show(report: Any, as_json: bool, name: str, verb: str) -> None:
    if as_json:
        document = jsonable(report)
        document.update(done=report.done, skipped=report.skipped)
        print_json(document)
        return
    out = console()
    shown = table(
        f"outbox {name}{' (dry run: nothing changed)' if report.dry_run else ''}",
        ("run_id", "task", "queue", "tenant", "action", "reason"),
    )
    for item in report.items:
        action = item.action if item.selected else styled(item.action, "yellow")
        why = f"{item.reason}: {item.detail}" if item.reason else "-"
        shown.add_row(str(item.run_id), text(item.task), text(item.queue), text(item.tenant_id), action, why)
    out.print(shown)
    wake = ""
    if report.done and not report.dry_run:
        wake = " (relay woken)" if report.woke else " (the relay's sweep will send them)"
    out.print(f"{'would be ' if report.dry_run else ''}{verb} {report.done}, skipped {report.skipped}{wake}")
