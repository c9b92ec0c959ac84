"""Executing one attempt of a run: the part the worker and the inline test runner share.

No SQS here (and no boto3 import): given a leased attempt, build the handler's context,
call the handler in its own session, and commit the session together with
``running → succeeded`` (:func:`sqla_outbox.lifecycle.attempts.mark_succeeded`, guarded by the
attempt's lease). The callers decide what happens around it: the worker adds timeouts,
heartbeats and SQS verdicts (``handle.py``); ``sqla_outbox.testing`` runs attempts inline.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import logging
import time
from collections.abc import Callable, Iterator
from typing import Any

from sqlalchemy import event
from sqlalchemy.orm import Session

from sqla_outbox import envelope, errors, results
from sqla_outbox.config import OutboxSettings
from sqla_outbox.lifecycle import attempts
from sqla_outbox.logging import log_extra
from sqla_outbox.worker.context import TaskContext, bounded_detail
from sqla_outbox.worker.registry import TaskDefinition

_DEFAULT_RESULT_MAX_BYTES = int(OutboxSettings.__dataclass_fields__["result_max_bytes"].default)  # type: ignore[arg-type]


class LeaseLost(Exception):
    """The attempt no longer holds the run: its ``succeeded`` matched nothing (or it was
    cancelled first). Nothing the handler did through its session was committed."""


def make_context(
    env: envelope.Envelope,
    attempt: attempts.Attempt,
    definition: TaskDefinition,
    *,
    queue: str,
    settings: OutboxSettings | None = None,
) -> TaskContext:
    """The :class:`TaskContext` of an attempt (its session is set by the runners below)."""
    timeout = definition.effective_timeout()
    return TaskContext(
        run_id=env.run_id,
        task=env.task,
        queue=queue,
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
        settings=settings,
        _deadline_monotonic=time.monotonic() + timeout if timeout else None,
    )


def span_attributes(env: envelope.Envelope, attempt: attempts.Attempt, *, queue: str) -> dict[str, Any]:
    """OpenTelemetry attributes of the handler span."""
    return {
        "sqla_outbox.run_id": str(env.run_id),
        "sqla_outbox.task": env.task,
        "sqla_outbox.attempt": attempt.attempt,
        "sqla_outbox.tenant_id": env.tenant_id,
        "messaging.system": "aws_sqs",
        "messaging.destination.name": queue,
    }


def encoded_result(definition: TaskDefinition, value: object, ctx: TaskContext) -> str | None:
    """The handler's return value as JSON text for ``task_runs.result`` (None for None).

    Raises:
        ResultNotSerializable, ResultTooLarge: Permanent errors (``sqla_outbox.results``).
    """
    limit = ctx.settings.result_max_bytes if ctx.settings is not None else _DEFAULT_RESULT_MAX_BYTES
    return results.encode_result(definition.name, value, max_bytes=limit)


def call(definition: TaskDefinition, payload: Any, ctx: TaskContext) -> Any:
    """Call the handler with ``(payload, ctx)`` or ``(payload)``, as it was declared."""
    return definition.handler(payload, ctx) if definition.takes_context else definition.handler(payload)


@contextlib.contextmanager
def _commit_refused(session: Session, task: str) -> Iterator[None]:
    """While the handler runs, its session's ``commit()`` raises HandlerCommitForbidden.

    SQLAlchemy's ``before_commit`` also fires when a savepoint (``begin_nested()``) is
    released; that is allowed: only the outermost transaction's commit is refused. A
    handler that catches the error and returns normally still fails: the refusal is
    raised again when the handler returns."""
    refused: list[errors.HandlerCommitForbidden] = []

    def refuse(session: Session) -> None:
        if session.get_nested_transaction() is None:
            refused.append(errors.HandlerCommitForbidden(task))
            raise refused[-1]

    event.listen(session, "before_commit", refuse)
    try:
        yield
    finally:
        event.remove(session, "before_commit", refuse)
    if refused:
        raise refused[0]


def run_sync(
    session_factory: Callable[[], Any],
    definition: TaskDefinition,
    payload: Any,
    ctx: TaskContext,
    attempt: attempts.Attempt,
) -> None:
    """Run a sync handler in a new session; commit it with ``succeeded`` and its result.

    Raises:
        LeaseLost: The attempt was cancelled or lost the run; the session was rolled back.
        ResultNotSerializable, ResultTooLarge: The handler's return value cannot be stored.
        Exception: Whatever the handler raised (the session is rolled back).
    """
    with session_factory() as session:
        ctx.session = session
        with _commit_refused(session, definition.name):
            value = call(definition, payload, ctx)
        result = encoded_result(definition, value, ctx)
        detail = bounded_detail(ctx.trail_detail)
        if ctx.cancelled or not attempts.mark_succeeded(
            session.connection(), attempt, detail=detail, result=result
        ):
            session.rollback()
            raise LeaseLost
        session.commit()


async def run_async(
    session_factory: Callable[[], Any],
    definition: TaskDefinition,
    payload: Any,
    ctx: TaskContext,
    attempt: attempts.Attempt,
) -> None:
    """Run an async handler in a new ``AsyncSession``; commit it with ``succeeded`` and its result.

    Raises:
        LeaseLost: The attempt lost the run; the session was rolled back.
        ResultNotSerializable, ResultTooLarge: The handler's return value cannot be stored.
        Exception: Whatever the handler raised.
    """
    async with session_factory() as session:
        ctx.session = session
        with _commit_refused(session.sync_session, definition.name):
            value = await call(definition, payload, ctx)
        result = encoded_result(definition, value, ctx)
        detail = bounded_detail(ctx.trail_detail)
        won = await session.run_sync(
            lambda s: attempts.mark_succeeded(s.connection(), attempt, detail=detail, result=result)
        )
        if not won:
            await session.rollback()
            raise LeaseLost
        await session.commit()
