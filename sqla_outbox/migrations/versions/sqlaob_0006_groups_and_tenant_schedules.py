"""sqla_outbox: groups of runs with a completion run, and per-tenant schedule slots.

Revision ID: sqlaob_0006
Revises: sqlaob_0005
Create Date: 2026-11-30

* ``task_groups``: one row per group dispatched with ``sqla_outbox.Group``: how many
  members it has, how many are still unfinished, each finished member's status, and the
  completion run's prepared rows (written only when the last member finishes).
* ``task_runs.group_id``: the group a run belongs to (NULL for most runs).
* The trigger ``task_runs_group_finish``: when a member's status leaves the unfinished
  statuses (queued, running, retrying), in that same transaction, lock its group row,
  record the member's status once (a member requeued and finished again counts once),
  and when none is left write the completion run (``task_runs`` + outbox row, with a
  ``pg_notify`` wake). Concurrent finishers serialise on the group row lock, so exactly
  one of them sees ``remaining = 0``. A completion whose tenant was deleted meanwhile
  (the outbox row's foreign key) is recorded ``failed`` rather than failing the member's
  finish.
* ``schedule_tenant_slots``: the latest slot dispatched for each (scheduled task,
  tenant) of a tenant fan-out schedule.

Literal names only, wrapped in ``op.f()``; never imports the models.
"""

from __future__ import annotations

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql

from alembic import op

revision = "sqlaob_0006"
down_revision = "sqlaob_0005"
branch_labels = None
depends_on = None

TIMESTAMPTZ = sa.DateTime(timezone=True)
NOW = sa.text("clock_timestamp()")

FINISH_FUNCTION = """
CREATE FUNCTION sqla_outbox_group_finish() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    g task_groups%ROWTYPE;
BEGIN
    UPDATE task_groups
    SET remaining = remaining - 1,
        statuses = statuses || jsonb_build_object(NEW.run_id::text, NEW.status),
        completed_at = CASE WHEN remaining = 1 THEN clock_timestamp() END
    WHERE id = NEW.group_id AND NOT statuses ? NEW.run_id::text
    RETURNING * INTO g;
    IF FOUND AND g.remaining = 0 THEN
        INSERT INTO task_runs (run_id, task, queue, tenant_id, available_at)
        VALUES (g.completion_run_id, g.completion_task, g.completion_queue, g.tenant_id,
                clock_timestamp() + g.completion_delay)
        ON CONFLICT DO NOTHING;
        IF FOUND THEN
            IF g.tenant_id IS NULL THEN
                INSERT INTO platform_outbox_messages (run_id, queue, envelope, available_at)
                VALUES (g.completion_run_id, g.completion_queue, g.completion_envelope,
                        clock_timestamp() + g.completion_delay);
            ELSE
                BEGIN
                    INSERT INTO outbox_messages (tenant_id, run_id, queue, envelope, available_at)
                    VALUES (g.tenant_id, g.completion_run_id, g.completion_queue,
                            g.completion_envelope, clock_timestamp() + g.completion_delay);
                EXCEPTION WHEN foreign_key_violation THEN
                    -- the tenant was deleted meanwhile: the member still finishes; the
                    -- completion run is recorded failed instead of blocking it
                    UPDATE task_runs
                    SET status = 'failed', finished_at = clock_timestamp(),
                        updated_at = clock_timestamp(),
                        last_error_type = 'sqla_outbox.GroupCompletionRefused',
                        last_error = 'the tenant of the completion run no longer exists (foreign key)'
                    WHERE run_id = g.completion_run_id;
                END;
            END IF;
            PERFORM pg_notify('sqla_outbox_wake', '');
        END IF;
    END IF;
    RETURN NULL;
END
$$
"""

FINISH_TRIGGER = """
CREATE TRIGGER task_runs_group_finish
AFTER UPDATE OF status ON task_runs
FOR EACH ROW
WHEN (NEW.group_id IS NOT NULL
      AND OLD.status IN ('queued', 'running', 'retrying')
      AND NEW.status NOT IN ('queued', 'running', 'retrying'))
EXECUTE FUNCTION sqla_outbox_group_finish()
"""


def upgrade() -> None:
    op.create_table(
        "task_groups",
        sa.Column("id", postgresql.UUID(as_uuid=True), nullable=False),
        sa.Column("tenant_id", sa.BigInteger(), nullable=True),
        sa.Column("total", sa.Integer(), nullable=False),
        sa.Column("remaining", sa.Integer(), nullable=False),
        sa.Column("statuses", postgresql.JSONB(), server_default=sa.text("'{}'::jsonb"), nullable=False),
        sa.Column("completion_run_id", postgresql.UUID(as_uuid=True), nullable=False),
        sa.Column("completion_task", sa.Text(), nullable=False),
        sa.Column("completion_queue", sa.Text(), nullable=False),
        sa.Column("completion_envelope", postgresql.JSONB(), nullable=False),
        sa.Column("completion_delay", sa.Interval(), server_default=sa.text("'0'::interval"), nullable=False),
        sa.Column("created_at", TIMESTAMPTZ, server_default=NOW, nullable=False),
        sa.Column("completed_at", TIMESTAMPTZ, nullable=True),
        sa.CheckConstraint("total >= 1", name=op.f("task_groups_total_check")),
        sa.CheckConstraint("remaining >= 0 AND remaining <= total", name=op.f("task_groups_remaining_check")),
        sa.PrimaryKeyConstraint("id", name=op.f("task_groups_pkey")),
        sa.UniqueConstraint("completion_run_id", name=op.f("task_groups_completion_run_id_key")),
    )
    op.create_index(op.f("task_groups_created_at_idx"), "task_groups", ["created_at"])
    op.add_column("task_runs", sa.Column("group_id", postgresql.UUID(as_uuid=True), nullable=True))
    op.create_index(
        op.f("task_runs_group_id_idx"),
        "task_runs",
        ["group_id"],
        postgresql_where=sa.text("group_id IS NOT NULL"),
    )
    op.execute(FINISH_FUNCTION)
    op.execute(FINISH_TRIGGER)
    op.create_table(
        "schedule_tenant_slots",
        sa.Column("task", sa.Text(), nullable=False),
        sa.Column("tenant_id", sa.BigInteger(), nullable=False),
        sa.Column("last_slot", TIMESTAMPTZ, nullable=False),
        sa.Column("run_id", postgresql.UUID(as_uuid=True), nullable=False),
        sa.Column("updated_at", TIMESTAMPTZ, server_default=NOW, nullable=False),
        sa.PrimaryKeyConstraint("task", "tenant_id", name=op.f("schedule_tenant_slots_pkey")),
    )


def downgrade() -> None:
    op.drop_table("schedule_tenant_slots")
    op.execute("DROP TRIGGER task_runs_group_finish ON task_runs")
    op.execute("DROP FUNCTION sqla_outbox_group_finish()")
    op.drop_index(op.f("task_runs_group_id_idx"), table_name="task_runs")
    op.drop_column("task_runs", "group_id")
    op.drop_index(op.f("task_groups_created_at_idx"), table_name="task_groups")
    op.drop_table("task_groups")
