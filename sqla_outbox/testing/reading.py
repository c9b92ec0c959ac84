"""Reading what a transaction dispatched or published, and asserting on it (real rows).

See :mod:`sqla_outbox.testing` for the overview.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as dt
import enum
import inspect
import json
import uuid
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from sqlalchemy import text
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.orm import Session, scoped_session, sessionmaker

from sqla_outbox import envelope, errors
from sqla_outbox.config import SQS_MAX_MESSAGE_BYTES
from sqla_outbox.types import JSONValue
from sqla_outbox.webhook_fanout import WEBHOOK_TASK

_PAYLOAD_CHARS = 300


class AnyValue(enum.Enum):
    """Type of :data:`ANY`, the "no filter" default of every matcher argument."""

    ANY = "ANY"

    def __repr__(self) -> str:
        return "ANY"


ANY = AnyValue.ANY
"""Matches every value. ``None`` is a value: ``tenant_id=None`` matches platform runs only,
``event=None`` matches plain dispatches only (not runs created by a publish)."""

PayloadMatcher = JSONValue | Callable[[JSONValue], bool] | AnyValue
"""A JSON value compared with ``==`` (tuples count as lists), a predicate, or :data:`ANY`."""

DelayMatcher = dt.timedelta | float | int | AnyValue
"""A ``timedelta`` or seconds, compared to the millisecond, or :data:`ANY`."""


@dataclasses.dataclass(frozen=True)
class DispatchedRun:
    """One run found in the outbox, as the worker would receive it.

    Attributes:
        run_id: The run's UUID (outbox row, envelope and ``task_runs`` share it).
        task: Task name, from the envelope.
        payload: The payload, decoded from the envelope's JSON text.
        tenant_id: Tenant, or None for a platform run (``platform_outbox_messages``).
        queue: Logical queue (critical, default, bulk, maintenance).
        event: The published event this run subscribes to, or None for a plain dispatch.
        idempotency_key: The dispatch's idempotency key, or None.
        delay: ``task_runs.available_at - task_runs.created_at``, database clock, rounded
            to the millisecond (both are taken in the dispatching statement, microseconds
            apart). ``Dispatch(delay=...)`` gives exactly that delay back.
        available_at: When the run becomes due (timezone-aware UTC, database clock).
        created_at: When the run row was written (timezone-aware UTC, database clock).
        sent_at: When the outbox row was marked sent (by the relay, or by
            :func:`run_pending`); None while pending.
        status: ``task_runs.status``: queued, running, retrying, succeeded or failed.
        attempts: ``task_runs.attempts``: handler executions started.
        last_error: ``task_runs.last_error``, the most recent failure message, or None.
    """

    run_id: uuid.UUID
    task: str
    payload: JSONValue
    tenant_id: int | None
    queue: str
    event: str | None
    idempotency_key: str | None
    delay: dt.timedelta
    available_at: dt.datetime
    created_at: dt.datetime
    sent_at: dt.datetime | None
    status: str
    attempts: int
    last_error: str | None

    @property
    def pending(self) -> bool:
        """True while the outbox row is not sent."""
        return self.sent_at is None

    def describe(self) -> str:
        """One line for assertion messages: task, event, tenant, queue, delay, status, payload."""
        event = f" (event {self.event!r})" if self.event is not None else ""
        key = f" idempotency_key={self.idempotency_key!r}" if self.idempotency_key is not None else ""
        return (
            f"{self.task}{event} tenant_id={self.tenant_id} queue={self.queue} "
            f"delay={_seconds(self.delay)} status={self.status}{key} payload={_short_json(self.payload)}"
        )


# --------------------------------------------------------------------------------------
# reading

_DISPATCHED = text(
    """
SELECT o.run_id, o.envelope, o.sent_at, o.available_at, o.created_at,
       r.status, r.attempts, r.last_error,
       r.available_at AS run_available_at, r.created_at AS run_created_at
FROM (
    SELECT 0 AS kind, id, run_id, envelope, available_at, sent_at, created_at FROM outbox_messages
    UNION ALL
    SELECT 1, id, run_id, envelope, available_at, sent_at, created_at FROM platform_outbox_messages
) AS o
LEFT JOIN task_runs AS r ON r.run_id = o.run_id
ORDER BY o.created_at, o.kind, o.id
"""
)


@contextlib.contextmanager
def _reading(source: Any) -> Iterator[Connection]:
    """A connection that sees what ``source`` sees (see the module docstring)."""
    if isinstance(source, scoped_session):
        source = source()
    if isinstance(source, Session):
        source.flush()
        yield source.connection()
    elif isinstance(source, Connection):
        yield source
    elif isinstance(source, Engine):
        with source.connect() as connection:
            yield connection
    elif isinstance(source, sessionmaker):
        with source() as session:
            yield session.connection()
    elif any(hasattr(source, name) for name in ("sync_session", "sync_connection", "sync_engine")) or (
        inspect.iscoroutinefunction(getattr(source, "flush", None))  # async_scoped_session
    ):
        raise errors.ConfigurationError(
            f"{type(source).__name__} is asyncio; call the helper through run_sync, e.g. "
            "await session.run_sync(testing.dispatched, task='...') (an async_scoped_session: "
            "await session().run_sync(...))",
            option="source",
        )
    else:
        raise errors.ConfigurationError(
            f"cannot read the outbox through {source!r}: pass a Session, Connection, Engine or sessionmaker",
            option="source",
        )


def dispatched(
    source: Any,
    *,
    task: str | AnyValue = ANY,
    event: str | AnyValue | None = ANY,
    tenant_id: int | AnyValue | None = ANY,
) -> list[DispatchedRun]:
    """Every run in the outbox (both tables, pending or sent), oldest first.

    A run created by ``Publish`` is listed under its subscriber task with ``event`` set;
    a ``Dispatch`` that an idempotency key resolved to an existing run wrote no row and
    is not listed (the existing run is).

    Args:
        source: ``Session`` (flushed, then read in its transaction), ``Connection``,
            ``Engine`` or ``sessionmaker``.
        task: Only runs of this task.
        event: Only runs of this event's subscribers; None: only plain dispatches.
        tenant_id: Only this tenant's runs; None: only platform runs.

    Returns:
        Runs in dispatch order (outbox ``created_at``, tenant rows before platform rows
        of the same instant, then row id).

    Raises:
        ConfigurationError: ``source`` is not one of the accepted kinds.
        sqlalchemy.exc.DBAPIError: From the database (e.g. the outbox tables are missing).
    """
    with _reading(source) as connection:
        rows = connection.execute(_DISPATCHED).all()
    found = [_from_row(row) for row in rows]
    return [
        run
        for run in found
        if _same(task, run.task) and _same(event, run.event) and _same(tenant_id, run.tenant_id)
    ]


def _from_row(row: Any) -> DispatchedRun:
    env = envelope.decode(envelope.encode_document(row.envelope), max_bytes=SQS_MAX_MESSAGE_BYTES)
    available_at = row.run_available_at or row.available_at
    created_at = row.run_created_at or row.created_at
    return DispatchedRun(
        run_id=env.run_id,
        task=env.task,
        payload=env.payload,
        tenant_id=env.tenant_id,
        queue=env.queue,
        event=env.event,
        idempotency_key=env.idempotency_key,
        delay=_to_millisecond(available_at - created_at),
        available_at=available_at,
        created_at=created_at,
        sent_at=row.sent_at,
        status=row.status or "missing",
        attempts=row.attempts or 0,
        last_error=row.last_error,
    )


# --------------------------------------------------------------------------------------
# assertions


@dataclasses.dataclass(frozen=True)
class _Expected:
    """What an assertion looks for; :data:`ANY` fields match everything."""

    task: str | AnyValue = ANY
    event: str | AnyValue | None = ANY
    tenant_id: int | AnyValue | None = ANY
    payload: PayloadMatcher = ANY
    delay: DelayMatcher = ANY
    queue: str | AnyValue = ANY
    idempotency_key: str | AnyValue | None = ANY
    status: str | AnyValue = ANY

    def differences(self, run: DispatchedRun) -> list[str]:
        """``field: expected X, got Y`` for every field ``run`` does not match."""
        found = []
        for field in dataclasses.fields(self):
            wanted = getattr(self, field.name)
            actual = getattr(run, field.name)
            if field.name == "payload":
                ok = _payload_matches(wanted, run.payload)
                shown_wanted = "<predicate>" if callable(wanted) else _short_json(_as_json(wanted))
                shown_actual = _short_json(actual)
            elif field.name == "delay":
                ok = wanted is ANY or _delay(wanted) == run.delay
                shown_wanted = "ANY" if wanted is ANY else _seconds(_delay(wanted))
                shown_actual = _seconds(run.delay)
            else:
                ok = _same(wanted, actual)
                shown_wanted, shown_actual = repr(wanted), repr(actual)
            if not ok:
                found.append(f"{field.name}: expected {shown_wanted}, got {shown_actual}")
        return found

    def matches(self, run: DispatchedRun) -> bool:
        """True when every field matches; a payload predicate only sees runs of the right task/event."""
        if not (_same(self.task, run.task) and _same(self.event, run.event)):
            return False
        return not self.differences(run)

    def describe(self, *, named: str) -> str:
        """The given fields other than ``named`` (which the message names already)."""
        parts = []
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if value is ANY or field.name == named:
                continue
            if field.name == "payload":
                parts.append("payload=<predicate>" if callable(value) else f"payload={_short_json(value)}")
            elif field.name == "delay":
                parts.append(f"delay={_seconds(_delay(value))}")
            else:
                parts.append(f"{field.name}={value!r}")
        return ", ".join(parts)


def assert_dispatched(
    source: Any,
    task: str,
    *,
    payload: PayloadMatcher = ANY,
    tenant_id: int | AnyValue | None = ANY,
    delay: DelayMatcher = ANY,
    queue: str | AnyValue = ANY,
    event: str | AnyValue | None = ANY,
    idempotency_key: str | AnyValue | None = ANY,
    status: str | AnyValue = ANY,
    count: int | None = None,
) -> list[DispatchedRun]:
    """Assert that runs of ``task`` matching every given field are in the outbox.

    Args:
        source: As for :func:`dispatched`.
        task: Task name.
        payload: The decoded payload (``==``, tuples count as lists), or a predicate.
        tenant_id: Tenant; None: a platform run.
        delay: ``timedelta`` or seconds, compared to the millisecond (see
            :attr:`DispatchedRun.delay`).
        queue / event / idempotency_key / status: Compared with ``==``; ``event=None``
            means a plain dispatch, not a publish's run.
        count: Exactly this many matching runs; None: at least one.

    Returns:
        The matching runs, oldest first.

    Raises:
        AssertionError: No match (or not ``count`` matches). The message lists every run
            in the outbox and, for runs of the same task, which fields differ.
        ConfigurationError: ``source`` is not one of the accepted kinds.
    """
    expected = _Expected(
        task=task,
        event=event,
        tenant_id=tenant_id,
        payload=payload,
        delay=delay,
        queue=queue,
        idempotency_key=idempotency_key,
        status=status,
    )
    everything = dispatched(source)
    matches = [run for run in everything if expected.matches(run)]
    if (count is None and matches) or (count is not None and len(matches) == count):
        return matches
    wanted = "a dispatch" if count is None else f"{count} dispatch(es)"
    detail = expected.describe(named="task")
    header = f"expected {wanted} of task {task!r}" + (f" with {detail}" if detail else "")
    header += f", found {len(matches)}."
    near = [run for run in everything if run.task == task and run not in matches]
    raise AssertionError(_message(header, everything, matches, near, expected))


def assert_not_dispatched(
    source: Any,
    task: str,
    *,
    payload: PayloadMatcher = ANY,
    tenant_id: int | AnyValue | None = ANY,
    delay: DelayMatcher = ANY,
    queue: str | AnyValue = ANY,
    event: str | AnyValue | None = ANY,
    idempotency_key: str | AnyValue | None = ANY,
    status: str | AnyValue = ANY,
) -> None:
    """Assert that no run of ``task`` matches the given fields (arguments as :func:`assert_dispatched`).

    Raises:
        AssertionError: Some run matches; the message lists the matching runs.
    """
    expected = _Expected(
        task=task,
        event=event,
        tenant_id=tenant_id,
        payload=payload,
        delay=delay,
        queue=queue,
        idempotency_key=idempotency_key,
        status=status,
    )
    matches = [run for run in dispatched(source) if expected.matches(run)]
    if matches:
        detail = expected.describe(named="task")
        header = f"expected no dispatch of task {task!r}" + (f" with {detail}" if detail else "")
        header += f", found {len(matches)}:"
        raise AssertionError("\n".join([header, *_listing(matches)]))


def assert_published(
    source: Any,
    event: str,
    *,
    payload: PayloadMatcher = ANY,
    tenant_id: int | AnyValue | None = ANY,
    delay: DelayMatcher = ANY,
    idempotency_key: str | AnyValue | None = ANY,
    subscribers: Iterable[str] | None = None,
    count: int | None = None,
) -> list[DispatchedRun]:
    """Assert that ``event`` was published: its subscribers' runs are in the outbox.

    A publish writes one run per subscriber task in the catalog (none when the event has
    no subscribers, so such a publish cannot be observed here). The webhook deliveries of a
    webhook event (``webhooks.deliver``: one per endpoint, their payload wrapping the
    event's) are not counted here; check them with ``assert_dispatched("webhooks.deliver",
    ...)``.

    Args:
        source: As for :func:`dispatched`.
        event: Event name.
        payload / tenant_id / delay / idempotency_key: As for :func:`assert_dispatched`.
        subscribers: Exactly these tasks received matching runs; None: any task did.
        count: Every subscriber task received exactly this many matching runs (the
            number of matching publishes); None: at least one.

    Returns:
        The matching runs (one per subscriber per publish), oldest first.

    Raises:
        AssertionError: No matching run, the wrong set of subscriber tasks, or a task
            with another number of runs than ``count``; the message lists every run.
    """
    expected = _Expected(
        event=event, tenant_id=tenant_id, payload=payload, delay=delay, idempotency_key=idempotency_key
    )
    everything = dispatched(source)
    matches = [run for run in everything if expected.matches(run) and run.task != WEBHOOK_TASK]
    detail = expected.describe(named="event")
    what = f"event {event!r}" + (f" with {detail}" if detail else "")
    problem = None
    by_task: dict[str, int] = {}
    for run in matches:
        by_task[run.task] = by_task.get(run.task, 0) + 1
    if not matches:
        problem = f"expected {what} to be published, found no run of it."
    elif subscribers is not None and set(subscribers) != set(by_task):
        problem = (
            f"expected {what} to reach subscribers {sorted(set(subscribers))}, "
            f"found runs of {sorted(by_task)}."
        )
    elif count is not None and any(n != count for n in by_task.values()):
        counts = ", ".join(f"{task}: {n}" for task, n in sorted(by_task.items()))
        problem = f"expected {what} published {count} time(s), found runs per subscriber: {counts}."
    if problem is None:
        return matches
    near = [run for run in everything if run.event == event and run not in matches]
    raise AssertionError(_message(problem, everything, matches, near, expected))


def _message(
    header: str,
    everything: list[DispatchedRun],
    matches: list[DispatchedRun],
    near: list[DispatchedRun],
    expected: _Expected,
) -> str:
    lines = [header]
    if matches:
        lines += ["Matching runs:", *_listing(matches)]
    if near:
        lines.append("Runs that differ:")
        for run in near:
            lines.append(f"  - {run.describe()}")
            lines += [f"      {difference}" for difference in expected.differences(run)]
    if everything:
        lines += [f"Dispatched ({len(everything)} run(s) in the outbox):", *_listing(everything)]
    else:
        lines.append("Dispatched: nothing (the outbox tables are empty).")
    return "\n".join(lines)


def _listing(found: Iterable[DispatchedRun]) -> list[str]:
    return [f"  - {run.describe()}" for run in found]


def _same(wanted: object, actual: object) -> bool:
    return wanted is ANY or wanted == actual


def _as_json(value: Any) -> Any:
    """``value`` as JSON would give it back (tuples become lists)."""
    try:
        return json.loads(json.dumps(value))
    except (TypeError, ValueError):
        return value


def _payload_matches(wanted: PayloadMatcher, actual: JSONValue) -> bool:
    if wanted is ANY:
        return True
    if callable(wanted):
        return bool(wanted(actual))
    return bool(_as_json(wanted) == actual)


def _delay(value: dt.timedelta | float | int) -> dt.timedelta:
    return _to_millisecond(value if isinstance(value, dt.timedelta) else dt.timedelta(seconds=value))


def _to_millisecond(value: dt.timedelta) -> dt.timedelta:
    return dt.timedelta(milliseconds=round(value / dt.timedelta(milliseconds=1)))


def _seconds(value: dt.timedelta) -> str:
    return f"{value.total_seconds():g}s"


def _short_json(value: Any) -> str:
    try:
        shown = json.dumps(value, sort_keys=True, ensure_ascii=False)
    except (TypeError, ValueError):
        shown = repr(value)
    return shown if len(shown) <= _PAYLOAD_CHARS else shown[: _PAYLOAD_CHARS - 1] + "…"
