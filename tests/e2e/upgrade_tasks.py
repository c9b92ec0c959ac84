"""Tasks both the previous release's worker and this one can import (tests/e2e/test_upgrade.py):
only the API every release has (``@task``, ``TaskContext``, ``ctx.session``)."""

from __future__ import annotations

import os
from typing import Any

import sqlalchemy as sa

from sqla_outbox.worker import TaskContext, task

_EFFECT = sa.text(
    "INSERT INTO effects (run_id, task, attempt, worker, note) VALUES (:r, :t, :a, :w, 'upgrade')"
)


def _record(ctx: TaskContext, name: str) -> None:
    ctx.session.execute(_EFFECT, {"r": ctx.run_id, "t": name, "a": ctx.attempt, "w": str(os.getpid())})


@task("audit", queue="default")
def audit(payload: dict[str, Any], ctx: TaskContext) -> None:
    _record(ctx, "audit")


@task("charge_card", queue="critical", scope="tenant")
def charge_card(payload: dict[str, Any], ctx: TaskContext) -> None:
    _record(ctx, "charge_card")
