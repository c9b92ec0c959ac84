"""Handlers the e2e tests run in real worker processes; payload["mode"] picks a behaviour.

Every successful attempt writes one ``effects`` row through the handler's session, so a
test can count how many times a run's effects were committed.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from typing import Any

import sqlalchemy as sa

from sqla_outbox import Dispatch, errors, groups
from sqla_outbox.worker import RetryPolicy, TaskContext, task

INSERT = sa.text(
    "INSERT INTO effects (run_id, task, attempt, worker, note) "
    "VALUES (:run_id, :task, :attempt, :worker, :note)"
)


def record(ctx: TaskContext, note: str = "") -> None:
    ctx.session.execute(
        INSERT,
        {
            "run_id": ctx.run_id,
            "task": ctx.task,
            "attempt": ctx.attempt,
            "worker": str(os.getpid()),
            "note": note,
        },
    )


def mark(path: str, line: str) -> None:
    """Append ``line`` to a marker file (outside the database: survives a rollback)."""
    with open(path, "a") as marker:
        marker.write(line + "\n")


def behave(payload: dict[str, Any], ctx: TaskContext) -> Any:
    mode = payload.get("mode", "ok")
    if mode == "result":
        record(ctx, note="result")
        return payload["value"]
    if mode == "big_result":
        record(ctx, note="big_result")
        return "x" * payload["size"]
    if mode == "not_json_result":
        return {"at": {1, 2}}
    if mode == "wait_for_cancel":
        mark(payload["marker"], "started")
        deadline = time.monotonic() + payload.get("seconds", 30)
        while time.monotonic() < deadline and not ctx.cancelled:
            time.sleep(0.02)
        mark(payload["marker"], "saw-cancel" if ctx.cancelled else "no-cancel")
        record(ctx, note="after-cancel")  # rolled back: the run ends cancelled
        ctx.check_cancelled()
        return None
    if mode == "fail_times" and ctx.attempt <= payload["times"]:
        raise ConnectionError(f"flaky dependency (attempt {ctx.attempt})")
    if mode == "always_fail":
        raise RuntimeError("this never works")
    if mode == "sleep_then_permanent":
        time.sleep(payload["seconds"])
        raise errors.ValidationFailed("refused after thinking about it")
    if mode == "permanent":
        raise errors.ValidationFailed("order 7 has no lines")
    if mode == "permanent_until_fixed" and not os.path.exists(payload["fixed"]):
        raise errors.ValidationFailed("the <b>order service</b> refused order 7")
    if mode == "permanent_text":  # text from outside: PostgreSQL and SQS refuse some of it
        raise errors.PermanentError(payload["text"])
    if mode == "transient_text" and ctx.attempt == 1:
        raise RuntimeError(payload["text"])
    if mode == "keyerror":
        raise KeyError("missing-sku")
    if mode == "retry_in":
        if ctx.attempt == 1:
            raise errors.Retry(payload["seconds"])
    if mode == "sleep_then_fail" and ctx.attempt == 1:  # still running when the message comes back
        mark(payload["marker"], "started")
        time.sleep(payload["seconds"])
        raise ConnectionError("the dependency went away while the handler ran")
    if mode == "own_timeout_error":
        raise TimeoutError("the handler's own HTTP call timed out")
    if mode == "sleep":
        if ctx.attempt <= payload.get("attempts", 99):
            deadline = time.monotonic() + payload["seconds"]
            while time.monotonic() < deadline and not ctx.cancelled:
                time.sleep(0.05)
            if ctx.cancelled:
                return
    if mode == "sleep_ignoring_cancel" and ctx.attempt == 1:
        time.sleep(payload["seconds"])
    if mode == "record_payload":
        record(ctx, note=json.dumps(payload))
        return
    if mode == "followup":
        ctx.session.add(Dispatch("send_welcome", {"mode": "ok", "from": str(ctx.run_id)}))
    if mode == "followup_then":  # chain: the follow-up is written with this attempt's success
        ctx.session.add(Dispatch("send_welcome", {"mode": "ok", "from": str(ctx.run_id)}))
        then = payload.get("then")
        if then == "fail_times" and ctx.attempt <= payload["times"]:
            raise ConnectionError(f"flaky after dispatching (attempt {ctx.attempt})")
        if then == "permanent":
            raise errors.ValidationFailed("refused after dispatching")
    if mode == "barrier":  # members finish together: wait until every member reached here
        directory = payload["dir"]
        open(os.path.join(directory, str(ctx.run_id)), "w").close()
        deadline = time.monotonic() + 20
        while len(os.listdir(directory)) < payload["n"] and time.monotonic() < deadline:
            time.sleep(0.01)
    if mode == "group_done":
        state = groups.outcome(ctx.session, ctx.run_id)
        record(ctx, note=json.dumps(state.statuses if state else None, sort_keys=True))
        return
    record(ctx, note=mode)


@task("audit", queue="default", timeout_seconds=60)
def audit(payload: dict[str, Any], ctx: TaskContext) -> Any:
    return behave(payload, ctx)


@task("send_welcome", queue="default")
def send_welcome(payload: dict[str, Any], ctx: TaskContext) -> None:
    behave(payload, ctx)


@task(
    "charge_card",
    queue="critical",
    scope="tenant",
    timeout_seconds=1.5,
    permanent=(KeyError,),
    retry=RetryPolicy(backoff_base_seconds=0.5, backoff_max_seconds=1),
)
def charge_card(payload: dict[str, Any], ctx: TaskContext) -> None:
    behave(payload, ctx)


@task("index_user", queue="bulk", subscribes=["user.created"])
async def index_user(payload: dict[str, Any], ctx: TaskContext) -> Any:
    if payload.get("mode") == "wait_for_cancel":
        mark(payload["marker"], "started")
        try:
            await asyncio.sleep(payload.get("seconds", 30))
        except asyncio.CancelledError:
            mark(payload["marker"], "saw-cancel" if ctx.cancelled else "cancelled-without-signal")
            raise
    if payload.get("mode") == "result":
        return payload["value"]
    if payload.get("mode") == "sleep":
        await asyncio.sleep(payload["seconds"])
    if payload.get("mode") == "fail_times" and ctx.attempt <= payload["times"]:
        raise ConnectionError("search cluster busy")
    await ctx.session.execute(
        INSERT,
        {
            "run_id": ctx.run_id,
            "task": ctx.task,
            "attempt": ctx.attempt,
            "worker": str(os.getpid()),
            "note": "async",
        },
    )


@task("rebuild_cache", queue="maintenance", scope="platform")
def rebuild_cache(payload: dict[str, Any], ctx: TaskContext) -> None:
    behave(payload, ctx)
