"""Declaring webhook events on a registry, and the delivery payload the worker accepts."""

from __future__ import annotations

from typing import Any

import pytest

from sqla_outbox import errors
from sqla_outbox.config import OutboxSettings
from sqla_outbox.worker.registry import Registry, RetryPolicy
from sqla_outbox.worker.webhook_delivery import Delivery


def test_webhook_events_register_the_delivery_task_as_a_subscriber() -> None:
    registry = Registry.with_builtins()
    registry.webhook_events("order.paid")
    registry.webhook_events("invoice.sent", "order.paid")
    catalog = registry.catalog()
    spec = catalog.task("webhooks.deliver")
    assert (spec.queue, spec.scope, spec.timeout_seconds) == ("default", "tenant", 60)
    assert catalog.subscribers("order.paid") == ("webhooks.deliver",)
    assert catalog.subscribers("invoice.sent") == ("webhooks.deliver",)
    # a worker whose only application task is webhooks.deliver is a real worker
    assert registry.preflight(OutboxSettings(), queues=["default"]) == []


def test_a_second_declaration_cannot_change_the_queue_or_retry_policy() -> None:
    registry = Registry()
    registry.webhook_events("order.paid", queue="critical", retry=RetryPolicy(max_receives=3))
    registry.webhook_events("invoice.sent")  # adding events is fine
    with pytest.raises(errors.ConfigurationError, match="already registered"):
        registry.webhook_events("x.y", queue="bulk")
    with pytest.raises(errors.ConfigurationError, match=r"task 'webhooks\.deliver'"):
        registry.webhook_events("bad name")
    assert registry.catalog().events == {
        "order.paid": ("webhooks.deliver",),
        "invoice.sent": ("webhooks.deliver",),
    }


@pytest.mark.parametrize(
    "payload",
    [
        None,
        [],
        {"endpoint_id": "7", "type": "a", "timestamp": "t", "data": {}},
        {"endpoint_id": True, "type": "a", "timestamp": "t", "data": {}},
        {"endpoint_id": 0, "type": "a", "timestamp": "t", "data": {}},
        {"endpoint_id": 7, "type": "a", "timestamp": "t"},
        {"endpoint_id": 7, "type": 1, "timestamp": "t", "data": {}},
    ],
)
def test_a_delivery_payload_that_is_not_ours_is_refused(payload: Any) -> None:
    with pytest.raises(errors.ValidationFailed):
        Delivery.from_payload(payload)


def test_the_body_is_compact_ascii_json() -> None:
    delivery = Delivery.from_payload(
        {"endpoint_id": 7, "type": "order.paid", "timestamp": "2026-01-01T00:00:00.000000Z", "data": {"é": 1}}
    )
    assert delivery.body() == (
        b'{"type":"order.paid","timestamp":"2026-01-01T00:00:00.000000Z","data":{"\\u00e9":1}}'
    )
