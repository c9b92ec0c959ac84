"""sqla_outbox: the ``cancelled`` run status, cancel requests and handler results.

Revision ID: sqlaob_0005
Revises: sqlaob_0004
Create Date: 2026-11-30

* ``task_runs.status`` may be ``cancelled`` (the CHECK constraint is replaced); the
  partial index of finished runs (``task_runs_finished_idx``, used by the purge) covers it.
* ``task_runs.cancel_requested_at``: when a committed ``Cancel`` asked a running run to
  stop; the worker's heartbeat reads it (``docs/cancellation.md``).
* ``task_runs.result``: the JSON value a handler returned, written with ``succeeded``
  (``docs/results.md``).
* ``task_runs_task_idempotency_key_idx``: a cancel or reschedule by idempotency key finds
  the key's run, finished or not (the unique indexes cover unfinished runs only).

Literal names only, wrapped in ``op.f()``; never imports the models.
"""

from __future__ import annotations

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql

from alembic import op

revision = "sqlaob_0005"
down_revision = "sqlaob_0004"
branch_labels = None
depends_on = None

TIMESTAMPTZ = sa.DateTime(timezone=True)
OLD_STATUSES = "'queued', 'running', 'retrying', 'succeeded', 'failed'"
NEW_STATUSES = OLD_STATUSES + ", 'cancelled'"


def _replace_finished_index(statuses: str) -> None:
    op.drop_index(op.f("task_runs_finished_idx"), table_name="task_runs")
    op.create_index(
        op.f("task_runs_finished_idx"),
        "task_runs",
        ["finished_at"],
        postgresql_where=sa.text(f"status IN ({statuses})"),
    )


def upgrade() -> None:
    op.add_column("task_runs", sa.Column("cancel_requested_at", TIMESTAMPTZ, nullable=True))
    op.add_column("task_runs", sa.Column("result", postgresql.JSONB(), nullable=True))
    op.drop_constraint(op.f("task_runs_status_check"), "task_runs", type_="check")
    op.create_check_constraint(op.f("task_runs_status_check"), "task_runs", f"status IN ({NEW_STATUSES})")
    _replace_finished_index("'succeeded', 'failed', 'cancelled'")
    op.create_index(
        op.f("task_runs_task_idempotency_key_idx"),
        "task_runs",
        ["task", "idempotency_key"],
        postgresql_where=sa.text("idempotency_key IS NOT NULL"),
    )


def downgrade() -> None:
    op.drop_index(op.f("task_runs_task_idempotency_key_idx"), table_name="task_runs")
    # runs cancelled under this revision have no status the older schema allows: they
    # are recorded as failed, with the cancellation kept as their last error
    op.execute(
        "UPDATE task_runs SET status = 'failed', last_error_type = 'cancelled', "
        "last_error = COALESCE(last_error, 'cancelled') WHERE status = 'cancelled'"
    )
    _replace_finished_index("'succeeded', 'failed'")
    op.drop_constraint(op.f("task_runs_status_check"), "task_runs", type_="check")
    op.create_check_constraint(op.f("task_runs_status_check"), "task_runs", f"status IN ({OLD_STATUSES})")
    op.drop_column("task_runs", "result")
    op.drop_column("task_runs", "cancel_requested_at")
