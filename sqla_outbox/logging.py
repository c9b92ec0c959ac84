"""Structured logging helpers.

The library only calls ``logging.getLogger(__name__)`` and never adds handlers; the CLI
does (:func:`configure`). Messages are short and constant; details go in extras under
stable snake_case keys (``action``, ``run_id``, ``task``, ``queue``, ``tenant_id``,
``receive_count``, ``attempt``, ``duration_ms``, ...)::

    logger.info("batch sent", extra=log_extra(action="relay.batch_sent", batch_size=10))

Never log payloads, credentials or whole receipt handles (:func:`short_handle`).

Database errors are the easy way to break that rule: SQLAlchemy puts a failed statement's
parameters (an envelope, a payload) into the exception's text, and PostgreSQL's own
message can quote the failing row (``DETAIL: Failing row contains (...)``). So an
exception is logged through :func:`error_fields` (type, SQLSTATE, constraint; never a
database error's text), and the formatters render tracebacks with
:func:`safe_traceback`, which keeps the frames and hides the text of every database
error in the chain. sqla_outbox's own engines also pass ``hide_parameters=True``.

Text meant for people (the CLI's tables, text log lines) goes through :func:`printable`:
whatever a queue, the database or the wake key holds is shown, never interpreted by the
terminal.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import sys
import threading
import traceback
import unicodedata
from typing import Any

_EXTRA_KEY = "sqla_outbox"


def log_extra(**fields: Any) -> dict[str, Any]:
    """Wrap structured fields for the ``extra=`` argument of a logging call."""
    return {_EXTRA_KEY: fields}


_INVISIBLE = frozenset({"Cc", "Cf", "Cs", "Zl", "Zp"})
"""Unicode categories shown escaped: C0/C1 controls and DEL (``Cc``), format characters
such as the bidi overrides U+202A..U+202E and U+2066..U+2069 and zero-width characters
(``Cf``), lone surrogates (``Cs``) and the line/paragraph separators (``Zl``, ``Zp``)."""


def printable(text: str, *, multiline: bool = False) -> str:
    """``text`` with every control or invisible formatting character shown as a visible
    Python-style escape (``\\x1b``, ``\\u202e``, ``\\U000e0041``), for a terminal.

    An escape sequence in a task name or an error message could otherwise move the cursor,
    rewrite earlier lines, set the window title or hide text; a bidi override could make
    ``gnp.exe`` read as ``exe.png``. Printable text, including non-Latin scripts and
    emoji, is left as it is; backslashes are not doubled (text that already looks escaped
    is harmless).

    Args:
        text: Untrusted text.
        multiline: Keep ``\\n`` and ``\\t`` (a traceback); otherwise they are escaped too.
    """
    if text.isprintable():
        return text
    out = []
    for char in text:
        if (multiline and char in "\n\t") or unicodedata.category(char) not in _INVISIBLE:
            out.append(char)
            continue
        code = ord(char)
        if code < 0x100:
            out.append(f"\\x{code:02x}")
        else:
            out.append(f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}")
    return "".join(out)


def short_handle(receipt_handle: str) -> str:
    """A receipt handle shortened for logs (first 8 characters and the length)."""
    return f"{receipt_handle[:8]}…({len(receipt_handle)})"


_DATABASE_MODULES = ("sqlalchemy", "psycopg", "psycopg2", "asyncpg")
"""Exceptions defined in these packages may carry statement parameters or row contents."""


def is_database_error(exc: BaseException) -> bool:
    """Whether ``exc`` comes from SQLAlchemy or a PostgreSQL driver (its text may quote data)."""
    return any(klass.__module__.split(".")[0] in _DATABASE_MODULES for klass in type(exc).__mro__)


def _qualified(exc: BaseException) -> str:
    return f"{type(exc).__module__}.{type(exc).__qualname__}".removeprefix("builtins.")


def error_fields(exc: BaseException) -> dict[str, Any]:
    """What may be logged about ``exc``: structured fields, never a payload.

    For a database error (SQLAlchemy, psycopg, asyncpg): ``error_type`` (the driver's
    exception when SQLAlchemy wraps one), ``sqlstate`` and, when PostgreSQL names them,
    ``constraint``, ``table``, ``column``; never the message, which may hold statement
    parameters or a row. For any other exception: ``error_type`` and ``error`` (its first
    line, at most 300 characters).
    """
    if not is_database_error(exc):
        lines = str(exc).strip().splitlines()
        return {"error_type": _qualified(exc), "error": lines[0][:300] if lines else ""}
    orig = getattr(exc, "orig", None) or exc
    fields: dict[str, Any] = {"error_type": _qualified(orig)}
    sqlstate = getattr(orig, "sqlstate", None) or getattr(orig, "pgcode", None)
    if sqlstate:
        fields["sqlstate"] = str(sqlstate)
    diag = getattr(orig, "diag", None)
    for name, key in (("constraint_name", "constraint"), ("table_name", "table"), ("column_name", "column")):
        value = getattr(diag, name, None) if diag is not None else None
        if value:
            fields[key] = str(value)[:200]
    return fields


def describe_error(exc: BaseException) -> str:
    """:func:`error_fields` as one line for people (``psycopg.errors.CheckViolation
    (SQLSTATE 23514, constraint x)``)."""
    fields = error_fields(exc)
    details = ", ".join(
        f"{'SQLSTATE' if key == 'sqlstate' else key} {value}"
        for key, value in fields.items()
        if key not in ("error_type", "error")
    )
    shown = fields["error_type"] + (f" ({details})" if details else "")
    return f"{shown}: {fields['error']}" if fields.get("error") else shown


_CAUSE = "\nThe above exception was the direct cause of the following exception:\n\n"
_CONTEXT = "\nDuring handling of the above exception, another exception occurred:\n\n"


def safe_traceback(exc: BaseException) -> str:
    """A traceback of ``exc`` and its causes (frames and exception types) in which the text
    of every database error is replaced by :func:`describe_error`."""
    parts: list[str] = []
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        block = ["Traceback (most recent call last):\n", *traceback.format_tb(current.__traceback__)]
        if is_database_error(current):
            block.append(f"{_qualified(current)}: [text hidden: {describe_error(current)}]\n")
        else:
            block.extend(traceback.format_exception_only(type(current), current))
        if current.__cause__ is not None:
            current, link = current.__cause__, _CAUSE
        elif current.__context__ is not None and not current.__suppress_context__:
            current, link = current.__context__, _CONTEXT
        else:
            current, link = None, ""
        parts[:0] = [link, *block] if link else block
    return "".join(parts).rstrip("\n")


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ts, level, logger, message and the structured fields."""

    def format(self, record: logging.LogRecord) -> str:
        doc: dict[str, Any] = {
            "ts": dt.datetime.fromtimestamp(record.created, dt.UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        doc.update(getattr(record, _EXTRA_KEY, {}) or {})
        if record.exc_info and record.exc_info[0] is not None:
            doc["exc_type"] = record.exc_info[0].__name__
            doc["exc"] = self.formatException(record.exc_info)[-2000:]
        return json.dumps(doc, default=str)

    def formatException(self, ei: Any) -> str:
        return safe_traceback(ei[1]) if ei[1] is not None else super().formatException(ei)


class TextFormatter(logging.Formatter):
    """Human-readable lines: time, level, message, then ``key=value`` fields."""

    def format(self, record: logging.LogRecord) -> str:
        fields = dict(getattr(record, _EXTRA_KEY, {}) or {})
        stack = fields.pop("traceback", None)
        tail = " ".join(f"{k}={printable(str(v))}" for k, v in fields.items())
        ts = dt.datetime.fromtimestamp(record.created).strftime("%H:%M:%S.%f")[:-3]
        line = f"{ts} {record.levelname:<7} {printable(record.getMessage())}"
        if tail:
            line += f"  {tail}"
        if stack:
            line += "\n" + printable(str(stack), multiline=True)
        if record.exc_info and record.exc_info[0] is not None:
            line += "\n" + printable(self.formatException(record.exc_info), multiline=True)
        return line

    def formatException(self, ei: Any) -> str:
        return safe_traceback(ei[1]) if ei[1] is not None else super().formatException(ei)


def _log_thread_failure(args: threading.ExceptHookArgs) -> None:
    """An exception that ended a thread, logged like any other (safe traceback)."""
    if args.exc_value is None or isinstance(args.exc_value, SystemExit):
        return
    name = args.thread.name if args.thread is not None else "?"
    logging.getLogger("sqla_outbox").error(
        "a thread failed",
        extra=log_extra(
            action="thread.failed",
            thread=name,
            **error_fields(args.exc_value),
            traceback=safe_traceback(args.exc_value),
        ),
    )


def configure(*, verbose: int = 0, json_lines: bool = False) -> None:
    """Send ``sqla_outbox`` logs to stderr (CLI entry points only).

    Args:
        verbose: 0 → INFO, 1+ → DEBUG.
        json_lines: JSON objects instead of text lines.
    """
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if json_lines else TextFormatter())
    library = logging.getLogger("sqla_outbox")
    library.handlers[:] = [handler]
    library.setLevel(logging.DEBUG if verbose else logging.INFO)
    library.propagate = False
    # everything else (SQLAlchemy's pool, asyncio, botocore) at WARNING through the same
    # handler: one format per process, tracebacks rendered by safe_traceback
    root = logging.getLogger()
    if not root.handlers:
        root.addHandler(handler)
        root.setLevel(logging.WARNING)
    threading.excepthook = _log_thread_failure  # not Python's raw traceback on stderr
    logging.getLogger("botocore").setLevel(logging.WARNING)
