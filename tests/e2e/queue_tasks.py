"""A queue of the application's own and a task on it, for the custom-queue e2e tests."""

from __future__ import annotations

from typing import Any

from sqla_outbox.worker import TaskContext, queue, task
from tests.e2e.worker_tasks import behave

queue("reminders", visibility_timeout_seconds=1800, max_receive_count=9, weight=3)


@task("remind", queue="reminders", scope="tenant")
def remind(payload: dict[str, Any], ctx: TaskContext) -> None:
    behave(payload, ctx)
