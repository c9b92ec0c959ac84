"""sqla_outbox: why a webhook endpoint was disabled, and when.

Revision ID: sqlaob_0013
Revises: sqlaob_0009
Create Date: 2026-12-03

* ``webhook_endpoints.disabled_at`` / ``disabled_reason``: set together when an endpoint
  is disabled, by an operator (``webhooks.disable_endpoint``, reason ``operator``) or by
  the worker when the receiver answered ``410 Gone`` (reason ``gone``: Standard Webhooks
  receivers answer 410 to unsubscribe); cleared when it is enabled again. Both nullable:
  adding them rewrites nothing (PostgreSQL adds a column without a default in place).

Literal names only; never imports the models.
"""

from __future__ import annotations

import sqlalchemy as sa

from alembic import op

revision = "sqlaob_0013"
down_revision = "sqlaob_0009"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("webhook_endpoints", sa.Column("disabled_at", sa.DateTime(timezone=True), nullable=True))
    op.add_column("webhook_endpoints", sa.Column("disabled_reason", sa.Text(), nullable=True))


def downgrade() -> None:
    op.drop_column("webhook_endpoints", "disabled_reason")
    op.drop_column("webhook_endpoints", "disabled_at")
