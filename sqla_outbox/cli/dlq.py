"""``python -m sqla_outbox dlq list|requeue``: dead-lettered messages, and requeueing failed runs."""

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
    refuse_unknown_names,
    setup_logging,
    sqs_client,
)
from sqla_outbox.cli.terminal import console, jsonable, print_json, styled, table, text
from sqla_outbox.ops.durations import format_age


def _dlq_filter_options(func: Callable[..., Any]) -> Callable[..., Any]:
    for decorator in reversed(
        [
            click.option("--task", "tasks", multiple=True, help="Only this task (repeatable)."),
            click.option(
                "--queue",
                "queues",
                multiple=True,
                callback=queue_names,
                help="Only this queue's DLQ (repeatable).",
            ),
            click.option(
                "--older-than",
                callback=duration,
                metavar="DURATION",
                help="Only messages dead-lettered longer ago (10m, 2h, 7d).",
            ),
        ]
    ):
        func = decorator(func)
    return func


@click.group("dlq")
def dlq_group() -> None:
    """Dead-letter queues: list their messages, requeue failed runs."""


@dlq_group.command("list")
@common_options
@_dlq_filter_options
@click.option(
    "--limit",
    type=click.IntRange(min=1, max=1_000_000),
    default=200,
    show_default=True,
    help="Most messages shown.",
)
@json_option
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
    """List DLQ messages: run, task, tenant, reason, error type, age and origin; never payloads.

    Messages are received with a 30 s visibility and made visible again at the end;
    nothing is deleted. Each message is checked against the database: the task, tenant
    and status shown, and what --task and --older-than match, are the run's own (its row),
    not the message's attributes, which whoever sent it wrote. Origin: `verified` (the
    relay's signature checks out under SQLA_OUTBOX_SIGNING_KEYS), `ledger` (the body is
    the envelope the run's outbox row holds) or `unverified` (nothing vouches for it);
    what a message claims that its run contradicts is shown beside the origin. The
    reason and error type are the message's; control characters are shown escaped.
    """
    setup_logging(verbose, log_format)
    with handle_errors(traceback):
        from sqla_outbox.ops import dlq

        settings = load_settings(**options)
        for queue in queues:  # an unknown queue has no DLQ to read: it would list nothing
            refuse_unknown_names(settings, task=None, queue=queue)
        filters = dlq.DeadLetterFilter(
            tasks=tasks, queues=queues, older_than=older_than, known=_known_queues(settings)
        )
        with outbox_connection(settings) as connection:
            listing = dlq.list_dead_letters(
                sqs_client(settings), settings, filters, connection=connection, limit=limit
            )
        if as_json:
            print_json(jsonable(listing))
            return
        shown = table(
            f"DLQ messages ({len(listing.letters)}{', truncated' if listing.truncated else ''})",
            ("queue", "run_id", "task", "tenant", "reason", "error type", "age", "run status", "origin"),
        )
        for x in listing.letters:
            shown.add_row(
                x.queue,
                text(x.run_id),
                text(x.task),
                text(x.tenant_id),
                text(x.reason),
                text(x.error_type),
                format_age(x.age_seconds),
                text(x.run_status),
                _origin(x),
            )
        out = console()
        out.print(shown)
        for name in listing.missing_queues:
            out.print(styled(f"missing DLQ {name} (run `python -m sqla_outbox provision`)", "yellow"))


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
@click.option(
    "--trust-dlq-body",
    is_flag=True,
    help="Without signing keys: rebuild a purged outbox row from the DLQ body, which nothing can "
    "verify (whoever may send to the queue or its DLQ chose it). Needs every copy to agree. "
    "No effect with SQLA_OUTBOX_SIGNING_KEYS: only signed bodies are used then.",
)
@click.option(
    "--include-no-reason",
    is_flag=True,
    help="Also act on DLQ messages without a worker verdict (moved by the SQS redrive policy, or "
    "sent straight to the DLQ).",
)
@click.option(
    "--include-unverified",
    is_flag=True,
    help="Without signing keys: also act on copies nothing vouches for (not the envelope of the "
    "run's outbox row, or the row was purged). The run is still requeued from its own row.",
)
@click.option("--dry-run", is_flag=True, help="Decide and report; change nothing.")
@json_option
def dlq_requeue_command(
    verbose: int,
    log_format: str,
    traceback: bool,
    tasks: tuple[str, ...],
    queues: tuple[str, ...],
    older_than: dt.timedelta | None,
    run_ids: tuple[uuid.UUID, ...],
    select_all: bool,
    trust_dlq_body: bool,
    include_no_reason: bool,
    include_unverified: bool,
    dry_run: bool,
    as_json: bool,
    **options: Any,
) -> None:
    """Put failed runs back to queued through the outbox, then delete their DLQ messages.

    Only runs whose status is `failed` are requeued; others are reported as skipped
    with the reason. --task, --queue and --older-than match the run's own row, never
    the DLQ message's attributes, and select every dead-lettered run the database
    knows: one whose DLQ message another reader holds is requeued from its outbox row.
    The run's outbox row is sent again; a purged row is
    rebuilt from a DLQ body only when its signature verifies (SQLA_OUTBOX_SIGNING_KEYS),
    or, without keys, with --trust-dlq-body. Messages the worker refused unexecuted,
    unsigned or badly signed ones (with keys), unverified copies (without keys, unless
    --include-unverified) and, unless --include-no-reason, ones without a verdict are
    never acted on. Give at least one filter, or --all. Exit code 1 when a --run-id was
    not requeued.
    """
    setup_logging(verbose, log_format)
    if not (tasks or queues or older_than or run_ids or select_all):
        raise click.UsageError("give --task, --queue, --older-than or --run-id to choose runs, or --all")
    with handle_errors(traceback):
        from sqla_outbox.ops import dlq, requeue
        from sqla_outbox.wakeup import Waker

        settings = load_settings(**options)
        for queue in queues:  # an unknown queue has no DLQ to read: it would requeue nothing
            refuse_unknown_names(settings, task=None, queue=queue)
        filters = dlq.DeadLetterFilter(
            tasks=tasks,
            queues=queues,
            older_than=older_than,
            run_ids=frozenset(run_ids),
            known=_known_queues(settings),
        )
        waker = None if dry_run else Waker(settings)
        try:
            with outbox_engine(settings) as engine:
                report = requeue.requeue(
                    engine,
                    sqs_client(settings),
                    settings,
                    filters,
                    dry_run=dry_run,
                    waker=waker,
                    trust_dlq_body=trust_dlq_body,
                    include_no_reason=include_no_reason,
                    include_unverified=include_unverified,
                )
        finally:
            if waker is not None:
                waker.close()
        if as_json:
            document = jsonable(report)
            document.update(
                requeued=report.requeued,
                skipped=report.skipped,
                rebuilt_unchecked=report.rebuilt_unchecked,
                unreachable=report.unreachable,
            )
            print_json(document)
        else:
            _render_requeue(report)
        selected = {item.run_id for item in report.items if item.selected}
        if any(run_id not in selected for run_id in run_ids):
            sys.exit(EXIT_CHECK_FAILED)


def _render_requeue(report: Any) -> None:
    out = console()
    verb = "would requeue" if report.dry_run else "requeued"
    shown = table(
        f"DLQ requeue{' (dry run: nothing changed)' if report.dry_run else ''}",
        ("run_id", "task", "queue", "tenant", "action", "outbox", "DLQ copies", "reason"),
    )
    for item in report.items:
        action = item.action if item.selected else styled(item.action, "yellow")
        copies = f"{item.dlq_deleted}/{len(item.dlq_message_ids)} deleted" if item.dlq_message_ids else "-"
        why = f"{item.reason}: {item.detail}" if item.reason else "-"
        outbox = text(item.outbox) + (f" ({item.body_origin} body)" if item.body_origin else "")
        shown.add_row(
            text(item.run_id),
            text(item.task),
            text(item.queue),
            text(item.tenant_id),
            action,
            outbox,
            copies,
            why,
        )
    out.print(shown)
    wake = ""
    if report.requeued and not report.dry_run:  # the note is about the runs just requeued
        wake = " (relay woken)" if report.woke else " (the relay's sweep will send them)"
    out.print(f"{verb} {report.requeued}, skipped {report.skipped}{wake}")
    if report.not_received_note:
        out.print(report.not_received_note)
    if report.rebuilt_unchecked:
        out.print(
            styled(
                f"{report.rebuilt_unchecked} outbox row(s) rebuilt from DLQ bodies nothing could verify "
                "(--trust-dlq-body, no signing keys): their payloads are whatever the DLQ held, "
                "written by whoever could send to the queue or its DLQ",
                "yellow",
            )
        )
    for name in report.missing_queues:
        out.print(styled(f"missing DLQ {name} (run `python -m sqla_outbox provision`)", "yellow"))


def _origin(letter: Any) -> Any:
    """The origin column: ``unverified`` in red, and what the message claims that its run's
    row contradicts (``claims task='audit'``)."""
    claims = " ".join(f"{name}={value!r}" for name, value in letter.claims)
    shown = letter.origin + (f" (claims {claims})" if claims else "")
    return text(shown) if letter.origin != "unverified" else styled(shown, "red")


def _known_queues(settings: Any) -> tuple[str, ...]:
    """The four queues plus those the catalog at ``catalog_path`` declares (if any)."""
    from sqla_outbox.catalog import Catalog

    return Catalog.queue_names_at(settings.catalog_path)
