"""``python -m sqla_outbox provision``: create the queues and their DLQs, report drift."""

from __future__ import annotations

import dataclasses
import sys
from typing import Any

import click

from sqla_outbox.cli.options import (
    EXIT_CHECK_FAILED,
    common_options,
    handle_errors,
    load_settings,
    setting,
    setup_logging,
    split_list,
)
from sqla_outbox.cli.terminal import console, print_json, table


@click.command("provision")
@common_options
@setting("max_receive_count", "--max-receive-count", type=int)
@setting("max_message_bytes", "--max-message-bytes", type=int)
@setting("sqs_managed_sse", "--sse/--no-sse")
@setting("sqs_kms_key_id", "--kms-key-id")
@setting("sqs_message_retention_seconds", "--retention-seconds", type=int)
@setting("visibility_timeout_critical_seconds", "--visibility-critical", type=int)
@setting("visibility_timeout_default_seconds", "--visibility-default", type=int)
@setting("visibility_timeout_bulk_seconds", "--visibility-bulk", type=int)
@setting("visibility_timeout_maintenance_seconds", "--visibility-maintenance", type=int)
@setting(
    "queue_visibility_timeouts",
    "--visibility",
    metavar="QUEUE=SECONDS,...",
    callback=lambda ctx, param, value: split_list(value),
)
@setting("catalog_path", "--catalog", metavar="PATH")
@click.option("--fix", is_flag=True, help="Apply the desired attributes to queues that drifted.")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
def provision_command(
    verbose: int, log_format: str, traceback: bool, fix: bool, as_json: bool, **options: Any
) -> None:
    """Create the four queues, the queues the task catalog declares, and their DLQs
    (idempotent); report attribute drift.

    Visibility timeouts and retention come from the settings, so a change made there
    (not by hand on the queue) is what --fix applies. Exit code 1 when an existing queue
    drifted and --fix was not given.
    """
    setup_logging(verbose, log_format)
    with handle_errors(traceback):
        settings = load_settings(**options)
        from pathlib import Path

        from sqla_outbox.catalog import Catalog
        from sqla_outbox.sqs.client import make_client
        from sqla_outbox.sqs.provision import provision

        path = Path(settings.catalog_path)
        catalog = Catalog.load(path) if path.exists() else None
        known = catalog.queue_names() if catalog is not None else Catalog.queue_names_at(path)
        unknown = [
            entry.partition("=")[0].strip()
            for entry in settings.queue_visibility_timeouts
            if entry.partition("=")[0].strip() not in known
        ]
        if unknown:  # a typo would be ignored while provision reports every queue unchanged
            from sqla_outbox import errors

            raise errors.ConfigurationError(
                f"no queue {', '.join(map(repr, unknown))} among the default queues and the "
                f"catalog's ({', '.join(known)}): check the name",
                option="SQLA_OUTBOX_QUEUE_VISIBILITY_TIMEOUTS",
            )
        client = make_client(settings)
        reports = provision(client, settings, fix=fix, catalog=catalog)
        if as_json:
            print_json([dataclasses.asdict(r) for r in reports])
        else:
            where = "" if settings.sqs_endpoint_url else f" in {client.meta.region_name}"
            shown = table(f"SQS queues{where}", ("queue", "SQS name", "kind", "action", "differences"))
            for r in reports:
                diffs = "; ".join(
                    f"{k}: {v['actual']!r} → {v['expected']!r}" for k, v in r.differences.items()
                )
                shown.add_row(r.queue, r.name, "DLQ" if r.dead_letter else "source", r.action, diffs)
            console().print(shown)
        if any(r.action == "drift" for r in reports):
            sys.exit(EXIT_CHECK_FAILED)
