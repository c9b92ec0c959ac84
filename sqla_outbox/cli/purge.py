"""``python -m sqla_outbox purge``: run maintenance.purge now (or count with ``--dry-run``)."""

from __future__ import annotations

from typing import Any

import click

from sqla_outbox.cli.options import (
    common_options,
    handle_errors,
    json_option,
    load_settings,
    outbox_engine,
    setting,
    setup_logging,
)
from sqla_outbox.cli.terminal import console, echo, jsonable, print_json, table, when


@click.command("purge")
@common_options
@setting("purge_sent_after_days", "--sent-after-days", type=float)
@setting("purge_succeeded_after_days", "--succeeded-after-days", type=float)
@setting("purge_failed_after_days", "--failed-after-days", type=float)
@setting("purge_batch_size", "--batch-size", type=int)
@click.option("--dry-run", is_flag=True, help="Count what would be deleted; delete nothing.")
@click.option(
    "--yes",
    is_flag=True,
    help="Do not ask before deleting failed runs or purging with ages below the defaults.",
)
@json_option
def purge_command(
    verbose: int, log_format: str, traceback: bool, dry_run: bool, yes: bool, as_json: bool, **options: Any
) -> None:
    """Run maintenance.purge now: delete sent outbox rows and finished runs past retention.

    Pending outbox rows, unfinished runs and the sent rows of unfinished runs are never
    deleted. Batches use FOR UPDATE SKIP LOCKED, so the relay and workers are never
    blocked. A purge that would delete failed runs (their DLQ messages can no longer be
    requeued) or that uses ages below the defaults says what it will delete and asks
    first; without a terminal it needs --yes (exit code 2 otherwise).
    """
    setup_logging(verbose, log_format)
    with handle_errors(traceback):
        from sqla_outbox import maintenance

        settings = load_settings(**options)
        with outbox_engine(settings) as engine:
            if not dry_run and not yes:
                _confirm(maintenance.purge(engine, settings, dry_run=True), settings)
            report = maintenance.purge(engine, settings, dry_run=dry_run)
        if as_json:
            document = jsonable(report)
            document["deleted"] = report.deleted
            print_json(document)
            return
        title = "Purge (dry run: nothing deleted)" if dry_run else "Purge"
        shown = table(
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
            shown.add_row(c.category, when(c.cutoff), str(c.deleted), str(c.trail_rows), str(c.batches))
        out = console()
        out.print(shown)
        out.print(f"batch size {report.batch_size}, {report.duration_ms:.0f} ms")


_AGES = ("purge_sent_after_days", "purge_succeeded_after_days", "purge_failed_after_days")


def _confirm(preview: Any, settings: Any) -> None:
    """Ask before a purge that deletes failed runs or uses ages below the defaults.

    Raises:
        ConfigurationError: No terminal to ask on and no --yes (exit code 2).
    """
    import dataclasses
    import sys

    from sqla_outbox import errors
    from sqla_outbox.config import OutboxSettings

    defaults = {f.name: f.default for f in dataclasses.fields(OutboxSettings) if f.name in _AGES}
    short = [
        f"{name} {getattr(settings, name):g} (default {defaults[name]:g})"
        for name in _AGES
        if getattr(settings, name) < defaults[name]
    ]
    failed = preview.by_category()["failed_runs"].deleted
    if not short and not failed:
        return
    what = ", ".join(f"{c.deleted} {c.category.replace('_', ' ')}" for c in preview.counts if c.deleted)
    summary = f"this purge deletes {what or 'nothing'}"
    if failed:
        summary += f", including {failed} failed runs whose DLQ messages can then no longer be requeued"
    if short:
        summary += "; it uses ages below the defaults: " + "; ".join(short)
    if not sys.stdin.isatty():
        raise errors.ConfigurationError(
            f"{summary}. Run it with --yes, or --dry-run to see it", option="--yes"
        )
    echo(summary + ".", err=True)
    if not click.confirm("Delete?", default=False, err=True):
        raise click.exceptions.Exit(1)
