"""Handlers of the chaos run. Each success records one ``effects`` row through the handler's
session; the verification counts them (exactly one per succeeded run, none per failed run).

Payload flags: ``doomed`` → permanent failure (expected ``failed`` + DLQ); ``flaky`` → a
transient failure on the first attempt; ``text`` → that failure's message holds characters
PostgreSQL and SQS refuse (:data:`HOSTILE_TEXT`); ``work_ms`` → how long the handler takes
(so kills land mid-handler).
"""

from __future__ import annotations

import os
import time
from typing import Any

import sqlalchemy as sa

from sqla_outbox import errors
from sqla_outbox.worker import RetryPolicy, TaskContext, task

INSERT = sa.text(
    "INSERT INTO effects (run_id, task, attempt, worker, note) VALUES (:run_id, :task, :attempt, :worker, '')"
)
RETRY = RetryPolicy(max_receives=5, backoff_base_seconds=0.3, backoff_max_seconds=2)
HOSTILE_TEXT = "upstream said \x00, then \x1b[2J\x1b[31m, a bell \x07, a lone \ud800 and \uffff"
"""An error message with NUL, escape sequences, a bell, a lone surrogate and a non-character."""


def fail_as_asked(payload: dict[str, Any], ctx: TaskContext) -> None:
    text = HOSTILE_TEXT if payload.get("text") else ""
    if payload.get("doomed"):
        raise errors.ValidationFailed(text or "doomed by the chaos driver")
    if payload.get("flaky") and ctx.attempt == 1:
        raise ConnectionError(text or "flaky on the first attempt")


def work(payload: dict[str, Any], ctx: TaskContext) -> None:
    fail_as_asked(payload, ctx)
    deadline = time.monotonic() + payload.get("work_ms", 0) / 1000
    while time.monotonic() < deadline and not ctx.cancelled:
        time.sleep(0.01)
    ctx.session.execute(
        INSERT, {"run_id": ctx.run_id, "task": ctx.task, "attempt": ctx.attempt, "worker": str(os.getpid())}
    )


@task("chaos.critical", queue="critical", retry=RETRY, timeout_seconds=10)
def critical(payload: dict[str, Any], ctx: TaskContext) -> None:
    work(payload, ctx)


@task("chaos.default", queue="default", retry=RETRY, timeout_seconds=10)
def default(payload: dict[str, Any], ctx: TaskContext) -> None:
    work(payload, ctx)


@task("chaos.bulk", queue="bulk", retry=RETRY, timeout_seconds=10, subscribes=["chaos.happened"])
def bulk(payload: dict[str, Any], ctx: TaskContext) -> None:
    work(payload, ctx)


@task(
    "chaos.maintenance", queue="maintenance", retry=RETRY, timeout_seconds=10, subscribes=["chaos.happened"]
)
async def maintenance(payload: dict[str, Any], ctx: TaskContext) -> None:
    fail_as_asked(payload, ctx)
    await ctx.session.execute(
        INSERT, {"run_id": ctx.run_id, "task": ctx.task, "attempt": ctx.attempt, "worker": str(os.getpid())}
    )
