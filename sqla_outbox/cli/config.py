"""``python -m sqla_outbox config``: the settings in effect, or the configuration reference."""

from __future__ import annotations

import click

from sqla_outbox.cli.options import handle_errors
from sqla_outbox.cli.terminal import console, print_json, table
from sqla_outbox.config import OutboxSettings, env_names, reference_markdown


@click.command("config")
@click.option("--json", "as_json", is_flag=True, help="Print the settings as JSON.")
@click.option("--reference", is_flag=True, help="Print the configuration reference (Markdown).")
def config_command(as_json: bool, reference: bool) -> None:
    """Show the settings in effect here (from the environment; URL passwords and secrets masked)."""
    if reference:
        click.echo(reference_markdown(), nl=False)
        return
    with handle_errors(False):
        values = OutboxSettings.from_env().redacted()
    if as_json:
        print_json(values)
        return
    shown = table("sqla_outbox settings", ("setting", "value", "environment"))
    for name, value in values.items():
        text = ",".join(value) if isinstance(value, (list, tuple)) else str(value)
        shown.add_row(name, text, env_names(name)[0])
    console().print(shown)
