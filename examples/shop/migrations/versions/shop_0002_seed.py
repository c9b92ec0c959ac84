"""shop: seed three tenants and their products, and welcome each tenant.

A data migration that dispatches work: ``Session(bind=op.get_bind())`` joins the
migration's transaction, so the welcome runs exist exactly when the migration commits.

Revision ID: shop_0002
Revises: shop_0001
Create Date: 2026-11-29
"""

from __future__ import annotations

import sqlalchemy as sa
from sqlalchemy.orm import Session

import sqla_outbox
from alembic import op
from sqla_outbox import Dispatch

revision = "shop_0002"
down_revision = "shop_0001"
branch_labels = None
depends_on = ("sqlaob_0001",)  # needs the outbox tables

TENANTS = [(1, "Acme Tools"), (2, "Bolt & Nut"), (3, "Cogs Ltd")]


def upgrade() -> None:
    bind = op.get_bind()
    bind.execute(
        sa.text("INSERT INTO tenants (id, name) VALUES (:id, :name)"),
        [{"id": i, "name": n} for i, n in TENANTS],
    )
    bind.execute(
        sa.text(
            "INSERT INTO products (id, tenant_id, sku, price_cents, stock) "
            "VALUES (:id, :tenant_id, :sku, :price, 1000)"
        ),
        [
            {"id": t * 100 + n, "tenant_id": t, "sku": f"SKU-{t}-{n}", "price": 250 * n}
            for t, _ in TENANTS
            for n in range(1, 4)
        ],
    )
    session = Session(bind=bind)
    # the catalog travels with the shop; no Valkey during migrations (the sweep finds it)
    sqla_outbox.install(
        session,
        sqla_outbox.OutboxSettings.from_env(valkey_url="none"),
        catalog=sqla_outbox.Catalog.load(_catalog_path()),
    )
    for tenant_id, name in TENANTS:
        session.add(Dispatch("welcome_tenant", {"name": name}, tenant_id=tenant_id))
    session.flush()
    session.close()


def downgrade() -> None:
    op.execute("DELETE FROM outbox_messages WHERE tenant_id IN (1, 2, 3)")
    op.execute("DELETE FROM task_runs WHERE tenant_id IN (1, 2, 3)")
    op.execute("DELETE FROM products")
    op.execute("DELETE FROM tenants")


def _catalog_path() -> str:
    from pathlib import Path

    return str(Path(__file__).resolve().parents[2] / "tasks.json")
