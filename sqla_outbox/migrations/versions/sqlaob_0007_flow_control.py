"""sqla_outbox: flow control (run priority, pauses, tenant weights and rate limits).

Revision ID: sqlaob_0007
Revises: sqlaob_0006
Create Date: 2026-11-30

* ``priority`` on both outbox tables (1..10, lower first; default 3): when more rows are
  due than a relay pass sends, higher priority goes first within a queue. The relay's
  fair claim reads ``outbox_messages`` per queue and tenant in ``priority, available_at,
  id`` order and ``platform_outbox_messages`` per queue in the same order; two partial
  indexes serve exactly those scans (pending rows only).
* ``flow_pauses``: paused tasks, tenants and queues (one row each, with who paused it and
  why). Paused runs stay pending in the outbox.
* ``tenant_flow``: per-tenant weight (share of each relay pass) and rate-limit override.

Literal names only, wrapped in ``op.f()``; never imports the models.
"""

from __future__ import annotations

import sqlalchemy as sa

from alembic import op
from sqla_outbox import migrations

revision = "sqlaob_0007"
down_revision = "sqlaob_0006"
branch_labels = None
depends_on = None

TIMESTAMPTZ = sa.DateTime(timezone=True)
PENDING = sa.text("sent_at IS NULL AND parked_at IS NULL")
INDEXES = {
    "outbox_messages": ["queue", "tenant_id", "priority", "available_at", "id"],
    "platform_outbox_messages": ["queue", "priority", "available_at", "id"],
}


def _large_table(table: str) -> bool:
    if op.get_context().as_sql:
        return False
    estimate = (
        op.get_bind()
        .execute(sa.text(f"SELECT reltuples FROM pg_class WHERE oid = '{table}'::regclass"))
        .scalar()
    )
    return estimate is not None and float(estimate) >= migrations.CONCURRENT_INDEX_MIN_ROWS


def upgrade() -> None:
    for table in ("outbox_messages", "platform_outbox_messages"):
        op.add_column(
            table, sa.Column("priority", sa.SmallInteger(), server_default=sa.text("3"), nullable=False)
        )
        op.create_check_constraint(op.f(f"{table}_priority_check"), table, "priority BETWEEN 1 AND 10")
    for table, columns in INDEXES.items():
        if _large_table(table):  # as sqlaob_0003: do not block dispatches during the build
            with op.get_context().autocommit_block():
                op.create_index(
                    op.f(f"{table}_fair_idx"),
                    table,
                    columns,
                    postgresql_where=PENDING,
                    postgresql_concurrently=True,
                    if_not_exists=True,
                )
        else:
            op.create_index(op.f(f"{table}_fair_idx"), table, columns, postgresql_where=PENDING)
    op.create_table(
        "flow_pauses",
        sa.Column("scope", sa.Text(), nullable=False),
        sa.Column("target", sa.Text(), nullable=False),
        sa.Column("paused_at", TIMESTAMPTZ, server_default=sa.text("clock_timestamp()"), nullable=False),
        sa.Column("paused_by", sa.Text(), nullable=True),
        sa.Column("reason", sa.Text(), nullable=True),
        sa.CheckConstraint("scope IN ('task', 'tenant', 'queue')", name=op.f("flow_pauses_scope_check")),
        sa.PrimaryKeyConstraint("scope", "target", name=op.f("flow_pauses_pkey")),
    )
    op.create_table(
        "tenant_flow",
        sa.Column("tenant_id", sa.BigInteger(), nullable=False),
        sa.Column("weight", sa.Integer(), server_default=sa.text("1"), nullable=False),
        sa.Column("rate_limit_per_minute", sa.Integer(), nullable=True),
        sa.Column("updated_at", TIMESTAMPTZ, server_default=sa.text("clock_timestamp()"), nullable=False),
        sa.Column("updated_by", sa.Text(), nullable=True),
        sa.CheckConstraint("weight BETWEEN 1 AND 1000", name=op.f("tenant_flow_weight_check")),
        sa.CheckConstraint("rate_limit_per_minute >= 0", name=op.f("tenant_flow_rate_limit_check")),
        sa.PrimaryKeyConstraint("tenant_id", name=op.f("tenant_flow_pkey")),
    )


def downgrade() -> None:
    op.drop_table("tenant_flow")
    op.drop_table("flow_pauses")
    op.drop_index(op.f("platform_outbox_messages_fair_idx"), table_name="platform_outbox_messages")
    op.drop_index(op.f("outbox_messages_fair_idx"), table_name="outbox_messages")
    for table in ("outbox_messages", "platform_outbox_messages"):
        op.drop_constraint(op.f(f"{table}_priority_check"), table, type_="check")
        op.drop_column(table, "priority")
