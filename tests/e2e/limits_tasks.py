"""Tasks with flow control for the limits e2e tests (``tests/e2e/test_limits_process.py``).

Each successful attempt writes one ``effects`` row (its ``at`` is when the handler ran),
so a test counts executions and sees when they started.
"""

from __future__ import annotations

import os
import time
import urllib.error
import urllib.request
from typing import Any

from sqla_outbox.worker import Breaker, RetryPolicy, TaskContext, task
from tests.e2e.rolling_old_tasks import record

STUB = Breaker("stub-api", failures=3, open_seconds=3, successes=2)


def _hold(payload: dict[str, Any]) -> None:
    """Keep running while the file named by ``hold_while`` exists (at most 120 s)."""
    path = payload.get("hold_while")
    deadline = time.monotonic() + 120
    while path and os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.05)


@task("limits.single", queue="default", concurrency=1)
def single(payload: dict[str, Any], ctx: TaskContext) -> None:
    record(ctx)
    _hold(payload)
    time.sleep(float(payload.get("sleep", 0)))


@task("limits.rated", queue="default", rate_limit="4/2s")
def rated(payload: dict[str, Any], ctx: TaskContext) -> None:
    record(ctx)


def _call_stub() -> None:
    url = os.environ["LIMITS_STUB_URL"]
    try:
        with urllib.request.urlopen(urllib.request.Request(url, data=b"{}"), timeout=5) as reply:
            reply.read()
    except urllib.error.HTTPError as exc:
        raise RuntimeError(f"stub answered {exc.code}") from None


@task("limits.charge", queue="default", breaker=STUB)
def charge(payload: dict[str, Any], ctx: TaskContext) -> None:
    _call_stub()
    record(ctx)


@task(
    "limits.flaky",
    queue="default",
    # an outage of more than 4 s spends tries again (max_outage_seconds)
    breaker=Breaker("flaky-api", failures=1, open_seconds=3, successes=1, max_outage_seconds=4),
    retry=RetryPolicy(max_receives=3, backoff_base_seconds=0.5, backoff_max_seconds=1),
)
def flaky(payload: dict[str, Any], ctx: TaskContext) -> None:
    raise RuntimeError("the integration is down")


LAB = Breaker("lab-api", failures=3, open_seconds=1, successes=1, max_outage_seconds=20)
"""A breaker that opens on the failure that would spend a run's last try (3 of 3), as the
defaults do (5 of 5)."""


@task(
    "limits.lab_order",
    queue="default",
    breaker=LAB,
    retry=RetryPolicy(max_receives=3, backoff_base_seconds=0.2, backoff_max_seconds=0.5),
)
def lab_order(payload: dict[str, Any], ctx: TaskContext) -> None:
    _call_stub()
    record(ctx)


@task("limits.refund", queue="default", breaker="stub-api")
def refund(payload: dict[str, Any], ctx: TaskContext) -> None:
    _call_stub()
    record(ctx)
