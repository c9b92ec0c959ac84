"""What the commands print: a literal rich console, tables, timestamps and JSON documents.

This module is the one place the commands render for people: no other module imports
``rich`` (``tests/unit/test_architecture.py`` checks). Everything shown here may come from
users, the database or a queue (task names, error messages, idempotency keys, message
attributes set by whoever wrote to a DLQ), so:

* the console never parses markup or emoji codes; colour goes through :func:`styled`;
* every string reaching the console, a table cell, a rule or :func:`echo` is passed
  through :func:`sqla_outbox.logging.printable`: escape sequences, C0/C1 controls, bidi
  overrides and zero-width characters are shown as visible escapes (``\\x1b``,
  ``\\u202e``), never sent to the terminal.

Machine output (``--json``) goes through :func:`print_json` after :func:`jsonable`:
``json.dumps`` with ASCII output escapes the same characters as ``\\u001b``.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import functools
import json
import os
import uuid
from collections.abc import Iterable
from typing import Any

import click

from sqla_outbox.logging import printable


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
    escaping_console, _ = _classes()
    options: dict[str, Any] = {"markup": False, "emoji": False, "stderr": stderr, "quiet": quiet}
    terminal = escaping_console(**options)
    if terminal.is_terminal or os.environ.get("COLUMNS", "").isdigit():
        return terminal
    return escaping_console(width=200, **options)


def styled(text: str, style: str) -> Any:
    """``text`` (escaped) as a ``rich.text.Text`` in ``style`` (``"red"``), never parsed as markup."""
    from rich.text import Text

    return Text(printable(text), style=style)


def table(title: str, columns: Iterable[str]) -> Any:
    """A left-titled table whose columns fold long values and whose cells are escaped."""
    _, escaping_table = _classes()
    result = escaping_table(title=title, title_justify="left")
    for column in columns:
        result.add_column(column, overflow="fold")
    return result


def grid(*, padding: tuple[int, int] = (0, 2)) -> Any:
    """A borderless grid (add its columns), cells escaped like :func:`table`'s."""
    _, escaping_table = _classes()
    return escaping_table.grid(padding=padding)


def progress(label: str, console: Any) -> Any:
    """A progress bar (``label``, bar, done/total, elapsed) on ``console``; a context manager."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    return Progress(
        TextColumn(printable(label)),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
        transient=False,
    )


def echo(message: str, *, err: bool = False, nl: bool = True) -> None:
    """Text for people on stdout (``err``: stderr), escaped like everything else here."""
    click.echo(printable(message, multiline=True), err=err, nl=nl)


def _safe(renderable: Any) -> Any:
    """Strings and ``Text`` escaped; tables escape their own cells (:func:`table`)."""
    from rich.text import Text

    if isinstance(renderable, str):
        return printable(renderable, multiline=True)
    if isinstance(renderable, Text):
        if printable(renderable.plain, multiline=True) == renderable.plain:
            return renderable
        return Text(printable(renderable.plain, multiline=True), style=renderable.style)
    return renderable


@functools.cache
def _classes() -> tuple[Any, Any]:
    """The console and table classes (built on first use: rich is imported lazily)."""
    from rich.console import Console
    from rich.table import Table

    class EscapingConsole(Console):
        def print(self, *objects: Any, **options: Any) -> None:
            super().print(*(_safe(o) for o in objects), **options)

        def rule(self, title: Any = "", **options: Any) -> None:
            super().rule(_safe(title), **options)

    class EscapingTable(Table):
        def add_row(self, *renderables: Any, **options: Any) -> None:
            super().add_row(*(_safe(r) for r in renderables), **options)

    return EscapingConsole, EscapingTable


def when(value: dt.datetime | None) -> str:
    """A timestamp as ``YYYY-MM-DD HH:MM:SS`` UTC, or ``-``."""
    return "-" if value is None else value.astimezone(dt.UTC).strftime("%Y-%m-%d %H:%M:%S")


def text(value: Any) -> str:
    """``str(value)`` escaped (:func:`~sqla_outbox.logging.printable`), or ``-`` for None."""
    return "-" if value is None else printable(str(value))


def jsonable(value: Any) -> Any:
    """Dataclasses, datetimes (ISO 8601), UUIDs and timedeltas (seconds) as JSON values.

    A dataclass field declared ``repr=False`` (a DLQ body, an envelope's digest) is left
    out: it is never printed, in JSON either."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: jsonable(getattr(value, f.name)) for f in dataclasses.fields(value) if f.repr}
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
    result = table("sqla_outbox services", ("service", "status", "detail"))
    for r in report.results:
        result.add_row(r.service, styled("ok", "green") if r.ok else styled("FAILED", "red"), r.detail)
    console().print(result)
