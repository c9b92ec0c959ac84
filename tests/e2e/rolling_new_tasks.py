"""The "new code" of the rolling-deploy tests: ``audit`` and the new ``send_welcome``."""

from __future__ import annotations

from typing import Any

from sqla_outbox.worker import TaskContext, task
from tests.e2e.rolling_old_tasks import audit, record  # noqa: F401 - the old task is still there


@task("send_welcome", queue="default")
def send_welcome(payload: dict[str, Any], ctx: TaskContext) -> None:
    record(ctx)
