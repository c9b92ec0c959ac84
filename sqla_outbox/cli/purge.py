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
from sqla_outbox.cli.terminal import console, jsonable, print_json, table, when


@click.command("purge")
@common_options
@setting("purge_sent_after_days", "--sent-after-days", type=float)
@setting("purge_succeeded_after_days", "--succeeded-after-days", type=float)
@setting("purge_failed_after_days", "--failed-after-days", type=float)
@setting("purge_batch_size", "--batch-size", type=int)
@click.option("--dry-run", is_flag=True, help="Count what would be deleted; delete nothing.")
@json_option
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
        with outbox_engine(settings) as engine:
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
