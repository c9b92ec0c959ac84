"""sqla_outbox: indexes for listing runs newest first (the dashboard, ``runs list``).

Revision ID: sqlaob_0003
Revises: sqlaob_0002
Create Date: 2026-11-30

Three btree indexes on ``task_runs``, each ending in ``created_at`` so a filtered list
ordered by ``created_at DESC`` with a keyset cursor reads only the rows it shows:

* ``task_runs_created_at_idx (created_at)``: every run, newest first; runs dispatched per
  minute; time-window filters;
* ``task_runs_task_created_at_idx (task, created_at)``: the runs of one task; the last run
  of a scheduled task;
* ``task_runs_tenant_id_created_at_idx (tenant_id, created_at)``: the runs of one tenant.

On a table of at least :data:`sqla_outbox.migrations.CONCURRENT_INDEX_MIN_ROWS` rows
(planner estimate) the indexes are built with ``CREATE INDEX CONCURRENTLY``, which does
not block dispatches (inserts) while it runs; PostgreSQL refuses it inside a transaction
block, so the migrations before it are committed first (Alembic's ``autocommit_block``).
A smaller table, and ``--sql`` output, get a plain ``CREATE INDEX`` in the migration's
transaction. An index a cancelled concurrent build left INVALID is dropped and built again.
"""

from __future__ import annotations

import sqlalchemy as sa

from alembic import op
from sqla_outbox import migrations

revision = "sqlaob_0003"
down_revision = "sqlaob_0002"
branch_labels = None
depends_on = None

INDEXES = {
    "task_runs_created_at_idx": ["created_at"],
    "task_runs_task_created_at_idx": ["task", "created_at"],
    "task_runs_tenant_id_created_at_idx": ["tenant_id", "created_at"],
}


def _large_table() -> bool:
    if op.get_context().as_sql:
        return False
    rows = op.get_bind().execute(sa.text("SELECT reltuples FROM pg_class WHERE oid = 'task_runs'::regclass"))
    estimate = rows.scalar()
    return estimate is not None and float(estimate) >= migrations.CONCURRENT_INDEX_MIN_ROWS


_INVALID = sa.text(
    "SELECT c.relname FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid "
    "WHERE i.indrelid = 'task_runs'::regclass AND NOT i.indisvalid"
)


def upgrade() -> None:
    if _large_table():
        with op.get_context().autocommit_block():
            invalid = {str(name) for name in op.get_bind().execute(_INVALID).scalars()}
            for name, columns in INDEXES.items():
                if name in invalid:
                    op.drop_index(op.f(name), table_name="task_runs", postgresql_concurrently=True)
                op.create_index(
                    op.f(name), "task_runs", columns, postgresql_concurrently=True, if_not_exists=True
                )
        return
    for name, columns in INDEXES.items():
        op.create_index(op.f(name), "task_runs", columns)


def downgrade() -> None:
    for name in INDEXES:
        op.drop_index(op.f(name), table_name="task_runs")
