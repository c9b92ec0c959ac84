"""``python -m sqla_outbox groups show|list``: groups of runs and their progress."""

from __future__ import annotations

import uuid
from typing import Any

import click

from sqla_outbox.cli.options import (
    common_options,
    handle_errors,
    json_option,
    load_settings,
    outbox_connection,
    setup_logging,
)
from sqla_outbox.cli.terminal import console, grid, jsonable, print_json, table, text, when


@click.group("groups")
def groups_group() -> None:
    """Groups of runs dispatched with sqla_outbox.Group (task_groups)."""


def _progress(state: Any) -> str:
    return f"{state.finished} of {state.total} finished"


@groups_group.command("show")
@click.argument("group_id", type=click.UUID)
@common_options
@json_option
def groups_show_command(
    group_id: uuid.UUID, verbose: int, log_format: str, traceback: bool, as_json: bool, **options: Any
) -> None:
    """Show one group: progress, completion run and members.

    Exit code 1 when there is no such group.
    """
    setup_logging(verbose, log_format)
    with handle_errors(traceback):
        from sqla_outbox import groups

        settings = load_settings(**options)
        with outbox_connection(settings) as connection:
            state = groups.get_group(connection, group_id)
        if state is None:
            if as_json:
                print_json({"error": "no such group", "group_id": str(group_id)})
            else:
                console(stderr=True).print(f"error: no group {group_id}")
            raise SystemExit(1)
        if as_json:
            print_json({**jsonable(state), "progress": _progress(state)})
            return
        out = console()
        shown = grid()
        shown.add_column(style="bold")
        shown.add_column()
        for key, value in (
            ("group_id", str(state.group_id)),
            ("progress", _progress(state)),
            ("tenant", text(state.tenant_id)),
            ("completion", f"{state.completion_task} {state.completion_run_id}"),
            ("completion status", text(state.completion_status)),
            ("created", when(state.created_at)),
            ("completed", when(state.completed_at)),
        ):
            shown.add_row(key, value)
        out.print(shown)
        members = table("Members", ("run_id", "task", "status", "finished as"))
        for m in state.members:
            members.add_row(str(m.run_id), m.task, m.status, text(m.finished_status))
        out.print(members)


@groups_group.command("list")
@common_options
@click.option("--unfinished", is_flag=True, help="Only groups whose last member has not finished.")
@click.option(
    "--limit",
    type=click.IntRange(min=1, max=1_000_000),
    default=50,
    show_default=True,
    help="Most groups shown.",
)
@json_option
def groups_list_command(
    verbose: int,
    log_format: str,
    traceback: bool,
    unfinished: bool,
    limit: int,
    as_json: bool,
    **options: Any,
) -> None:
    """List groups newest first, with their progress (n of m finished)."""
    setup_logging(verbose, log_format)
    with handle_errors(traceback):
        from sqla_outbox import groups

        settings = load_settings(**options)
        with outbox_connection(settings) as connection:
            found = groups.list_groups(connection, unfinished_only=unfinished, limit=limit)
        if as_json:
            print_json([{**jsonable(g), "progress": _progress(g)} for g in found])
            return
        shown = table(
            f"Groups ({len(found)}{', limit reached' if len(found) == limit else ''})",
            ("group_id", "progress", "completion task", "completion status", "tenant", "created (UTC)"),
        )
        for g in found:
            shown.add_row(
                str(g.group_id),
                _progress(g),
                g.completion_task,
                text(g.completion_status),
                text(g.tenant_id),
                when(g.created_at),
            )
        console().print(shown)
