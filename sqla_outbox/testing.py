"""Helpers for an application's own tests: what a transaction dispatched, and running it inline.

Everything here reads and writes real rows; nothing is mocked. Assert what your code
scheduled::

    from sqla_outbox import testing

    with SessionFactory() as session, session.begin():
        place_order(session, tenant_id=1, product_id=101, quantity=2, email="a@example.com")
        testing.assert_dispatched(session, "send_receipt", tenant_id=1)   # same transaction
    testing.assert_published(engine, "order.placed", subscribers=["award_loyalty", "notify_warehouse"])

then execute those runs with the real handler code, without SQS, a relay or a worker::

    report = testing.run_pending(SessionFactory)
    report.assert_all_succeeded()

Reading (:func:`dispatched`, :func:`assert_dispatched`, :func:`assert_not_dispatched`,
:func:`assert_published`) accepts a ``Session`` (flushed first, then read inside its
transaction, so uncommitted dispatches are visible), a ``Connection`` (read in its
transaction), an ``Engine`` or a ``sessionmaker`` (committed rows only). For an
``AsyncSession``, call them through ``await session.run_sync(testing.dispatched, ...)``.

Running (:func:`run_pending`) does, for each due pending outbox row, what the relay and
the worker do together as far as the database is concerned: decode the envelope
(:func:`sqla_outbox.envelope.decode`), take the run's lease
(:func:`sqla_outbox.worker.runs.take_lease`), call the handler registered with ``@task``
with a real :class:`~sqla_outbox.worker.context.TaskContext` whose session commits
together with ``running → succeeded``, record failures (``retrying`` / ``failed``, with
trail rows), and mark the outbox row sent. Follow-up work that handlers dispatch runs in
the next round. It needs committed rows, like the real worker (it uses its own
transactions); tests that wrap everything in one rolled-back transaction can use the
reading helpers but not :func:`run_pending`.

What inline execution does not do: per-attempt timeouts are not enforced (the context
still carries ``deadline_at``), backoff delays are not waited (a transient failure is
retried at once), and nothing reaches SQS or a DLQ (a permanent failure ends ``failed``
with its trail rows, but no ``dead_lettered_at``). The pytest plugin
(:mod:`sqla_outbox.pytest_plugin`) wraps them, as an :class:`Outbox`, in an ``outbox`` fixture; see
``docs/testing.md``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import datetime as dt
import enum
import json
import logging
import time
import traceback as tb
import uuid
from collections.abc import Callable, Coroutine, Iterable, Iterator
from typing import Any, TypeVar

from sqlalchemy import bindparam, text
from sqlalchemy.dialects.postgresql import UUID
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.orm import Session, scoped_session, sessionmaker

from sqla_outbox import envelope, errors, tracing
from sqla_outbox.catalog import Catalog
from sqla_outbox.config import SQS_MAX_MESSAGE_BYTES, OutboxSettings
from sqla_outbox.events import install, installation_for, uninstall
from sqla_outbox.logging import log_extra
from sqla_outbox.types import VISIBILITY_TIMEOUT_SECONDS, JSONValue
from sqla_outbox.worker import runs
from sqla_outbox.worker.context import TaskContext
from sqla_outbox.worker.registry import Registry, TaskDefinition
from sqla_outbox.worker.registry import registry as default_registry

T = TypeVar("T")

WORKER_ID = "sqla_outbox.testing"
"""The ``worker_id`` inline runs record in ``task_runs.lease_owner`` and the trail."""

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
    elif any(hasattr(source, name) for name in ("sync_session", "sync_connection", "sync_engine")):
        raise errors.ConfigurationError(
            f"{type(source).__name__} is asyncio; call the helper through run_sync, e.g. "
            "await session.run_sync(testing.dispatched, task='...')",
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
    no subscribers, so such a publish cannot be observed here).

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
    matches = [run for run in everything if expected.matches(run)]
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


# --------------------------------------------------------------------------------------
# running inline


@dataclasses.dataclass(frozen=True)
class RunOutcome:
    """What :func:`run_pending` did with one run.

    Attributes:
        run_id / task / tenant_id / event / queue / payload: From the envelope.
        round: The round (from 1) in which the run was picked up; follow-ups dispatched
            by handlers of round N run in round N + 1.
        status: The run's status afterwards: ``succeeded``, ``failed``, ``retrying`` (a
            transient failure with ``retries=False``), or for a run that was not
            executed, its status as found.
        attempts: Handler attempts made by this call (0 when not executed).
        failures: The failure of each failed attempt, oldest first (type, message,
            traceback excerpt), as the trail stores them.
        reason: Why a run ended ``failed``, as the trail records it: ``permanent-error``,
            ``retries-exhausted``, ``receive-limit`` or ``unknown-task``; else None.
        skipped: Why the run was not executed, else None: ``already-succeeded``,
            ``already-failed``, ``leased`` (another worker holds it), ``unknown-run``,
            ``envelope-mismatch`` or ``malformed-envelope``.
    """

    run_id: uuid.UUID
    task: str
    tenant_id: int | None
    event: str | None
    queue: str
    payload: JSONValue
    round: int
    status: str
    attempts: int = 0
    failures: tuple[runs.Failure, ...] = ()
    reason: str | None = None
    skipped: str | None = None

    @property
    def error(self) -> runs.Failure | None:
        """The last failure when the run did not succeed, else None."""
        if self.status == "succeeded" or not self.failures:
            return None
        return self.failures[-1]

    def describe(self) -> str:
        """One line: task, tenant, status, attempts and the last error."""
        line = (
            f"{self.task} tenant_id={self.tenant_id} run_id={self.run_id} round={self.round}: {self.status}"
        )
        if self.skipped:
            line += f" (not executed: {self.skipped})"
        elif self.attempts:
            line += f" after {self.attempts} attempt(s)"
        if self.reason:
            line += f" [{self.reason}]"
        if self.failures:
            last = self.failures[-1]
            line += f"; last error {last.error_type}: {last.message}"
        return line


@dataclasses.dataclass
class RunReport:
    """Result of :func:`run_pending`.

    Attributes:
        runs: One :class:`RunOutcome` per run picked up, in execution order.
        rounds: Rounds that executed at least one run.
    """

    runs: list[RunOutcome] = dataclasses.field(default_factory=list)
    rounds: int = 0

    def for_task(self, task: str) -> list[RunOutcome]:
        """Outcomes of ``task``'s runs."""
        return [outcome for outcome in self.runs if outcome.task == task]

    def by_run_id(self, run_id: uuid.UUID) -> RunOutcome:
        """The outcome of one run.

        Raises:
            KeyError: The run was not picked up by this call.
        """
        for outcome in self.runs:
            if outcome.run_id == run_id:
                return outcome
        raise KeyError(run_id)

    @property
    def succeeded(self) -> list[RunOutcome]:
        return [o for o in self.runs if o.status == "succeeded" and not o.skipped]

    @property
    def failed(self) -> list[RunOutcome]:
        return [o for o in self.runs if o.status == "failed" and not o.skipped]

    @property
    def retrying(self) -> list[RunOutcome]:
        return [o for o in self.runs if o.status == "retrying" and not o.skipped]

    @property
    def skipped(self) -> list[RunOutcome]:
        return [o for o in self.runs if o.skipped]

    def statuses(self) -> dict[str, str]:
        """``{task: status}`` when each task ran once; the last outcome wins otherwise."""
        return {o.task: o.status for o in self.runs}

    def assert_all_succeeded(self) -> None:
        """Raise unless every executed run succeeded.

        Raises:
            AssertionError: Lists each run that did not succeed, with its last error and
                traceback excerpt.
        """
        bad = [o for o in self.runs if o.status != "succeeded" and not o.skipped]
        if not bad:
            return
        lines = [f"{len(bad)} of {len(self.runs)} run(s) did not succeed:"]
        for outcome in bad:
            lines.append(f"  - {outcome.describe()}")
            if outcome.error is not None and outcome.error.traceback:
                lines += ["      " + line for line in outcome.error.traceback.rstrip().splitlines()[-12:]]
        raise AssertionError("\n".join(lines))

    def __str__(self) -> str:
        lines = [f"{len(self.runs)} run(s) in {self.rounds} round(s):"]
        return "\n".join(lines + [f"  - {o.describe()}" for o in self.runs])


class RoundLimitReached(AssertionError):
    """:func:`run_pending` still found due runs after ``max_rounds`` rounds.

    Usually a handler that dispatches work that dispatches work again, forever.

    Attributes:
        report: What was run until then.
    """

    def __init__(self, report: RunReport, max_rounds: int, left: int) -> None:
        self.report = report
        super().__init__(
            f"still {left} due run(s) after {max_rounds} round(s) of run_pending; a handler may "
            f"keep dispatching follow-ups (raise max_rounds if that is expected).\n{report}"
        )


_DUE = text(
    """
SELECT o.tbl, o.run_id, o.envelope, COALESCE(r.attempts, 0) AS attempts
FROM (
    SELECT 'outbox_messages' AS tbl, id, run_id, envelope, available_at, created_at
    FROM outbox_messages WHERE sent_at IS NULL
    UNION ALL
    SELECT 'platform_outbox_messages', id, run_id, envelope, available_at, created_at
    FROM platform_outbox_messages WHERE sent_at IS NULL
) AS o
LEFT JOIN task_runs AS r ON r.run_id = o.run_id
WHERE :include_delayed OR o.available_at <= clock_timestamp()
ORDER BY o.available_at, o.created_at, o.tbl, o.id
"""
)
_MARK_SENT = {
    table: text(
        f"UPDATE {table} SET sent_at = clock_timestamp() WHERE run_id = :run_id AND sent_at IS NULL"
    ).bindparams(bindparam("run_id", type_=UUID(as_uuid=True)))
    for table in ("outbox_messages", "platform_outbox_messages")
}
_SKIPPED = {
    runs.ClaimStatus.NOT_FOUND: "unknown-run",
    runs.ClaimStatus.MISMATCH: "envelope-mismatch",
    runs.ClaimStatus.SUCCEEDED: "already-succeeded",
    runs.ClaimStatus.FAILED: "already-failed",
    runs.ClaimStatus.LEASED: "leased",
}


def run_pending(
    source: Any,
    *,
    registry: Registry | None = None,
    catalog: Catalog | None = None,
    settings: OutboxSettings | None = None,
    include_delayed: bool = False,
    retries: bool = True,
    tasks: Iterable[str] | None = None,
    max_rounds: int = 10,
) -> RunReport:
    """Execute pending runs inline with their real handlers, round after round.

    Each round takes the due pending outbox rows (``available_at`` passed, or all of them
    with ``include_delayed``), oldest first, and for each: decodes the envelope, takes
    the run's lease, runs the handler (sync handlers in a ``Session``, ``async def``
    handlers in an ``AsyncSession``, both committing with ``running → succeeded``),
    records a failure as the worker does, and marks the outbox row sent. Handler
    exceptions are recorded in the report, never raised: check
    :meth:`RunReport.assert_all_succeeded` or the outcomes. Rounds continue while due
    rows remain (follow-ups dispatched by handlers), up to ``max_rounds``.

    Failures are classified as in the worker (``sqla_outbox.worker.handle``):
    :class:`~sqla_outbox.errors.PermanentError` or a type in ``@task(permanent=...)`` →
    ``failed`` (reason ``permanent-error``); another exception or
    :class:`~sqla_outbox.errors.Retry` → transient: with ``retries`` the run is attempted
    again at once until it succeeds or its receive limit (``@task(retry=RetryPolicy(
    max_receives=...))``, else ``settings.worker_max_receives``) makes it ``failed``
    (``retries-exhausted``); without ``retries`` it stays ``retrying`` and its outbox row
    stays pending, so the next call runs it again (as SQS would redeliver it).

    Args:
        source: A ``sessionmaker`` bound to an ``Engine`` (handler sessions come from it;
            when it has the listeners from :func:`sqla_outbox.install`, their settings
            and catalog are used), or an ``Engine``.
        registry: Where the handlers are registered (default: the ``@task`` registry;
            import your task modules first).
        catalog: For follow-up dispatches of async handlers, and of sync handlers when
            ``source`` has no installation (on the factory or its Session class), which is
            otherwise used as it is. Default: the installation's, else
            ``registry.catalog()``.
        settings: As ``catalog``; also gives ``max_message_bytes`` and
            ``worker_max_receives``. Default: the installation's, else
            ``OutboxSettings(valkey_url=None)`` (no wake signal).
        include_delayed: Also run rows whose ``available_at`` is in the future.
        retries: Re-run transient failures at once (see above).
        tasks: Only pick up runs of these tasks; others stay pending.
        max_rounds: Most rounds; at least 1.

    Returns:
        The :class:`RunReport`.

    Raises:
        RoundLimitReached: Due runs remain after ``max_rounds`` rounds.
        ConfigurationError: ``source`` is neither an ``Engine`` nor a ``sessionmaker``
            bound to one, or ``max_rounds`` < 1.
    """
    if max_rounds < 1:
        raise errors.ConfigurationError("max_rounds must be >= 1", option="run_pending(max_rounds)")
    runner = _InlineRunner(source, registry=registry, catalog=catalog, settings=settings, retries=retries)
    try:
        return runner.run(include_delayed=include_delayed, tasks=tasks, max_rounds=max_rounds)
    finally:
        runner.close()


class _LeaseLost(Exception):
    """The attempt no longer held the run when it tried to finish."""


class _InlineRunner:
    """State of one :func:`run_pending` call: engine, session factories, event loop."""

    def __init__(
        self,
        source: Any,
        *,
        registry: Registry | None,
        catalog: Catalog | None,
        settings: OutboxSettings | None,
        retries: bool,
    ) -> None:
        self.registry = registry or default_registry
        self.retries = retries
        self._installed_here: Any = None
        if isinstance(source, sessionmaker):
            bind = source.kw.get("bind")
            if not isinstance(bind, Engine):
                raise errors.ConfigurationError(
                    f"the sessionmaker is bound to {bind!r}; run_pending needs one bound to an Engine",
                    option="run_pending(source)",
                )
            self.engine = bind
            factory: sessionmaker[Session] = source
        elif isinstance(source, Engine):
            self.engine = source
            factory = sessionmaker(source)
        else:
            raise errors.ConfigurationError(
                f"cannot run pending work through {source!r}: pass a sessionmaker or an Engine",
                option="run_pending(source)",
            )
        # listeners may sit on the factory or on its Session class (install(MySession));
        # installing a second set would process every Dispatch twice
        installation = installation_for(factory) or installation_for(factory.class_)
        self.settings = settings or (
            installation.settings if installation else OutboxSettings(valkey_url=None)
        )
        self.catalog = catalog or (installation.catalog if installation else self.registry.catalog())
        if installation is None:
            install(factory, self.settings, catalog=self.catalog)
            self._installed_here = factory
        self.session_factory = factory
        self._async: _AsyncBridge | None = None

    # --- the loop ------------------------------------------------------------------------
    def run(self, *, include_delayed: bool, tasks: Iterable[str] | None, max_rounds: int) -> RunReport:
        only = None if tasks is None else set(tasks)
        report = RunReport()
        seen_pending: set[uuid.UUID] = set()  # left pending by this call (retrying, leased)
        while True:
            with self.engine.connect() as connection:
                rows = connection.execute(_DUE, {"include_delayed": include_delayed}).all()
            due = [
                row
                for row in rows
                if row.run_id not in seen_pending
                and (only is None or (isinstance(row.envelope, dict) and row.envelope.get("task") in only))
            ]
            if not due:
                return report
            if report.rounds >= max_rounds:
                raise RoundLimitReached(report, max_rounds, len(due))
            report.rounds += 1
            for row in due:
                outcome, still_pending = self._deliver(row, report.rounds)
                report.runs.append(outcome)
                if still_pending:
                    seen_pending.add(outcome.run_id)

    def _deliver(self, row: Any, round_number: int) -> tuple[RunOutcome, bool]:
        """Take one outbox row to a verdict; return the outcome and whether the row stays pending."""
        try:
            env = envelope.decode(
                envelope.encode_document(row.envelope), max_bytes=self.settings.max_message_bytes
            )
        except envelope.MalformedEnvelope as exc:
            self._mark_sent(row.tbl, row.run_id)
            doc = row.envelope if isinstance(row.envelope, dict) else {}
            outcome = RunOutcome(
                run_id=row.run_id,
                task=str(doc.get("task")),
                tenant_id=None,
                event=None,
                queue=str(doc.get("queue")),
                payload=None,
                round=round_number,
                status=self._status(row.run_id),
                failures=(runs.Failure.from_exception(exc),),
                skipped="malformed-envelope",
            )
            return outcome, False
        base = RunOutcome(
            run_id=env.run_id,
            task=env.task,
            tenant_id=env.tenant_id,
            event=env.event,
            queue=env.queue,
            payload=env.payload,
            round=round_number,
            status="queued",
        )
        receive_count = int(row.attempts) + 1
        failures: list[runs.Failure] = []
        attempts = 0
        while True:
            with self.engine.begin() as connection:
                claim = runs.take_lease(
                    connection,
                    run_id=env.run_id,
                    task=env.task,
                    tenant_id=env.tenant_id,
                    worker_id=WORKER_ID,
                    lease_seconds=VISIBILITY_TIMEOUT_SECONDS[env.queue],
                    receive_count=receive_count,
                )
            if claim.status is not runs.ClaimStatus.CLAIMED:
                leased = claim.status is runs.ClaimStatus.LEASED
                if not leased:
                    self._mark_sent(row.tbl, env.run_id)
                status = claim.previous_status or "missing"
                if attempts:  # lost the run between our own attempts (not expected inline)
                    outcome = dataclasses.replace(
                        base, status=status, attempts=attempts, failures=tuple(failures)
                    )
                    return outcome, leased
                return dataclasses.replace(base, status=status, skipped=_SKIPPED[claim.status]), leased
            attempts += 1
            attempt = runs.Attempt(env.run_id, claim.attempt, receive_count, WORKER_ID)
            status, failure, reason = self._attempt(env, attempt)
            if failure is not None:
                failures.append(failure)
            if status == "retrying" and self.retries:
                receive_count += 1
                continue
            still_pending = status == "retrying"
            if not still_pending:
                self._mark_sent(row.tbl, env.run_id)
            outcome = dataclasses.replace(
                base, status=status, attempts=attempts, failures=tuple(failures), reason=reason
            )
            return outcome, still_pending

    def _attempt(
        self, env: envelope.Envelope, attempt: runs.Attempt
    ) -> tuple[str, runs.Failure | None, str | None]:
        """Run one attempt the way the worker does; return (status, failure, failed reason)."""
        try:
            definition = self.registry.get(env.task)
        except errors.HandlerNotFound as missing:
            return self._fail(attempt, missing, reason="unknown-task", trace=None)
        limit = definition.retry.max_receives or self.settings.worker_max_receives
        if attempt.receive_count > limit:
            exhausted = errors.PermanentError(
                f"delivered {attempt.receive_count} times without a verdict (limit {limit})"
            )
            return self._fail(attempt, exhausted, reason="receive-limit", trace=None)
        ctx = self._context(env, attempt, definition)
        attributes = {
            "sqla_outbox.run_id": str(env.run_id),
            "sqla_outbox.task": env.task,
            "sqla_outbox.attempt": attempt.attempt,
            "sqla_outbox.tenant_id": env.tenant_id,
        }
        try:
            with tracing.handler_span(f"{env.task} process", env.trace, attributes):
                if definition.is_async:
                    self._bridge().run(self._run_async(definition, env.payload, ctx, attempt))
                else:
                    self._run_sync(definition, env.payload, ctx, attempt)
        except _LeaseLost:
            return self._status(env.run_id), None, None
        except errors.Retry as exc:
            return self._transient(attempt, exc, limit, trace=None, delay=exc.delay_seconds)
        except Exception as exc:
            trace = "".join(tb.format_exception(exc))
            if definition.is_permanent(exc):
                return self._fail(attempt, exc, reason="permanent-error", trace=trace)
            return self._transient(attempt, exc, limit, trace=trace)
        return "succeeded", None, None

    def _context(
        self, env: envelope.Envelope, attempt: runs.Attempt, definition: TaskDefinition
    ) -> TaskContext:
        timeout = definition.effective_timeout()
        return TaskContext(
            run_id=env.run_id,
            task=env.task,
            queue=env.queue,
            tenant_id=env.tenant_id,
            event=env.event,
            attempt=attempt.attempt,
            receive_count=attempt.receive_count,
            deadline_at=dt.datetime.now(dt.UTC) + dt.timedelta(seconds=timeout) if timeout else None,
            session=None,
            logger=logging.LoggerAdapter(
                logging.getLogger(f"sqla_outbox.task.{env.task}"),
                log_extra(
                    run_id=str(env.run_id), task=env.task, tenant_id=env.tenant_id, attempt=attempt.attempt
                ),
            ),
            _deadline_monotonic=time.monotonic() + timeout if timeout else None,
        )

    # --- executing (mirrors sqla_outbox.worker.handle._run_sync / _run_async) ---------------
    @staticmethod
    def _call(definition: TaskDefinition, payload: JSONValue, ctx: TaskContext) -> Any:
        return definition.handler(payload, ctx) if definition.takes_context else definition.handler(payload)

    def _run_sync(
        self, definition: TaskDefinition, payload: JSONValue, ctx: TaskContext, attempt: runs.Attempt
    ) -> None:
        with self.session_factory() as session:
            ctx.session = session
            self._call(definition, payload, ctx)
            if not runs.mark_succeeded(session.connection(), attempt):
                session.rollback()
                raise _LeaseLost
            session.commit()

    async def _run_async(
        self, definition: TaskDefinition, payload: JSONValue, ctx: TaskContext, attempt: runs.Attempt
    ) -> None:
        assert self._async is not None
        async with self._async.session_factory() as session:
            ctx.session = session
            await self._call(definition, payload, ctx)
            won = await session.run_sync(lambda s: runs.mark_succeeded(s.connection(), attempt))
            if not won:
                await session.rollback()
                raise _LeaseLost
            await session.commit()

    # --- verdicts --------------------------------------------------------------------------
    def _transient(
        self,
        attempt: runs.Attempt,
        exc: BaseException,
        limit: int,
        *,
        trace: str | None,
        delay: float | None = None,
    ) -> tuple[str, runs.Failure | None, str | None]:
        if attempt.receive_count >= limit:
            return self._fail(attempt, exc, reason="retries-exhausted", trace=trace)
        failure = runs.Failure.from_exception(exc, trace)
        # inline, the next attempt follows at once: the trail records the delay used (0 s)
        backoff = 0.0 if self.retries or delay is None else delay
        with self.engine.begin() as connection:
            moved = runs.mark_retrying(connection, attempt, failure, backoff_seconds=backoff)
        if not moved:
            return self._status(attempt.run_id), failure, None
        return "retrying", failure, None

    def _fail(
        self, attempt: runs.Attempt, exc: BaseException, *, reason: str, trace: str | None
    ) -> tuple[str, runs.Failure | None, str | None]:
        failure = runs.Failure.from_exception(exc, trace)
        with self.engine.begin() as connection:
            moved = runs.mark_failed(connection, attempt, failure, reason=reason)
        if not moved:
            return self._status(attempt.run_id), failure, None
        return "failed", failure, reason

    def _status(self, run_id: uuid.UUID) -> str:
        with self.engine.connect() as connection:
            return runs.current_status(connection, run_id) or "missing"

    def _mark_sent(self, table: str, run_id: uuid.UUID) -> None:
        with self.engine.begin() as connection:
            connection.execute(_MARK_SENT[table], {"run_id": run_id})

    # --- resources -------------------------------------------------------------------------
    def _bridge(self) -> _AsyncBridge:
        if self._async is None:
            self._async = _AsyncBridge(self.engine, self.settings, self.catalog)
        return self._async

    def close(self) -> None:
        if self._async is not None:
            self._async.close()
            self._async = None
        if self._installed_here is not None:
            uninstall(self._installed_here)
            self._installed_here = None


class _AsyncBridge:
    """An event loop for async handlers, and an installed ``async_sessionmaker`` on it.

    Without a running loop in the calling thread, the loop runs in this thread
    (``asyncio.Runner``); when the caller is itself inside a running loop (an async test
    calling the sync helper), the loop runs on a helper thread and the caller waits.
    The async engine uses the sync engine's URL with the psycopg 3 driver.
    """

    def __init__(self, engine: Engine, settings: OutboxSettings, catalog: Catalog) -> None:
        from sqlalchemy.ext.asyncio import async_sessionmaker, create_async_engine

        url = engine.url
        if url.drivername in ("postgresql", "postgres", "postgresql+psycopg2", "postgresql+pg8000"):
            url = url.set(drivername="postgresql+psycopg")
        self.engine = create_async_engine(url)
        self.session_factory: Any = async_sessionmaker(self.engine)
        install(self.session_factory, settings, catalog=catalog)
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            self._thread: concurrent.futures.ThreadPoolExecutor | None = None
        else:
            self._thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="sqla-outbox-testing")
        self._runner = asyncio.Runner()

    def run(self, coroutine: Coroutine[Any, Any, T]) -> T:
        if self._thread is None:
            return self._runner.run(coroutine)
        return self._thread.submit(self._runner.run, coroutine).result()

    def close(self) -> None:
        try:
            self.run(self.engine.dispose())
            if self._thread is None:
                self._runner.close()
            else:
                self._thread.submit(self._runner.close).result()
                self._thread.shutdown()
        finally:
            uninstall(self.session_factory)


# --------------------------------------------------------------------------------------
# bound helper (what the pytest plugin's ``outbox`` fixture gives)


class Outbox:
    """The helpers above bound to one application database.

    Reads go through ``session`` when a method is given one (uncommitted work of that
    transaction is visible), else through ``source`` (committed rows).

    Args:
        source: The application's installed ``sessionmaker`` (or an ``Engine``).
        registry / catalog / settings: Passed to :func:`run_pending`.
    """

    def __init__(
        self,
        source: Any,
        *,
        registry: Registry | None = None,
        catalog: Catalog | None = None,
        settings: OutboxSettings | None = None,
    ) -> None:
        self.source = source
        self.registry = registry
        self.catalog = catalog
        self.settings = settings

    def dispatched(
        self,
        *,
        task: str | AnyValue = ANY,
        event: str | AnyValue | None = ANY,
        tenant_id: int | AnyValue | None = ANY,
        session: Any = None,
    ) -> list[DispatchedRun]:
        """See :func:`dispatched`."""
        return dispatched(
            self.source if session is None else session, task=task, event=event, tenant_id=tenant_id
        )

    def assert_dispatched(
        self,
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
        session: Any = None,
    ) -> list[DispatchedRun]:
        """See :func:`assert_dispatched`."""
        return assert_dispatched(
            self.source if session is None else session,
            task,
            payload=payload,
            tenant_id=tenant_id,
            delay=delay,
            queue=queue,
            event=event,
            idempotency_key=idempotency_key,
            status=status,
            count=count,
        )

    def assert_not_dispatched(
        self,
        task: str,
        *,
        payload: PayloadMatcher = ANY,
        tenant_id: int | AnyValue | None = ANY,
        delay: DelayMatcher = ANY,
        queue: str | AnyValue = ANY,
        event: str | AnyValue | None = ANY,
        idempotency_key: str | AnyValue | None = ANY,
        status: str | AnyValue = ANY,
        session: Any = None,
    ) -> None:
        """See :func:`assert_not_dispatched`."""
        assert_not_dispatched(
            self.source if session is None else session,
            task,
            payload=payload,
            tenant_id=tenant_id,
            delay=delay,
            queue=queue,
            event=event,
            idempotency_key=idempotency_key,
            status=status,
        )

    def assert_published(
        self,
        event: str,
        *,
        payload: PayloadMatcher = ANY,
        tenant_id: int | AnyValue | None = ANY,
        delay: DelayMatcher = ANY,
        idempotency_key: str | AnyValue | None = ANY,
        subscribers: Iterable[str] | None = None,
        count: int | None = None,
        session: Any = None,
    ) -> list[DispatchedRun]:
        """See :func:`assert_published`."""
        return assert_published(
            self.source if session is None else session,
            event,
            payload=payload,
            tenant_id=tenant_id,
            delay=delay,
            idempotency_key=idempotency_key,
            subscribers=subscribers,
            count=count,
        )

    def run_pending(
        self,
        *,
        include_delayed: bool = False,
        retries: bool = True,
        tasks: Iterable[str] | None = None,
        max_rounds: int = 10,
    ) -> RunReport:
        """See :func:`run_pending` (with this object's source, registry, catalog and settings)."""
        return run_pending(
            self.source,
            registry=self.registry,
            catalog=self.catalog,
            settings=self.settings,
            include_delayed=include_delayed,
            retries=retries,
            tasks=tasks,
            max_rounds=max_rounds,
        )
