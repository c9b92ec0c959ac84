"""The "old code" of the rolling-deploy tests: ``audit`` only (``send_welcome`` is new).

Each successful attempt writes one ``effects`` row, so a test counts executions."""

from __future__ import annotations

import os
from typing import Any

import sqlalchemy as sa

from sqla_outbox.worker import TaskContext, task

INSERT = sa.text(
    "INSERT INTO effects (run_id, task, attempt, worker, note) VALUES (:run_id, :task, :attempt, :worker, '')"
)


def record(ctx: TaskContext) -> None:
    ctx.session.execute(
        INSERT, {"run_id": ctx.run_id, "task": ctx.task, "attempt": ctx.attempt, "worker": str(os.getpid())}
    )


@task("audit", queue="default")
def audit(payload: dict[str, Any], ctx: TaskContext) -> None:
    record(ctx)
