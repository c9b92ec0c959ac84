"""sqla_outbox: outbox tables, task_runs and the run trail.

Revision ID: sqlaob_0001
Revises:
Create Date: 2026-11-29

Base of the ``sqla_outbox`` branch. Literal names only, wrapped in ``op.f()`` so an
application's naming convention never rewrites them; never imports the models. The
tenant foreign key target and the revisions this one must follow come from the
environment (see ``sqla_outbox.migrations``).
"""

from __future__ import annotations

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql

from alembic import op
from sqla_outbox import migrations

revision = "sqlaob_0001"
down_revision = None
branch_labels = (migrations.BRANCH_LABEL,)
depends_on = migrations.depends_on()

QUEUES = "'critical', 'default', 'bulk', 'maintenance'"
STATUSES = "'queued', 'running', 'retrying', 'succeeded', 'failed'"
UNFINISHED = "'queued', 'running', 'retrying'"
TIMESTAMPTZ = sa.DateTime(timezone=True)
CLOCK = sa.text("clock_timestamp()")


def _outbox_table(name: str, *, with_tenant: bool) -> None:
    columns: list[sa.Column[object]] = [
        sa.Column("id", sa.BigInteger(), sa.Identity(always=True), nullable=False),
    ]
    if with_tenant:
        columns.append(sa.Column("tenant_id", sa.BigInteger(), nullable=False))
    columns += [
        sa.Column("run_id", postgresql.UUID(as_uuid=True), nullable=False),
        sa.Column("queue", sa.Text(), nullable=False),
        sa.Column("envelope", postgresql.JSONB(), nullable=False),
        sa.Column("available_at", TIMESTAMPTZ, nullable=False),
        sa.Column("sent_at", TIMESTAMPTZ, nullable=True),
        sa.Column("attempts", sa.Integer(), server_default=sa.text("0"), nullable=False),
        sa.Column("created_at", TIMESTAMPTZ, server_default=CLOCK, nullable=False),
    ]
    constraints: list[sa.Constraint] = [
        sa.PrimaryKeyConstraint("id", name=op.f(f"{name}_pkey")),
        sa.UniqueConstraint("run_id", name=op.f(f"{name}_run_id_key")),
        sa.CheckConstraint("attempts >= 0", name=op.f(f"{name}_attempts_check")),
        sa.CheckConstraint("jsonb_typeof(envelope) = 'object'", name=op.f(f"{name}_envelope_check")),
        sa.CheckConstraint(f"queue IN ({QUEUES})", name=op.f(f"{name}_queue_check")),
    ]
    target = migrations.tenant_foreign_key() if with_tenant else None
    if target and not op.get_context().as_sql:
        migrations.check_tenant_foreign_key_target(op.get_bind(), target)
    if target:
        constraints.append(
            sa.ForeignKeyConstraint(["tenant_id"], [target], name=op.f(f"{name}_tenant_id_fkey"))
        )
    op.create_table(name, *columns, *constraints)
    op.create_index(
        op.f(f"{name}_pending_idx"),
        name,
        ["available_at", "id"],
        postgresql_where=sa.text("sent_at IS NULL"),
    )
    op.create_index(
        op.f(f"{name}_sent_at_idx"),
        name,
        ["sent_at"],
        postgresql_where=sa.text("sent_at IS NOT NULL"),
    )


def upgrade() -> None:
    _outbox_table("outbox_messages", with_tenant=True)
    _outbox_table("platform_outbox_messages", with_tenant=False)

    op.create_table(
        "task_runs",
        sa.Column("run_id", postgresql.UUID(as_uuid=True), nullable=False),
        sa.Column("task", sa.Text(), nullable=False),
        sa.Column("event", sa.Text(), nullable=True),
        sa.Column("queue", sa.Text(), nullable=False),
        sa.Column("tenant_id", sa.BigInteger(), nullable=True),
        sa.Column("status", sa.Text(), server_default=sa.text("'queued'"), nullable=False),
        sa.Column("idempotency_key", sa.Text(), nullable=True),
        sa.Column("attempts", sa.Integer(), server_default=sa.text("0"), nullable=False),
        sa.Column("available_at", TIMESTAMPTZ, nullable=False),
        sa.Column("created_at", TIMESTAMPTZ, server_default=CLOCK, nullable=False),
        sa.Column("updated_at", TIMESTAMPTZ, server_default=CLOCK, nullable=False),
        sa.Column("started_at", TIMESTAMPTZ, nullable=True),
        sa.Column("finished_at", TIMESTAMPTZ, nullable=True),
        sa.Column("lease_owner", sa.Text(), nullable=True),
        sa.Column("lease_expires_at", TIMESTAMPTZ, nullable=True),
        sa.Column("last_error_type", sa.Text(), nullable=True),
        sa.Column("last_error", sa.Text(), nullable=True),
        sa.Column("dead_lettered_at", TIMESTAMPTZ, nullable=True),
        sa.PrimaryKeyConstraint("run_id", name=op.f("task_runs_pkey")),
        sa.CheckConstraint("attempts >= 0", name=op.f("task_runs_attempts_check")),
        sa.CheckConstraint(f"queue IN ({QUEUES})", name=op.f("task_runs_queue_check")),
        sa.CheckConstraint(f"status IN ({STATUSES})", name=op.f("task_runs_status_check")),
    )
    op.create_index(
        op.f("task_runs_idempotency_tenant_key"),
        "task_runs",
        ["tenant_id", "task", "idempotency_key"],
        unique=True,
        postgresql_where=sa.text(
            f"idempotency_key IS NOT NULL AND tenant_id IS NOT NULL AND status IN ({UNFINISHED})"
        ),
    )
    op.create_index(
        op.f("task_runs_idempotency_platform_key"),
        "task_runs",
        ["task", "idempotency_key"],
        unique=True,
        postgresql_where=sa.text(
            f"idempotency_key IS NOT NULL AND tenant_id IS NULL AND status IN ({UNFINISHED})"
        ),
    )
    op.create_index(
        op.f("task_runs_finished_idx"),
        "task_runs",
        ["finished_at"],
        postgresql_where=sa.text("status IN ('succeeded', 'failed')"),
    )
    op.create_index(op.f("task_runs_status_idx"), "task_runs", ["status", "updated_at"])

    op.create_table(
        "task_run_trail",
        sa.Column("id", sa.BigInteger(), sa.Identity(always=True), nullable=False),
        sa.Column("run_id", postgresql.UUID(as_uuid=True), nullable=False),
        sa.Column("at", TIMESTAMPTZ, server_default=CLOCK, nullable=False),
        sa.Column("status", sa.Text(), nullable=False),
        sa.Column("attempt", sa.Integer(), nullable=True),
        sa.Column("receive_count", sa.Integer(), nullable=True),
        sa.Column("worker_id", sa.Text(), nullable=True),
        sa.Column("error_type", sa.Text(), nullable=True),
        sa.Column("error_message", sa.Text(), nullable=True),
        sa.Column("traceback", sa.Text(), nullable=True),
        sa.Column("detail", postgresql.JSONB(), nullable=True),
        sa.PrimaryKeyConstraint("id", name=op.f("task_run_trail_pkey")),
        sa.ForeignKeyConstraint(
            ["run_id"],
            ["task_runs.run_id"],
            name=op.f("task_run_trail_run_id_fkey"),
            ondelete="CASCADE",
        ),
    )
    op.create_index(op.f("task_run_trail_run_id_idx"), "task_run_trail", ["run_id", "id"])


def downgrade() -> None:
    op.drop_table("task_run_trail")
    op.drop_table("task_runs")
    op.drop_table("platform_outbox_messages")
    op.drop_table("outbox_messages")
