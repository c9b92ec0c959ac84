"""The e2e worker's tasks for webhooks: the shared test handlers plus two webhook events
(quick retries, so a test sees a retry within seconds)."""

from __future__ import annotations

from sqla_outbox.worker import RetryPolicy, webhook_events
from tests.e2e import worker_tasks  # noqa: F401 - registers the shared test handlers

webhook_events(
    "order.paid", "invoice.sent", retry=RetryPolicy(backoff_base_seconds=0.5, backoff_max_seconds=1)
)
