"""Handler results: what a handler returns, stored on its run, readable from Python.

A handler may return a JSON value (a dict, list, str, int, finite float, bool; None stores
nothing). The worker encodes it with :func:`encode_result` and writes it to
``task_runs.result`` in the transaction that marks the run ``succeeded``, together with
whatever the handler did through ``ctx.session``: a run is never ``succeeded`` without
its result, nor the other way round.

A result that is not plain JSON (a model object, NaN, a set) or larger than
``result_max_bytes`` (UTF-8 JSON, default 64 KiB) fails the run permanently
(:class:`~sqla_outbox.errors.ResultNotSerializable`,
:class:`~sqla_outbox.errors.ResultTooLarge`): a retry would compute the same value, so
the run takes the permanent path (``failed``, DLQ) with an error naming the task, and the
handler's session is rolled back. Store large outputs elsewhere and return a reference.

Reading: :func:`get_result` (a ``Session``, ``Connection`` or ``Engine``) and
:func:`get_result_async` (an ``AsyncSession``, ``AsyncConnection`` or ``AsyncEngine``).
With ``wait``, they poll the run's row (a primary-key lookup) with backoff, 20 ms
doubling to 1 s, until it finishes or the wait ends. Polling, not ``LISTEN/NOTIFY``: it
costs the worker nothing (no ``NOTIFY`` in every success), needs no dedicated connection
and works through transaction-mode poolers; a waiter sees a result at most about a
second late. Each poll reads in a fresh snapshot: with a ``Session``, the wait runs
outside the session's transaction (it uses the session's bind).
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime as dt
import json
import time
import uuid
from typing import Any

from sqlalchemy import bindparam, text
from sqlalchemy.dialects.postgresql import UUID
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.orm import Session

from sqla_outbox import backoff, errors
from sqla_outbox.types import FINISHED_STATUSES, JSONValue

FIRST_POLL_SECONDS = 0.02
MAX_POLL_SECONDS = 1.0

_READ = text(
    "SELECT run_id, task, status, result, last_error_type, last_error, finished_at "
    "FROM task_runs WHERE run_id = :run_id"
).bindparams(bindparam("run_id", type_=UUID(as_uuid=True)))


def encode_result(task: str, value: object, *, max_bytes: int) -> str | None:
    """The handler's return value as compact JSON text, or None for ``None``.

    Args:
        task: The task (named in errors).
        value: What the handler returned.
        max_bytes: ``settings.result_max_bytes``.

    Raises:
        ResultNotSerializable: Not plain JSON (NaN/Infinity, non-string keys, other types),
            or text PostgreSQL's jsonb cannot store (NUL, lone surrogates).
        ResultTooLarge: Longer than ``max_bytes`` as UTF-8.
    """
    if value is None:
        return None
    try:
        encoded = json.dumps(value, allow_nan=False, ensure_ascii=False, separators=(",", ":"))
    except (TypeError, ValueError, RecursionError) as exc:
        raise errors.ResultNotSerializable(task, f"{type(exc).__name__}: {exc}"[:200]) from None
    if "\\u0000" in encoded:
        raise errors.ResultNotSerializable(task, "holds a NUL character (jsonb cannot store it)")
    try:
        size = len(encoded.encode("utf-8"))
    except UnicodeEncodeError:
        raise errors.ResultNotSerializable(task, "holds a lone surrogate (not UTF-8)") from None
    if size > max_bytes:
        raise errors.ResultTooLarge(task, size_bytes=size, limit_bytes=max_bytes)
    return encoded


@dataclasses.dataclass(frozen=True)
class RunResult:
    """A run's outcome as :func:`get_result` read it.

    Attributes:
        run_id / task: The run.
        status: Its status (queued, running, retrying, succeeded, failed, cancelled).
        value: The handler's result (``succeeded`` only; None when it returned None).
        error_type / error: The last error, for a failed run.
        finished_at: When it finished, or None.
    """

    run_id: uuid.UUID
    task: str
    status: str
    value: JSONValue
    error_type: str | None
    error: str | None
    finished_at: dt.datetime | None

    @property
    def finished(self) -> bool:
        """True once the run succeeded, failed or was cancelled."""
        return self.status in FINISHED_STATUSES

    @property
    def succeeded(self) -> bool:
        return self.status == "succeeded"


def _record(run_id: uuid.UUID, row: Any) -> RunResult:
    if row is None:
        raise errors.RunNotFound(run_id)
    return RunResult(
        run_id=row.run_id,
        task=row.task,
        status=row.status,
        value=row.result,
        error_type=row.last_error_type,
        error=row.last_error,
        finished_at=row.finished_at,
    )


def _check_wait(wait: float | None) -> float | None:
    if wait is not None and (isinstance(wait, bool) or not isinstance(wait, int | float) or not wait >= 0):
        raise errors.ConfigurationError(f"must be None or seconds >= 0, got {wait!r}", option="wait")
    return wait


def _delays(wait: float) -> Any:
    deadline = time.monotonic() + wait
    delay = backoff.Doubling(FIRST_POLL_SECONDS, MAX_POLL_SECONDS)
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return
        yield min(delay.current, left)
        delay.grow()


def get_result(
    source: Session | Connection | Engine, run_id: uuid.UUID, *, wait: float | None = None
) -> RunResult:
    """Read a run's status and result; with ``wait``, until it finishes.

    Args:
        source: A ``Session`` (read through its connection when ``wait`` is None, so it
            sees the session's own transaction; through its bind when waiting), a
            ``Connection`` (its transaction) or an ``Engine`` (a short connection per read).
        run_id: The run (``Dispatch.run_id``).
        wait: None or 0: read once. Seconds: poll until the run finished or this long
            passed (module docstring); a run that does not exist yet is waited for too (a
            group's completion run is written when its last member finishes).

    Returns:
        A :class:`RunResult`; ``.value`` holds the result of a ``succeeded`` run.

    Raises:
        RunNotFound: No such run (never dispatched, not committed yet, or purged); with
            ``wait``, none appeared within it.
        ResultTimeout: ``wait`` passed and the run has not finished.
        ConfigurationError: ``wait`` is negative or not a number.
    """
    wait = _check_wait(wait)
    started = time.monotonic()
    if not wait:
        return _read_once(source, run_id)
    engine = _engine_of(source)
    record = _read_if_there(engine, run_id)
    for delay in _delays(wait):
        if record is not None and record.finished:
            return record
        time.sleep(delay)
        record = _read_if_there(engine, run_id)
    return _after_wait(run_id, record, started)


def _read_if_there(engine: Engine, run_id: uuid.UUID) -> RunResult | None:
    """A waiting read: a run not there yet (a group's completion run, written when the last
    member finishes; a dispatch whose transaction has not committed) is None, not an error."""
    try:
        return _read_once(engine, run_id)
    except errors.RunNotFound:
        return None


def _after_wait(run_id: uuid.UUID, record: RunResult | None, started: float) -> RunResult:
    if record is None:
        raise errors.RunNotFound(run_id)
    if record.finished:
        return record
    raise errors.ResultTimeout(run_id, status=record.status, waited_seconds=time.monotonic() - started)


def _read_once(source: Session | Connection | Engine, run_id: uuid.UUID) -> RunResult:
    if isinstance(source, Engine):
        with source.connect() as connection:
            return _record(run_id, connection.execute(_READ, {"run_id": run_id}).one_or_none())
    if isinstance(source, Session):
        source = source.connection()
    return _record(run_id, source.execute(_READ, {"run_id": run_id}).one_or_none())


def _engine_of(source: Session | Connection | Engine) -> Engine:
    if isinstance(source, Engine):
        return source
    if isinstance(source, Connection):
        return source.engine
    bind = source.get_bind()
    return bind if isinstance(bind, Engine) else bind.engine


async def get_result_async(source: Any, run_id: uuid.UUID, *, wait: float | None = None) -> RunResult:
    """:func:`get_result` for asyncio: ``source`` is an ``AsyncSession``,
    ``AsyncConnection`` or ``AsyncEngine``; the wait sleeps with ``asyncio.sleep``.

    Raises:
        RunNotFound, ResultTimeout, ConfigurationError: As :func:`get_result`.
    """
    from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, AsyncSession

    wait = _check_wait(wait)
    started = time.monotonic()

    async def read(target: Any) -> RunResult:
        if isinstance(target, AsyncEngine):
            async with target.connect() as connection:
                row = (await connection.execute(_READ, {"run_id": run_id})).one_or_none()
        else:
            row = (await target.execute(_READ, {"run_id": run_id})).one_or_none()
        return _record(run_id, row)

    if not wait:
        return await read(source)
    if isinstance(source, AsyncEngine):
        engine = source
    elif isinstance(source, AsyncConnection):
        engine = source.engine
    elif isinstance(source, AsyncSession) and isinstance(source.bind, AsyncEngine):
        engine = source.bind
    elif isinstance(source, AsyncSession) and isinstance(source.bind, AsyncConnection):
        engine = source.bind.engine
    else:
        raise errors.ConfigurationError(
            f"expected an AsyncSession (bound to an engine or connection), AsyncConnection or "
            f"AsyncEngine, got {type(source).__name__}",
            option="source",
        )

    async def read_if_there() -> RunResult | None:
        try:
            return await read(engine)
        except errors.RunNotFound:
            return None

    record = await read_if_there()
    for delay in _delays(wait):
        if record is not None and record.finished:
            return record
        await asyncio.sleep(delay)
        record = await read_if_there()
    return _after_wait(run_id, record, started)
