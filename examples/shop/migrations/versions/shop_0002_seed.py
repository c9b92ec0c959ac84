"""shop: seed three tenants and their products, and welcome each tenant.

A data migration that dispatches work: ``Session(bind=op.get_bind())`` joins the
migration's transaction, so the welcome runs exist exactly when the migration commits.
Tested by ``tests/integration/test_migrations.py`` (``upgrade heads``, ``--sql``, and a
downgrade/upgrade cycle) and ``tests/integration/test_alembic_recipes.py``.

Revision ID: shop_0002
Revises: shop_0001
Create Date: 2026-11-29
"""

from __future__ import annotations

import uuid
from pathlib import Path

import sqlalchemy as sa
from sqlalchemy.orm import Session

from alembic import context, op
from sqla_outbox import Catalog, Dispatch, OutboxSettings, install

revision = "shop_0002"
down_revision = "shop_0001"
branch_labels = None
depends_on = ("sqlaob_0001",)  # needs the outbox tables

TENANTS = [(1, "Acme Tools"), (2, "Bolt & Nut"), (3, "Cogs Ltd")]
WELCOME = uuid.UUID("0b7c3c52-5f4e-4c1d-9a43-6f4b2d0e9c11")
"""Namespace of this migration's run ids: the same tenant always gets the same run id."""

tenants = sa.table("tenants", sa.column("id", sa.BigInteger), sa.column("name", sa.Text))
products = sa.table(
    "products",
    sa.column("id", sa.BigInteger),
    sa.column("tenant_id", sa.BigInteger),
    sa.column("sku", sa.Text),
    sa.column("price_cents", sa.Integer),
    sa.column("stock", sa.Integer),
)


def upgrade() -> None:
    op.bulk_insert(tenants, [{"id": i, "name": n} for i, n in TENANTS])
    op.bulk_insert(
        products,
        [
            {"id": t * 100 + n, "tenant_id": t, "sku": f"SKU-{t}-{n}", "price_cents": 250 * n, "stock": 1000}
            for t, _ in TENANTS
            for n in range(1, 4)
        ],
    )
    if context.is_offline_mode():
        # `alembic upgrade --sql` only prints SQL: there is no flush to turn a Dispatch
        # into rows. Say so in the script instead of failing.
        op.execute("-- shop_0002: the welcome_tenant dispatches need an online upgrade")
        return
    session = Session(bind=op.get_bind())
    # the catalog travels with the shop; no Valkey during migrations (the relay's sweep finds the rows)
    install(session, OutboxSettings.from_env(valkey_url="none"), catalog=Catalog.load(_catalog_path()))
    for tenant_id, name in TENANTS:
        # a deterministic run id: upgrading again after a downgrade resolves to the run of
        # the first upgrade (while its task_runs row exists) instead of welcoming twice
        run_id = uuid.uuid5(WELCOME, f"welcome_tenant:{tenant_id}")
        session.add(Dispatch("welcome_tenant", {"name": name}, tenant_id=tenant_id, run_id=run_id))
    session.flush()
    session.close()


def downgrade() -> None:
    # welcomes not sent yet go with the seed (as if never dispatched); the runs of those sent
    # stay, so upgrading again resolves to them (deterministic run ids) instead of re-sending
    op.execute(
        "DELETE FROM task_runs WHERE run_id IN "
        "(SELECT run_id FROM outbox_messages WHERE tenant_id IN (1, 2, 3) AND sent_at IS NULL)"
    )
    op.execute("DELETE FROM outbox_messages WHERE tenant_id IN (1, 2, 3)")  # rows reference tenants
    op.execute("DELETE FROM products")
    op.execute("DELETE FROM tenants")


def _catalog_path() -> str:
    return str(Path(__file__).resolve().parents[2] / "tasks.json")
