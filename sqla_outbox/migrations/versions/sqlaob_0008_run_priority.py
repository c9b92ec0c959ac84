"""sqla_outbox: the run's own priority on ``task_runs``.

Revision ID: sqlaob_0008
Revises: sqlaob_0007
Create Date: 2026-12-03

* ``task_runs.priority`` (1..10, lower first; default 3): the priority the run was
  dispatched with, written at dispatch beside the outbox row's copy. Every statement that
  writes an outbox row again after its creation (a deferral whose row was purged, a DLQ
  requeue, a re-send) takes the priority from here, so a run keeps its priority when its
  outbox row is gone. Adding a column with a constant default does not rewrite the table
  (PostgreSQL 11 and later keep the default in the catalog).
* Unfinished runs take the priority of their outbox row (finished runs keep the default:
  nothing sends them again unless an operator requeues them, at the manual priority).

Literal names only, wrapped in ``op.f()``; never imports the models.
"""

from __future__ import annotations

import sqlalchemy as sa

from alembic import op

revision = "sqlaob_0008"
down_revision = "sqlaob_0007"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column(
        "task_runs", sa.Column("priority", sa.SmallInteger(), server_default=sa.text("3"), nullable=False)
    )
    op.create_check_constraint(op.f("task_runs_priority_check"), "task_runs", "priority BETWEEN 1 AND 10")
    for table in ("outbox_messages", "platform_outbox_messages"):
        op.execute(
            f"""
UPDATE task_runs AS r SET priority = o.priority
FROM {table} AS o
WHERE o.run_id = r.run_id AND o.priority <> 3 AND r.status IN ('queued', 'running', 'retrying')
"""
        )


def downgrade() -> None:
    op.drop_constraint(op.f("task_runs_priority_check"), "task_runs", type_="check")
    op.drop_column("task_runs", "priority")
