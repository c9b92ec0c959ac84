"""sqla_outbox: webhook endpoints and worker presence.

Revision ID: sqlaob_0002
Revises: sqlaob_0001
Create Date: 2026-12-02

* ``webhook_endpoints`` — per tenant: URL, subscribed events, signing secrets (newest
  first), enabled flag. A ``Publish`` of a webhook event joins it inside the flush's
  statement (``sqla_outbox.webhook_fanout``), hence the partial index on ``tenant_id``.
* ``worker_presence`` — one row per running worker: the tasks it implements and the
  queues it consumes, with a heartbeat. The relay keeps runs that no live worker can run
  pending in the outbox (rolling deploys; ``sqla_outbox.presence``).

Literal names only, wrapped in ``op.f()``; never imports the models.
"""

from __future__ import annotations

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql

from alembic import op

revision = "sqlaob_0002"
down_revision = "sqlaob_0001"
branch_labels = None
depends_on = None

TIMESTAMPTZ = sa.DateTime(timezone=True)
CLOCK = sa.text("clock_timestamp()")


def upgrade() -> None:
    op.create_table(
        "webhook_endpoints",
        sa.Column("id", sa.BigInteger(), sa.Identity(always=True), nullable=False),
        sa.Column("tenant_id", sa.BigInteger(), nullable=False),
        sa.Column("url", sa.Text(), nullable=False),
        sa.Column(
            "events", postgresql.ARRAY(sa.Text()), server_default=sa.text("'{}'::text[]"), nullable=False
        ),
        sa.Column("secrets", postgresql.JSONB(), nullable=False),
        sa.Column("enabled", sa.Boolean(), server_default=sa.text("true"), nullable=False),
        sa.Column("description", sa.Text(), nullable=True),
        sa.Column("created_at", TIMESTAMPTZ, server_default=CLOCK, nullable=False),
        sa.Column("updated_at", TIMESTAMPTZ, server_default=CLOCK, nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("webhook_endpoints_pkey")),
        sa.CheckConstraint(
            "jsonb_typeof(secrets) = 'array' AND jsonb_array_length(secrets) >= 1",
            name=op.f("webhook_endpoints_secrets_check"),
        ),
    )
    op.create_index(
        op.f("webhook_endpoints_tenant_id_idx"),
        "webhook_endpoints",
        ["tenant_id"],
        postgresql_where=sa.text("enabled"),
    )
    op.create_table(
        "worker_presence",
        sa.Column("worker_id", sa.Text(), nullable=False),
        sa.Column("tasks", postgresql.ARRAY(sa.Text()), nullable=False),
        sa.Column("queues", postgresql.ARRAY(sa.Text()), nullable=False),
        sa.Column("started_at", TIMESTAMPTZ, server_default=CLOCK, nullable=False),
        sa.Column("heartbeat_at", TIMESTAMPTZ, server_default=CLOCK, nullable=False),
        sa.PrimaryKeyConstraint("worker_id", name=op.f("worker_presence_pkey")),
    )


def downgrade() -> None:
    op.drop_table("worker_presence")
    op.drop_index(op.f("webhook_endpoints_tenant_id_idx"), table_name="webhook_endpoints")
    op.drop_table("webhook_endpoints")
