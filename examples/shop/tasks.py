"""The shop's task handlers. The worker imports this module (``--imports examples.shop.tasks``).

Each handler records what it did in ``shop_effects`` through ``ctx.session``, which
commits together with the run becoming ``succeeded``: a redelivered message never
records twice. Two inputs fail on purpose so the demo shows both failure paths:

* ``notify_warehouse`` fails transiently (the warehouse API "times out") on the first
  attempt for orders of quantity 3; the retry succeeds;
* ``award_loyalty`` fails permanently for e-mail addresses at ``invalid.example``; the
  run ends ``failed`` and its message lands in the bulk DLQ with the reason.
"""

from __future__ import annotations

from typing import Any

from examples.shop.models import Effect
from sqla_outbox import errors
from sqla_outbox.worker import RetryPolicy, TaskContext, task


def _record(ctx: TaskContext, detail: str) -> None:
    ctx.session.add(Effect(run_id=str(ctx.run_id), task=ctx.task, tenant_id=ctx.tenant_id, detail=detail))


@task("send_receipt", queue="critical", scope="tenant", timeout_seconds=30)
def send_receipt(payload: dict[str, Any], ctx: TaskContext) -> None:
    """E-mail the receipt of an order."""
    _record(ctx, f"receipt for order {payload['order_id']} sent to {payload['email']}")


@task("notify_warehouse", queue="default", scope="tenant", subscribes=["order.placed"])
def notify_warehouse(payload: dict[str, Any], ctx: TaskContext) -> None:
    """Tell the warehouse to pick the order."""
    if payload["quantity"] == 3 and ctx.attempt == 1:
        raise ConnectionError("warehouse API timed out")
    _record(ctx, f"pick {payload['quantity']} x {payload['sku']} for order {payload['order_id']}")


@task(
    "award_loyalty",
    queue="bulk",
    scope="tenant",
    subscribes=["order.placed"],
    permanent=(LookupError,),
    retry=RetryPolicy(max_receives=3),
)
async def award_loyalty(payload: dict[str, Any], ctx: TaskContext) -> None:
    """Credit loyalty points for an order (async handler, AsyncSession)."""
    email = payload.get("email", "")
    if email.endswith("@invalid.example"):
        raise errors.ValidationFailed(f"order {payload['order_id']}: no loyalty account for this address")
    ctx.session.add(
        Effect(
            run_id=str(ctx.run_id),
            task=ctx.task,
            tenant_id=ctx.tenant_id,
            detail=f"{payload['quantity'] * 10} points for order {payload['order_id']}",
        )
    )


@task("ask_for_review", queue="default", scope="tenant")
def ask_for_review(payload: dict[str, Any], ctx: TaskContext) -> None:
    """A while after the order, ask the customer for a review (a delayed run)."""
    _record(ctx, f"review request for order {payload['order_id']}")


@task("welcome_tenant", queue="default", scope="tenant")
def welcome_tenant(payload: dict[str, Any], ctx: TaskContext) -> None:
    """Greet a new tenant (dispatched by a data migration)."""
    _record(ctx, f"welcome, {payload['name']}")
