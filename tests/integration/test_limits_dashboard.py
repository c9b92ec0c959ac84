"""The dashboard's Controls page shows circuit-breaker states and per-task limits in use
(read-only, from the Valkey the workers share)."""

from __future__ import annotations

import re
import uuid

import httpx

from sqla_outbox.config import OutboxSettings
from sqla_outbox.dashboard import create_app
from sqla_outbox.worker.gate import Gate
from sqla_outbox.worker.limits import Breaker, RateLimit, TaskLimits
from tests.support import closed_port_url, serve_asgi


def row(page: str, attribute: str, value: str) -> str:
    match = re.search(rf'<tr {attribute}="{re.escape(value)}"[^>]*>(.*?)</tr>', page, re.S)
    assert match, f"no row {attribute}={value!r}"
    return re.sub(r"\s+", " ", re.sub(r"<[^>]+>", " ", match.group(1)))


def controls(settings: OutboxSettings) -> str:
    app = create_app(settings)
    try:
        with serve_asgi(app) as base, httpx.Client(base_url=base, timeout=30) as client:
            reply = client.get("/controls")
            assert reply.status_code == 200, reply.text
            return reply.text
    finally:
        app.state.dashboard.close()


def test_controls_page_shows_breaker_states_and_slots_in_use(settings: OutboxSettings) -> None:
    payments = Breaker("payments-api", failures=2, open_seconds=600)
    crm = Breaker("crm-api")
    gate = Gate(settings, breakers={payments.key: payments, crm.key: crm}, worker_id="w1")
    charge = TaskLimits(rate=RateLimit(100, 60), concurrency=5, breaker=payments)
    gate.publish({"charge": charge, "sync_contacts": TaskLimits(breaker=crm)})
    held = [gate.admit("charge", charge, uuid.uuid4()) for _ in range(2)]
    for _ in range(2):
        gate.release(gate.admit("charge", charge, uuid.uuid4()).admission, "failure")  # type: ignore[arg-type]

    page = controls(settings)

    assert 'data-breaker="payments-api" data-state="open"' in page
    assert 'data-breaker="crm-api" data-state="closed"' in page
    assert "2 failures open it for 10m 00s" in row(page, "data-breaker", "payments-api")
    charge_row = row(page, "data-task", "charge")
    assert "2 / 5" in charge_row and "4 / 100 per" in charge_row and "payments-api" in charge_row
    for verdict in held:
        gate.release(verdict.admission, "neutral")  # type: ignore[arg-type]
    gate.close()


def test_controls_page_says_when_valkey_does_not_answer(settings: OutboxSettings) -> None:
    page = controls(settings.replace(valkey_url=closed_port_url(), wake_mode="postgres"))
    assert 'id="flow-control-error"' in page and "Valkey did not answer" in page
