"""shop: tenants, products, orders, handler effects.

Revision ID: shop_0001
Revises:
Create Date: 2026-11-29
"""

from __future__ import annotations

import sqlalchemy as sa

from alembic import op

revision = "shop_0001"
down_revision = None
branch_labels = ("shop",)
depends_on = None


def upgrade() -> None:
    op.create_table(
        "tenants",
        sa.Column("id", sa.BigInteger(), nullable=False),
        sa.Column("name", sa.Text(), nullable=False),
        sa.PrimaryKeyConstraint("id", name="tenants_pkey"),
    )
    op.create_table(
        "products",
        sa.Column("id", sa.BigInteger(), nullable=False),
        sa.Column("tenant_id", sa.BigInteger(), nullable=False),
        sa.Column("sku", sa.Text(), nullable=False),
        sa.Column("price_cents", sa.Integer(), nullable=False),
        sa.Column("stock", sa.Integer(), nullable=False),
        sa.ForeignKeyConstraint(["tenant_id"], ["tenants.id"], name="products_tenant_id_fkey"),
        sa.PrimaryKeyConstraint("id", name="products_pkey"),
    )
    op.create_table(
        "orders",
        sa.Column("id", sa.BigInteger(), autoincrement=True, nullable=False),
        sa.Column("tenant_id", sa.BigInteger(), nullable=False),
        sa.Column("product_id", sa.BigInteger(), nullable=False),
        sa.Column("quantity", sa.Integer(), nullable=False),
        sa.Column("email", sa.Text(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), server_default=sa.text("now()"), nullable=False),
        sa.ForeignKeyConstraint(["tenant_id"], ["tenants.id"], name="orders_tenant_id_fkey"),
        sa.ForeignKeyConstraint(["product_id"], ["products.id"], name="orders_product_id_fkey"),
        sa.PrimaryKeyConstraint("id", name="orders_pkey"),
    )
    op.create_table(
        "shop_effects",
        sa.Column("id", sa.BigInteger(), autoincrement=True, nullable=False),
        sa.Column("run_id", sa.Text(), nullable=False),
        sa.Column("task", sa.Text(), nullable=False),
        sa.Column("tenant_id", sa.BigInteger(), nullable=True),
        sa.Column("detail", sa.Text(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), server_default=sa.text("now()"), nullable=False),
        sa.PrimaryKeyConstraint("id", name="shop_effects_pkey"),
    )
    op.create_index("shop_effects_run_id_idx", "shop_effects", ["run_id"])


def downgrade() -> None:
    op.drop_table("shop_effects")
    op.drop_table("orders")
    op.drop_table("products")
    op.drop_table("tenants")
