"""Structured logging helpers.

The library only calls ``logging.getLogger(__name__)`` and never adds handlers; the CLI
does (:func:`configure`). Messages are short and constant; details go in extras under
stable snake_case keys (``action``, ``run_id``, ``task``, ``queue``, ``tenant_id``,
``receive_count``, ``attempt``, ``duration_ms``, ...)::

    logger.info("batch sent", extra=log_extra(action="relay.batch_sent", batch_size=10))

Never log payloads, credentials or whole receipt handles (:func:`short_handle`).
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import sys
from typing import Any

_EXTRA_KEY = "sqla_outbox"


def log_extra(**fields: Any) -> dict[str, Any]:
    """Wrap structured fields for the ``extra=`` argument of a logging call."""
    return {_EXTRA_KEY: fields}


def short_handle(receipt_handle: str) -> str:
    """A receipt handle shortened for logs (first 8 characters and the length)."""
    return f"{receipt_handle[:8]}…({len(receipt_handle)})"


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


class TextFormatter(logging.Formatter):
    """Human-readable lines: time, level, message, then ``key=value`` fields."""

    def format(self, record: logging.LogRecord) -> str:
        fields = getattr(record, _EXTRA_KEY, {}) or {}
        tail = " ".join(f"{k}={v}" for k, v in fields.items())
        ts = dt.datetime.fromtimestamp(record.created).strftime("%H:%M:%S.%f")[:-3]
        line = f"{ts} {record.levelname:<7} {record.getMessage()}"
        if tail:
            line += f"  {tail}"
        if record.exc_info and record.exc_info[0] is not None:
            line += "\n" + self.formatException(record.exc_info)
        return line


def configure(*, verbose: int = 0, json_lines: bool = False) -> None:
    """Send ``sqla_outbox`` logs to stderr (CLI entry points only).

    Args:
        verbose: 0 → INFO, 1+ → DEBUG.
        json_lines: JSON objects instead of text lines.
    """
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if json_lines else TextFormatter())
    root = logging.getLogger("sqla_outbox")
    root.handlers[:] = [handler]
    root.setLevel(logging.DEBUG if verbose else logging.INFO)
    root.propagate = False
    logging.getLogger("botocore").setLevel(logging.WARNING)
