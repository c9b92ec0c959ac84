"""sqla_outbox: parked outbox rows (send refusals) and the last dispatched slot of each schedule.

Revision ID: sqlaob_0004
Revises: sqlaob_0003
Create Date: 2026-11-30

* ``parked_at`` and ``last_error`` on both outbox tables: a row SQS refuses for good (or
  after ``relay_max_send_attempts`` refusals) is parked instead of retried forever, and
  every failed send records its SQS error code and message. The pending index leaves
  parked rows out (the relay never claims them); a small partial index finds them.
* ``schedule_slots``: the latest slot the relay dispatched for each scheduled task, so a
  restart never dispatches a slot again after ``maintenance.purge`` deleted its run.

Literal names only, wrapped in ``op.f()``; never imports the models.
"""

from __future__ import annotations

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql

from alembic import op

revision = "sqlaob_0004"
down_revision = "sqlaob_0003"
branch_labels = None
depends_on = None

TIMESTAMPTZ = sa.DateTime(timezone=True)
OUTBOX_TABLES = ("outbox_messages", "platform_outbox_messages")


def upgrade() -> None:
    for table in OUTBOX_TABLES:
        op.add_column(table, sa.Column("parked_at", TIMESTAMPTZ, nullable=True))
        op.add_column(table, sa.Column("last_error", sa.Text(), nullable=True))
        op.create_check_constraint(
            op.f(f"{table}_parked_check"), table, "sent_at IS NULL OR parked_at IS NULL"
        )
        op.drop_index(op.f(f"{table}_pending_idx"), table_name=table)
        op.create_index(
            op.f(f"{table}_pending_idx"),
            table,
            ["available_at", "id"],
            postgresql_where=sa.text("sent_at IS NULL AND parked_at IS NULL"),
        )
        op.create_index(
            op.f(f"{table}_parked_idx"),
            table,
            ["parked_at"],
            postgresql_where=sa.text("parked_at IS NOT NULL"),
        )
    op.create_table(
        "schedule_slots",
        sa.Column("task", sa.Text(), nullable=False),
        sa.Column("last_slot", TIMESTAMPTZ, nullable=False),
        sa.Column("run_id", postgresql.UUID(as_uuid=True), nullable=False),
        sa.Column("updated_at", TIMESTAMPTZ, server_default=sa.text("clock_timestamp()"), nullable=False),
        sa.PrimaryKeyConstraint("task", name=op.f("schedule_slots_pkey")),
    )


def downgrade() -> None:
    op.drop_table("schedule_slots")
    for table in OUTBOX_TABLES:
        op.drop_index(op.f(f"{table}_parked_idx"), table_name=table)
        op.drop_index(op.f(f"{table}_pending_idx"), table_name=table)
        op.create_index(
            op.f(f"{table}_pending_idx"),
            table,
            ["available_at", "id"],
            postgresql_where=sa.text("sent_at IS NULL"),
        )
        op.drop_constraint(op.f(f"{table}_parked_check"), table, type_="check")
        op.drop_column(table, "last_error")
        op.drop_column(table, "parked_at")
