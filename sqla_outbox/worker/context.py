"""What a handler receives besides its payload.

The context's ``session`` is the handler's database session: a ``Session`` for sync
handlers, an ``AsyncSession`` for async ones. Whatever the handler does through it
commits in the same transaction that marks the run ``succeeded``, and only if this
attempt still holds the run's lease, so the handler's database effects happen once even
when SQS delivers the message twice. Don't commit it yourself: the worker does. Dispatch
follow-up work with ``ctx.session.add(Dispatch(...))``; it is scheduled in that same
transaction.

Effects outside the database (e-mails, HTTP calls) can repeat when a worker dies after
them and before the commit: make them idempotent, keyed by :attr:`TaskContext.run_id`.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
import logging
import threading
import time
import uuid
from typing import Any

from sqla_outbox import envelope, errors
from sqla_outbox.config import OutboxSettings

TRAIL_DETAIL_MAX_CHARS = 4000
"""Largest :attr:`TaskContext.trail_detail`, as JSON text."""


class Cancelled(errors.OutboxError):
    """The attempt was cancelled (timeout, lost lease or worker shutdown)."""

    code = "cancelled"


@dataclasses.dataclass
class TaskContext:
    """Per-attempt context passed as the handler's second argument.

    Attributes:
        run_id: The run (same UUID as the outbox row and ``task_runs``); use it as the
            idempotency key of external side effects.
        task: Task name. queue: Logical queue it came from.
        tenant_id: Tenant, or None for platform work.
        event: The published event, for subscribers; else None.
        attempt: Handler attempt number for this run, from 1 (``task_runs.attempts``).
        receive_count: SQS ``ApproximateReceiveCount`` of this delivery.
        deadline_at: When the per-attempt timeout fires (UTC), or None without a limit.
        session: The handler's ``Session`` / ``AsyncSession`` (see module docstring).
        logger: Logger whose records carry run_id, task and tenant_id.
        cancel_event: Set when the attempt is cancelled; long sync handlers should check
            :attr:`cancelled` (or wait on it) and stop.
        trail_detail: JSON-ready context the worker stores in the ``detail`` of this
            attempt's trail row, whatever its outcome (succeeded, retrying or failed):
            e.g. the status and latency of an HTTP call. At most
            :data:`TRAIL_DETAIL_MAX_CHARS` characters of JSON; larger is replaced by a
            note. The worker's own keys (``reason``, ``backoff_seconds``) win.
        settings: The worker's settings (None when the caller has none).
    """

    run_id: uuid.UUID
    task: str
    queue: str
    tenant_id: int | None
    event: str | None
    attempt: int
    receive_count: int
    deadline_at: dt.datetime | None
    session: Any
    logger: logging.LoggerAdapter[logging.Logger]
    cancel_event: threading.Event = dataclasses.field(default_factory=threading.Event)
    trail_detail: dict[str, Any] = dataclasses.field(default_factory=dict)
    settings: OutboxSettings | None = None
    _deadline_monotonic: float | None = None

    @property
    def cancelled(self) -> bool:
        """True once the attempt was cancelled."""
        return self.cancel_event.is_set()

    def check_cancelled(self) -> None:
        """Raise :class:`Cancelled` if the attempt was cancelled."""
        if self.cancel_event.is_set():
            raise Cancelled("attempt cancelled")

    def remaining_seconds(self) -> float | None:
        """Seconds left before the timeout, or None without a limit."""
        if self._deadline_monotonic is None:
            return None
        return max(0.0, self._deadline_monotonic - time.monotonic())


def bounded_detail(detail: dict[str, Any]) -> dict[str, Any]:
    """``detail`` if its JSON is at most :data:`TRAIL_DETAIL_MAX_CHARS` characters and
    PostgreSQL can store it (no NUL, valid UTF-8), else a note saying why it was dropped."""
    if not detail:
        return {}
    try:
        text = json.dumps(detail, allow_nan=False, ensure_ascii=False)
    except (TypeError, ValueError) as exc:
        return {"trail_detail_dropped": f"not JSON: {exc}"[:200]}
    if len(text) > TRAIL_DETAIL_MAX_CHARS:
        return {"trail_detail_dropped": f"{len(text)} characters, over {TRAIL_DETAIL_MAX_CHARS}"}
    if "\\u0000" in text or not envelope.storable_text(text):  # jsonb refuses both
        return {"trail_detail_dropped": "holds a NUL character or a lone surrogate"}
    return detail
