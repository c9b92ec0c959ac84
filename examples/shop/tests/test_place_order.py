"""What placing an order schedules, and what the shop's handlers then do.

These are the shop's own tests, written the way an application tests its use of
sqla_outbox: the ``outbox`` fixture (sqla_outbox's pytest plugin; ``conftest.py`` points
it at the shop's database) asserts what a transaction dispatched and published, and
runs those runs inline with the real handlers of ``examples/shop/tasks.py``, without SQS,
a relay or a worker.
"""

from __future__ import annotations

import datetime as dt

import pytest
import sqlalchemy as sa
from sqlalchemy.orm import Session, sessionmaker

from examples.shop.app import place_order
from examples.shop.models import Effect
from sqla_outbox import testing


def _order(shop_sessions: sessionmaker[Session], *, quantity: int = 2, email: str = "ada@example.com") -> int:
    with shop_sessions.begin() as session:
        order = place_order(session, tenant_id=1, product_id=101, quantity=quantity, email=email)
        return order.id


def _effects(shop_sessions: sessionmaker[Session], task: str) -> list[str]:
    with shop_sessions() as session:
        return list(session.scalars(sa.select(Effect.detail).where(Effect.task == task).order_by(Effect.id)))


def test_placing_an_order_schedules_its_follow_ups(
    shop_sessions: sessionmaker[Session], outbox: testing.Outbox
) -> None:
    with shop_sessions.begin() as session:
        order_id = place_order(session, tenant_id=1, product_id=101, quantity=2, email="ada@example.com").id
        # inside the transaction, before it commits:
        outbox.assert_dispatched("send_receipt", tenant_id=1, session=session)
    facts = {"order_id": order_id, "sku": "SKU-1-1", "quantity": 2, "email": "ada@example.com"}

    outbox.assert_dispatched(
        "send_receipt", payload=facts, tenant_id=1, queue="critical", delay=0, event=None, count=1
    )
    outbox.assert_published(
        "order.placed", payload=facts, tenant_id=1, subscribers=["award_loyalty", "notify_warehouse"], count=1
    )
    outbox.assert_dispatched(
        "ask_for_review", payload={"order_id": order_id}, tenant_id=1, delay=dt.timedelta(seconds=3)
    )
    outbox.assert_not_dispatched("send_receipt", tenant_id=2)


def test_a_longer_review_delay(shop_sessions: sessionmaker[Session], outbox: testing.Outbox) -> None:
    with shop_sessions.begin() as session:
        place_order(
            session,
            tenant_id=2,
            product_id=201,
            quantity=1,
            email="b@example.com",
            review_delay=dt.timedelta(days=2),
        )
    [review] = outbox.assert_dispatched("ask_for_review", tenant_id=2, delay=dt.timedelta(days=2))
    assert review.pending and review.status == "queued"


def test_an_order_that_rolls_back_schedules_nothing(
    shop_sessions: sessionmaker[Session], outbox: testing.Outbox
) -> None:
    with pytest.raises(RuntimeError), shop_sessions.begin() as session:
        place_order(session, tenant_id=1, product_id=101, quantity=1, email="ada@example.com")
        raise RuntimeError("payment refused")
    outbox.assert_not_dispatched("send_receipt")
    outbox.assert_not_dispatched("ask_for_review")
    assert outbox.dispatched(event="order.placed") == []

    with pytest.raises(LookupError), shop_sessions.begin() as session:  # tenant 1 has no product 201
        place_order(session, tenant_id=1, product_id=201, quantity=1, email="ada@example.com")
    outbox.assert_not_dispatched("send_receipt")


def test_the_handlers_run_inline(shop_sessions: sessionmaker[Session], outbox: testing.Outbox) -> None:
    order_id = _order(shop_sessions)

    report = outbox.run_pending(tasks=["send_receipt", "notify_warehouse", "award_loyalty", "ask_for_review"])

    report.assert_all_succeeded()
    assert sorted(o.task for o in report.runs) == ["award_loyalty", "notify_warehouse", "send_receipt"]
    assert _effects(shop_sessions, "send_receipt") == [
        f"receipt for order {order_id} sent to ada@example.com"
    ]
    assert _effects(shop_sessions, "notify_warehouse") == [f"pick 2 x SKU-1-1 for order {order_id}"]
    assert _effects(shop_sessions, "award_loyalty") == [
        f"20 points for order {order_id}"
    ]  # the async handler
    outbox.assert_dispatched("send_receipt", status="succeeded")

    # the review request waits for its delay; include_delayed runs it now
    outbox.assert_dispatched("ask_for_review", status="queued")
    assert _effects(shop_sessions, "ask_for_review") == []
    later = outbox.run_pending(include_delayed=True, tasks=["ask_for_review"])
    assert [(o.task, o.status) for o in later.runs] == [("ask_for_review", "succeeded")]
    assert _effects(shop_sessions, "ask_for_review") == [f"review request for order {order_id}"]


def test_the_warehouse_timing_out_once_is_retried(
    shop_sessions: sessionmaker[Session], outbox: testing.Outbox
) -> None:
    order_id = _order(shop_sessions, quantity=3)  # the demo's warehouse times out once for quantity 3

    report = outbox.run_pending(tasks=["notify_warehouse"])

    [outcome] = report.runs
    assert (outcome.status, outcome.attempts) == ("succeeded", 2)
    assert [(f.error_type, f.message) for f in outcome.failures] == [
        ("ConnectionError", "warehouse API timed out")
    ]
    assert _effects(shop_sessions, "notify_warehouse") == [f"pick 3 x SKU-1-1 for order {order_id}"]


def test_an_address_without_loyalty_account_fails_that_run_only(
    shop_sessions: sessionmaker[Session], outbox: testing.Outbox
) -> None:
    _order(shop_sessions, email="bob@invalid.example")

    report = outbox.run_pending(tasks=["send_receipt", "notify_warehouse", "award_loyalty"])

    [failed] = report.failed
    assert (failed.task, failed.reason, failed.attempts) == ("award_loyalty", "permanent-error", 1)
    assert failed.error is not None and failed.error.error_type == "sqla_outbox.errors.ValidationFailed"
    assert {o.task: o.status for o in report.succeeded} == {
        "send_receipt": "succeeded",
        "notify_warehouse": "succeeded",
    }
    outbox.assert_dispatched("award_loyalty", status="failed")
    assert _effects(shop_sessions, "award_loyalty") == []


def test_the_seed_migration_welcomes_each_tenant(
    shop_sessions: sessionmaker[Session], outbox: testing.Outbox
) -> None:
    outbox.assert_dispatched("welcome_tenant", count=3)
    outbox.assert_dispatched("welcome_tenant", payload={"name": "Acme Tools"}, tenant_id=1)

    outbox.run_pending().assert_all_succeeded()

    assert _effects(shop_sessions, "welcome_tenant") == [
        "welcome, Acme Tools",
        "welcome, Bolt & Nut",
        "welcome, Cogs Ltd",
    ]
