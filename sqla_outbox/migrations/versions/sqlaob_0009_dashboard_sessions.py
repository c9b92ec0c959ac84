"""sqla_outbox: the dashboard's sessions, kept on the server.

Revision ID: sqlaob_0009
Revises: sqlaob_0008
Create Date: 2026-12-03

* ``dashboard_sessions``: one row per signed-in browser. The browser's cookie holds a
  random key (32 bytes) and nothing else; the row is found by that key's SHA-256
  (``id``), so the table never holds a usable cookie value. ``expires_at`` is checked on
  the server (database clock) at every request; signing out deletes the row; a session
  whose ``credential`` (a fingerprint of the token, password or hash that opened it) no
  longer matches the configuration is refused, so rotating a credential ends its
  sessions. ``csrf_token`` is the session's token for forms (the synchronizer token
  pattern). The index on ``expires_at`` serves the deletion of expired rows.

Literal names only, wrapped in ``op.f()``; never imports the models.
"""

from __future__ import annotations

import sqlalchemy as sa

from alembic import op

revision = "sqlaob_0009"
down_revision = "sqlaob_0008"
branch_labels = None
depends_on = None

TIMESTAMPTZ = sa.DateTime(timezone=True)


def upgrade() -> None:
    op.create_table(
        "dashboard_sessions",
        sa.Column("id", sa.Text(), nullable=False),
        sa.Column("operator", sa.Text(), nullable=False),
        sa.Column("method", sa.Text(), nullable=False),
        sa.Column("credential", sa.Text(), nullable=False),
        sa.Column("csrf_token", sa.Text(), nullable=False),
        sa.Column("created_at", TIMESTAMPTZ, server_default=sa.text("clock_timestamp()"), nullable=False),
        sa.Column("expires_at", TIMESTAMPTZ, nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("dashboard_sessions_pkey")),
    )
    op.create_index(op.f("dashboard_sessions_expires_at_idx"), "dashboard_sessions", ["expires_at"])


def downgrade() -> None:
    op.drop_index(op.f("dashboard_sessions_expires_at_idx"), table_name="dashboard_sessions")
    op.drop_table("dashboard_sessions")
