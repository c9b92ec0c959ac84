"""What the commands print: a literal rich console, tables, timestamps and JSON documents.

Everything shown here may come from users, the database or a queue (task names, error
messages, idempotency keys, message attributes), so the console never parses markup or
emoji codes; colour goes through :func:`styled`. Machine output (``--json``) goes through
:func:`print_json` after :func:`jsonable`.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
import os
import uuid
from collections.abc import Iterable
from typing import Any

import click


def console(*, stderr: bool = False, quiet: bool = False) -> Any:
    """A rich console that prints every string literally.

    Markup and emoji codes are off: run ids, task names, idempotency keys, error messages,
    URLs and queue names come from users and the database, and ``[/7]``, ``[bold]`` or
    ``:warning:`` in them must show as typed (with markup on, rich raises ``MarkupError``
    on some and silently drops others). Colour goes through :func:`styled` instead.

    Args:
        stderr: Print to stderr (progress and notices) instead of stdout.
        quiet: Print nothing (the ``--json`` mode of commands that also show progress).

    Returns:
        A ``rich.console.Console``. Output that is not a terminal (less, a file) is 200
        columns wide instead of 80, unless ``COLUMNS`` sets the width.
    """
    from rich.console import Console

    options: dict[str, Any] = {"markup": False, "emoji": False, "stderr": stderr, "quiet": quiet}
    terminal = Console(**options)
    if terminal.is_terminal or os.environ.get("COLUMNS", "").isdigit():
        return terminal
    return Console(width=200, **options)


def styled(text: str, style: str) -> Any:
    """``text`` as a ``rich.text.Text`` in ``style`` (``"red"``), never parsed as markup."""
    from rich.text import Text

    return Text(text, style=style)


def table(title: str, columns: Iterable[str]) -> Any:
    """A left-titled ``rich.table.Table`` whose columns fold long values."""
    from rich.table import Table

    result = Table(title=title, title_justify="left")
    for column in columns:
        result.add_column(column, overflow="fold")
    return result


def when(value: dt.datetime | None) -> str:
    """A timestamp as ``YYYY-MM-DD HH:MM:SS`` UTC, or ``-``."""
    return "-" if value is None else value.astimezone(dt.UTC).strftime("%Y-%m-%d %H:%M:%S")


def text(value: Any) -> str:
    """``str(value)``, or ``-`` for None."""
    return "-" if value is None else str(value)


def jsonable(value: Any) -> Any:
    """Dataclasses, datetimes (ISO 8601), UUIDs and timedeltas (seconds) as JSON values."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: jsonable(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        return [jsonable(v) for v in value]
    if isinstance(value, dt.datetime):
        return value.astimezone(dt.UTC).isoformat()
    if isinstance(value, dt.timedelta):
        return value.total_seconds()
    if isinstance(value, uuid.UUID):
        return str(value)
    return value


def print_json(document: Any) -> None:
    """One JSON document on stdout (indented; unknown types as ``str``)."""
    click.echo(json.dumps(document, indent=2, default=str))


def print_check_report(report: Any, *, as_json: bool) -> None:
    """A ``--check`` report (:class:`sqla_outbox.health.CheckReport`) as a table or JSON."""
    if as_json:
        print_json({"ok": report.ok, "checks": [dataclasses.asdict(r) for r in report.results]})
        return
    from rich.table import Table

    result = Table(title="sqla_outbox services")
    for column in ("service", "status", "detail"):
        result.add_column(column)
    for r in report.results:
        result.add_row(r.service, styled("ok", "green") if r.ok else styled("FAILED", "red"), r.detail)
    console().print(result)
