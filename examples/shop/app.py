"""The shop's use cases. Each one is an ordinary SQLAlchemy transaction."""

from __future__ import annotations

import datetime as dt

from sqlalchemy.orm import Session

from examples.shop.models import Order, Product
from sqla_outbox import Dispatch, Publish


def place_order(
    session: Session,
    *,
    tenant_id: int,
    product_id: int,
    quantity: int,
    email: str,
    review_delay: dt.timedelta = dt.timedelta(seconds=3),
) -> Order:
    """Record an order; in the same transaction, schedule what follows from it.

    * ``send_receipt`` — the customer is waiting for it (critical queue);
    * ``order.placed`` — published to the warehouse and the loyalty programme;
    * ``ask_for_review`` — a little later (a delayed run).

    Nothing is scheduled unless the order commits.
    """
    product = session.get(Product, product_id)
    if product is None or product.tenant_id != tenant_id:
        raise LookupError(f"tenant {tenant_id} has no product {product_id}")
    order = Order(tenant_id=tenant_id, product_id=product_id, quantity=quantity, email=email)
    session.add(order)
    session.flush()  # assigns order.id
    facts = {"order_id": order.id, "sku": product.sku, "quantity": quantity, "email": email}
    session.add(Dispatch("send_receipt", facts, tenant_id=tenant_id))
    session.add(Publish("order.placed", facts, tenant_id=tenant_id))
    session.add(Dispatch("ask_for_review", {"order_id": order.id}, tenant_id=tenant_id, delay=review_delay))
    return order
