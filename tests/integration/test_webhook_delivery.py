"""Webhook deliveries against a real HTTP receiver on loopback, run by the real handler.

The receiver fails, times out, redirects and succeeds on command. Each test publishes a
webhook event in a real transaction and runs the delivery runs inline
(``sqla_outbox.testing.run_pending``: the worker's execute path, one attempt per call),
then checks what the receiver got and what the run and its trail say. The SSRF guard is
checked on loopback (refused without the allow-list), ``localhost`` and, through the
resolver test hook, names that resolve to private addresses (never connected to).
"""

from __future__ import annotations

import datetime as dt
import json
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
import standardwebhooks
from sqlalchemy.orm import Session, sessionmaker

from sqla_outbox import Publish, webhooks
from sqla_outbox.catalog import Catalog
from sqla_outbox.config import OutboxSettings
from sqla_outbox.lifecycle import retry
from sqla_outbox.models import WebhookEndpoint
from sqla_outbox.testing import RunReport, run_pending
from sqla_outbox.worker import destination_guard
from sqla_outbox.worker.registry import Registry, RetryPolicy
from tests import support
from tests.webhook_receiver import ForwardProxy, Receiver, Reply, server_tls_context, tls_files


@pytest.fixture
def catalog() -> Catalog:
    return Catalog.from_dict(support.WEBHOOK_CATALOG)


@pytest.fixture
def registry() -> Registry:
    registry = Registry.with_builtins()
    registry.webhook_events("order.paid", "invoice.sent", retry=RetryPolicy(max_receives=5))
    return registry


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    server = Receiver()
    yield server
    server.close()


@pytest.fixture
def delivery_settings(settings: OutboxSettings) -> OutboxSettings:
    return settings.replace(
        valkey_url=None,
        webhook_allowed_hosts=("127.0.0.1:1024-65535",),
        webhook_timeout_seconds=2.0,
        webhook_response_excerpt="always",
    )


def endpoint(app: sessionmaker[Session], url: str, **kwargs: Any) -> tuple[int, str]:
    with app() as session, session.begin():
        item = webhooks.new_endpoint(tenant_id=kwargs.pop("tenant_id", 1), url=url, **kwargs)
        session.add(item)
        session.flush()
        return item.id, webhooks.signing_secret(item)


def publish(
    app: sessionmaker[Session], event: str = "invoice.sent", tenant_id: int = 1, **payload: Any
) -> dict[int, uuid.UUID]:
    with app() as session, session.begin():
        item = Publish(event, payload or {"invoice": 42}, tenant_id=tenant_id)
        session.add(item)
        session.flush()
        return item.webhook_deliveries


def attempt(app: sessionmaker[Session], settings: OutboxSettings, registry: Registry) -> RunReport:
    """One attempt of every due delivery (as one SQS delivery each)."""
    return run_pending(app, registry=registry, settings=settings, retries=False, tasks=["webhooks.deliver"])


def statuses(report: RunReport) -> dict[str, str]:
    return {str(outcome.run_id): outcome.status for outcome in report.runs}


def verify(secret: str, request: Any) -> Any:
    return standardwebhooks.Webhook(secret).verify(request.body, request.headers)


def test_a_delivery_is_signed_per_standard_webhooks_and_recorded(
    app: sessionmaker[Session],
    engine: sa.Engine,
    receiver: Receiver,
    delivery_settings: OutboxSettings,
    registry: Registry,
) -> None:
    endpoint_id, secret = endpoint(app, receiver.url("/hooks/in?token=t0k3n"), events=["invoice.sent"])
    [run_id] = publish(app, invoice=42, amount="9.99").values()
    report = attempt(app, delivery_settings, registry)
    assert statuses(report) == {str(run_id): "succeeded"}
    [request] = receiver.requests
    assert request.path == "/hooks/in?token=t0k3n"
    assert verify(secret, request) == {
        "type": "invoice.sent",
        "timestamp": json.loads(request.body)["timestamp"],
        "data": {"invoice": 42, "amount": "9.99"},
    }
    assert request.headers["webhook-id"] == str(run_id)
    assert request.headers["webhook-attempt"] == "1"
    assert abs(int(request.headers["webhook-timestamp"]) - dt.datetime.now(dt.UTC).timestamp()) < 60
    assert request.headers["content-type"] == "application/json"
    assert request.headers["host"] == f"127.0.0.1:{receiver.port}"
    [*_, done] = support.trail(engine, run_id)
    record = done.detail["webhook"]
    assert done.status == "succeeded"
    assert record["endpoint_id"] == endpoint_id
    assert record["destination"] == f"http://127.0.0.1:{receiver.port}"  # no path or token
    assert "t0k3n" not in json.dumps(done.detail)
    assert record["response"]["status"] == 200 and record["response"]["body"] == "ok"
    assert record["response"]["latency_ms"] >= 0


def test_transient_failures_keep_the_delivery_id_and_change_the_attempt(
    app: sessionmaker[Session],
    engine: sa.Engine,
    receiver: Receiver,
    delivery_settings: OutboxSettings,
    registry: Registry,
) -> None:
    _, secret = endpoint(app, receiver.url(), events=["invoice.sent"])
    [run_id] = publish(app).values()
    receiver.script(Reply(500, body=b'{"error":"database down"}'), Reply(502))
    assert statuses(attempt(app, delivery_settings, registry)) == {str(run_id): "retrying"}
    assert statuses(attempt(app, delivery_settings, registry)) == {str(run_id): "retrying"}
    assert statuses(attempt(app, delivery_settings, registry)) == {str(run_id): "succeeded"}
    requests = receiver.requests
    assert [r.headers["webhook-id"] for r in requests] == [str(run_id)] * 3
    assert [r.headers["webhook-attempt"] for r in requests] == ["1", "2", "3"]
    assert all(verify(secret, r) for r in requests)
    steps = [t for t in support.trail(engine, run_id) if t.status == "retrying"]
    assert [t.error_type for t in steps] == ["sqla_outbox.errors.WebhookFailed"] * 2
    assert "server-error: the receiver answered 500" in steps[0].error_message
    assert steps[0].detail["webhook"]["response"]["body"] == '{"error":"database down"}'
    assert steps[1].detail["webhook"]["response"]["status"] == 502
    assert support.run_row(engine, run_id).attempts == 3


def test_a_slow_receiver_times_out_as_a_transient_failure(
    app: sessionmaker[Session],
    engine: sa.Engine,
    receiver: Receiver,
    delivery_settings: OutboxSettings,
    registry: Registry,
) -> None:
    endpoint(app, receiver.url(), events=["invoice.sent"])
    [run_id] = publish(app).values()
    receiver.script(Reply(200, delay_seconds=4))
    settings = delivery_settings.replace(webhook_timeout_seconds=1.0)
    assert statuses(attempt(app, settings, registry)) == {str(run_id): "retrying"}
    step = support.trail(engine, run_id)[-1]
    assert step.error_type == "sqla_outbox.errors.WebhookFailed"
    assert step.error_message.startswith("timeout: ")
    assert step.detail["webhook"]["error"]["kind"] == "timeout"
    assert step.detail["webhook"]["error"]["after_ms"] < 3500


@pytest.mark.parametrize("phase", ["headers", "body"])
def test_a_trickling_receiver_is_cut_at_the_attempts_total_deadline(
    app: sessionmaker[Session],
    engine: sa.Engine,
    receiver: Receiver,
    delivery_settings: OutboxSettings,
    registry: Registry,
    phase: str,
) -> None:
    """One byte every 0.3 s never trips a per-step timeout; the total deadline (1.5 s)
    ends the attempt, and the thread running it returns (run_pending runs it on this one)."""
    endpoint(app, receiver.url(), events=["invoice.sent"])
    [run_id] = publish(app).values()
    # "body": the status and headers at once, then the body a byte at a time
    receiver.script(Reply(200, trickle_seconds=0.3, trickle_body_only=phase == "body"))
    settings = delivery_settings.replace(webhook_timeout_seconds=1.5)
    started = time.monotonic()
    report = attempt(app, settings, registry)
    elapsed = time.monotonic() - started
    assert elapsed < 15  # the receiver would trickle for hours
    step = support.trail(engine, run_id)[-1]
    if phase == "headers":  # no status in time: a transient timeout
        assert statuses(report) == {str(run_id): "retrying"}
        assert step.error_message.startswith("timeout: ")
        assert step.detail["webhook"]["error"]["kind"] == "timeout"
    else:  # the status came in time: the answer is what was read by the deadline
        assert statuses(report) == {str(run_id): "succeeded"}
        assert step.detail["webhook"]["response"]["status"] == 200
        assert step.detail["webhook"]["response"]["body_truncated"] is True
    support.wait_for(lambda: receiver.abandoned == 1, timeout=10)  # the connection was closed


def test_proxy_variables_of_the_environment_are_ignored(
    app: sessionmaker[Session],
    receiver: Receiver,
    delivery_settings: OutboxSettings,
    registry: Registry,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    proxy = ForwardProxy()
    try:
        for name in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy", "all_proxy"):
            monkeypatch.setenv(name, proxy.url)
        monkeypatch.delenv("NO_PROXY", raising=False)
        monkeypatch.delenv("no_proxy", raising=False)
        endpoint(app, receiver.url(), events=["invoice.sent"])
        [run_id] = publish(app).values()
        assert statuses(attempt(app, delivery_settings, registry)) == {str(run_id): "succeeded"}
        assert len(receiver.requests) == 1 and proxy.request_lines == []
    finally:
        proxy.close()


def test_webhook_proxy_url_sends_every_delivery_through_the_proxy_to_the_checked_address(
    app: sessionmaker[Session],
    engine: sa.Engine,
    receiver: Receiver,
    delivery_settings: OutboxSettings,
    registry: Registry,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(
        destination_guard, "resolver", lambda host, port: ["127.0.0.1"] if host == "receiver.test" else []
    )
    proxy = ForwardProxy()
    try:
        settings = delivery_settings.replace(
            webhook_proxy_url=proxy.url, webhook_allowed_hosts=(f"receiver.test:{receiver.port}",)
        )
        endpoint(app, receiver.url("/in", host="receiver.test"), events=["invoice.sent"])
        refused_id, _ = endpoint(app, receiver.url("/in", host="127.0.0.2"), events=["invoice.sent"])
        deliveries = publish(app)
        report = attempt(app, settings, registry)
        assert sorted(statuses(report).values()) == ["failed", "succeeded"]
        # the proxy was asked for the checked address; the name stayed in Host
        assert proxy.request_lines == [f"POST http://127.0.0.1:{receiver.port}/in HTTP/1.1"]
        [request] = receiver.requests
        assert request.headers["host"] == f"receiver.test:{receiver.port}"
        # the guard refused the other destination before the proxy heard of it
        assert support.run_row(engine, deliveries[refused_id]).last_error.startswith("destination-refused")
    finally:
        proxy.close()


def test_each_attempt_opens_a_fresh_connection(
    app: sessionmaker[Session],
    receiver: Receiver,
    delivery_settings: OutboxSettings,
    registry: Registry,
) -> None:
    endpoint(app, receiver.url(), events=["invoice.sent"])
    publish(app)
    receiver.script(Reply(503), Reply(503))
    for _ in range(3):
        attempt(app, delivery_settings, registry)
    ports = [r.peer_port for r in receiver.requests]
    assert len(ports) == 3 and len(set(ports)) == 3  # three connections, none reused


def test_an_allow_list_entry_admits_its_host_port_and_tenants_only_and_its_answers_are_not_kept(
    app: sessionmaker[Session],
    engine: sa.Engine,
    receiver: Receiver,
    delivery_settings: OutboxSettings,
    registry: Registry,
) -> None:
    """Tenant 1's receiver is allowed on its port; the internal service next to it (another
    port), and the same receiver for tenant 2, are refused; what the allowed receiver
    answers stays out of the trail."""
    internal = Receiver()
    try:
        internal.script(Reply(200, body=b'{"token": "internal-s3cret"}'))
        receiver.script(Reply(200, body=b'{"session": "receiver-s3cret"}'))
        settings = delivery_settings.replace(
            webhook_allowed_hosts=(f"1@127.0.0.1:{receiver.port}",), webhook_response_excerpt="public"
        )
        allowed_id, _ = endpoint(app, receiver.url(), events=["invoice.sent"], tenant_id=1)
        next_port_id, _ = endpoint(app, internal.url(), events=["invoice.sent"], tenant_id=1)
        other_tenant_id, _ = endpoint(app, receiver.url(), events=["invoice.sent"], tenant_id=2)
        deliveries = {**publish(app, tenant_id=1), **publish(app, tenant_id=2)}
        report = attempt(app, settings, registry)
        assert report.by_run_id(deliveries[allowed_id]).status == "succeeded"
        for refused in (next_port_id, other_tenant_id):
            run = support.run_row(engine, deliveries[refused])
            assert (run.status, run.last_error_type) == ("failed", "sqla_outbox.errors.WebhookRefused")
        assert internal.requests == [] and len(receiver.requests) == 1
        done = support.trail(engine, deliveries[allowed_id])[-1].detail["webhook"]
        assert done["allowed_by"] == f"1@127.0.0.1:{receiver.port}"
        assert done["response"]["status"] == 200 and "body" not in done["response"]
        everything = json.dumps([t.detail for r in deliveries.values() for t in support.trail(engine, r)])
        assert "s3cret" not in everything
    finally:
        internal.close()


def test_a_redirect_fails_permanently_and_is_not_followed(
    app: sessionmaker[Session],
    engine: sa.Engine,
    receiver: Receiver,
    delivery_settings: OutboxSettings,
    registry: Registry,
) -> None:
    endpoint(app, receiver.url("/old"), events=["invoice.sent"])
    [run_id] = publish(app).values()
    receiver.script(Reply(307, headers={"location": receiver.url("/new")}))
    report = attempt(app, delivery_settings, registry)
    outcome = report.by_run_id(run_id)
    assert (outcome.status, outcome.reason, outcome.attempts) == ("failed", "permanent-error", 1)
    assert [r.path for r in receiver.requests] == ["/old"]
    run = support.run_row(engine, run_id)
    assert run.last_error_type == "sqla_outbox.errors.WebhookRefused"
    assert run.last_error.startswith("redirect: the receiver answered 307")


@pytest.mark.parametrize("status", [400, 404, 422])
def test_a_4xx_fails_permanently(
    app: sessionmaker[Session],
    engine: sa.Engine,
    receiver: Receiver,
    delivery_settings: OutboxSettings,
    registry: Registry,
    status: int,
) -> None:
    endpoint(app, receiver.url(), events=["invoice.sent"])
    [run_id] = publish(app).values()
    receiver.script(Reply(status))
    assert statuses(attempt(app, delivery_settings, registry)) == {str(run_id): "failed"}
    run = support.run_row(engine, run_id)
    assert (run.attempts, run.last_error) == (1, f"client-error: the receiver answered {status}")


def test_410_gone_disables_the_endpoint_and_nothing_more_is_scheduled_for_it(
    app: sessionmaker[Session],
    engine: sa.Engine,
    receiver: Receiver,
    delivery_settings: OutboxSettings,
    registry: Registry,
) -> None:
    other = Receiver()  # another tenant endpoint's receiver, which keeps answering 200
    try:
        gone_id, _ = endpoint(app, receiver.url("/gone"), events=["invoice.sent"])
        kept_id, _ = endpoint(app, other.url("/kept"), events=["invoice.sent"])
        first = publish(app, invoice=1)
        receiver.script(Reply(410))
        report = attempt(app, delivery_settings, registry)
        outcome = report.by_run_id(first[gone_id])
        assert (outcome.status, outcome.reason, outcome.attempts) == ("failed", "permanent-error", 1)
        assert report.by_run_id(first[kept_id]).status == "succeeded"
        run = support.run_row(engine, first[gone_id])
        assert run.last_error == "gone: the receiver answered 410 Gone; the endpoint is disabled"
        assert support.trail(engine, first[gone_id])[-1].detail["webhook"]["endpoint_disabled"] == "gone"
        with app() as session:
            gone, kept = session.get(WebhookEndpoint, gone_id), session.get(WebhookEndpoint, kept_id)
            assert gone is not None and kept is not None
            assert (gone.enabled, gone.disabled_reason) == (False, "gone") and gone.disabled_at is not None
            assert (kept.enabled, kept.disabled_reason, kept.disabled_at) == (True, None, None)

        # a later publish schedules nothing for it, and the other endpoint still gets events
        second = publish(app, invoice=2)
        assert list(second) == [kept_id]
        attempt(app, delivery_settings, registry)
        assert [r.path for r in receiver.requests] == ["/gone"]
        assert [r.path for r in other.requests] == ["/kept", "/kept"]

        # enabled again by its owner: the reason is cleared and deliveries resume
        with app() as session, session.begin():
            item = session.get(WebhookEndpoint, gone_id)
            assert item is not None
            webhooks.enable_endpoint(item)
        with app() as session:
            item = session.get(WebhookEndpoint, gone_id)
            assert item is not None
            assert (item.enabled, item.disabled_reason, item.disabled_at) == (True, None, None)
        assert gone_id in publish(app, invoice=3)
    finally:
        other.close()


def test_a_delivery_scheduled_before_a_410_disabled_its_endpoint_is_not_sent(
    app: sessionmaker[Session],
    engine: sa.Engine,
    receiver: Receiver,
    delivery_settings: OutboxSettings,
    registry: Registry,
) -> None:
    gone_id, _ = endpoint(app, receiver.url("/gone"), events=["invoice.sent"])
    first, second = publish(app, invoice=1), publish(app, invoice=2)  # both scheduled while enabled
    receiver.script(Reply(410))
    report = attempt(app, delivery_settings, registry)
    outcomes = sorted(report.by_run_id(r[gone_id]).status for r in (first, second))
    assert outcomes == ["failed", "succeeded"]  # the one after the 410 is skipped, not sent
    assert len(receiver.requests) == 1
    skipped = next(r[gone_id] for r in (first, second) if report.by_run_id(r[gone_id]).status == "succeeded")
    assert support.trail(engine, skipped)[-1].detail["webhook"]["skipped"] == "endpoint-disabled"


def test_an_endpoint_disabled_by_its_owner_records_why_and_a_410_keeps_that(
    app: sessionmaker[Session],
) -> None:
    with app() as session, session.begin():
        item = webhooks.new_endpoint(tenant_id=1, url="https://example.com/in", events=["invoice.sent"])
        made = webhooks.new_endpoint(
            tenant_id=1, url="https://example.com/off", events=["invoice.sent"], enabled=False
        )
        session.add_all([item, made])
        session.flush()
        webhooks.disable_endpoint(item)
        first_at = item.disabled_at
        webhooks.disable_endpoint(item)  # a second disable keeps the first time and reason
        assert (item.disabled_reason, item.disabled_at) == ("operator", first_at)
        assert (made.enabled, made.disabled_reason) == (False, "operator")


@pytest.mark.parametrize(
    ("reply", "retry_after", "backoff"),
    [
        # the trail records the delay the worker waits (the inline runner runs the next try at
        # once): the longer of the Retry-After and the task's backoff on its first try (None)
        (Reply(429, headers={"retry-after": "7"}), 7.0, (7.0, 7.0)),
        (Reply(503, headers={"retry-after": "120"}), 120.0, (120.0, 120.0)),
        (Reply(429), None, None),
        (Reply(429, headers={"retry-after": "1"}), 1.0, None),  # shorter: the backoff wins
        (Reply(503, headers={"retry-after": "999999"}), 43_200.0 - 900, (42_300.0, 42_300.0)),  # within 12 h
    ],
)
def test_429_and_5xx_are_transient_and_retry_after_only_lengthens_the_backoff(
    app: sessionmaker[Session],
    engine: sa.Engine,
    receiver: Receiver,
    delivery_settings: OutboxSettings,
    registry: Registry,
    reply: Reply,
    retry_after: float | None,
    backoff: tuple[float, float] | None,
) -> None:
    endpoint(app, receiver.url(), events=["invoice.sent"])
    [run_id] = publish(app).values()
    receiver.script(reply)
    assert statuses(attempt(app, delivery_settings, registry)) == {str(run_id): "retrying"}
    step = support.trail(engine, run_id)[-1]
    assert step.error_type == "sqla_outbox.errors.WebhookFailed"  # not errors.Retry
    reason = "rate-limited" if reply.status == 429 else "server-error"
    assert step.error_message.startswith(f"{reason}: the receiver answered {reply.status}")
    rules = registry.tasks["webhooks.deliver"].retry_rules(delivery_settings)
    low, high = backoff or retry.backoff_bounds(1, rules)
    assert low <= step.detail["backoff_seconds"] <= high
    assert step.detail["webhook"].get("retry_after_seconds") == retry_after


def test_the_stored_response_excerpt_is_bounded(
    app: sessionmaker[Session],
    engine: sa.Engine,
    receiver: Receiver,
    delivery_settings: OutboxSettings,
    registry: Registry,
) -> None:
    endpoint(app, receiver.url(), events=["invoice.sent"])
    [run_id] = publish(app).values()
    receiver.script(Reply(500, headers={"content-type": "text/html"}, body=b"<p>\x00" + b"x" * 100_000))
    attempt(app, delivery_settings, registry)
    response = support.trail(engine, run_id)[-1].detail["webhook"]["response"]
    assert response["body_truncated"] is True
    assert len(response["body"].encode("utf-8")) <= 512 + 3  # the NUL became U+FFFD
    assert response["body"].startswith("<p>\ufffdxxx")
    assert response["content_type"] == "text/html"


def test_an_endpoint_edited_after_the_publish_is_delivered_with_its_current_settings(
    app: sessionmaker[Session],
    engine: sa.Engine,
    receiver: Receiver,
    delivery_settings: OutboxSettings,
    registry: Registry,
) -> None:
    moved = Receiver()
    try:
        endpoint_id, old_secret = endpoint(app, receiver.url("/v1"), events=["invoice.sent"])
        [run_id] = publish(app).values()
        with app() as session, session.begin():
            item = session.get(webhooks.WebhookEndpoint, endpoint_id)
            assert item is not None
            webhooks.update_endpoint(item, url=moved.url("/v2"))
            new_secret = webhooks.rotate_secret(item)
        assert statuses(attempt(app, delivery_settings, registry)) == {str(run_id): "succeeded"}
        assert receiver.requests == []
        [request] = moved.requests
        assert request.path == "/v2"
        signatures = request.headers["webhook-signature"].split(" ")
        assert len(signatures) == 2  # the new secret, and the old one in its grace period
        assert verify(new_secret, request) and verify(old_secret, request)
    finally:
        moved.close()


@pytest.mark.parametrize("change", ["disabled", "deleted", "unsubscribed", "another-tenant"])
def test_a_disabled_deleted_or_unsubscribed_endpoint_gets_nothing(
    app: sessionmaker[Session],
    engine: sa.Engine,
    receiver: Receiver,
    delivery_settings: OutboxSettings,
    registry: Registry,
    change: str,
) -> None:
    endpoint_id, _ = endpoint(app, receiver.url(), events=["invoice.sent", "order.paid"])
    [run_id] = publish(app).values()
    with app() as session, session.begin():
        item = session.get(webhooks.WebhookEndpoint, endpoint_id)
        assert item is not None
        if change == "disabled":
            webhooks.disable_endpoint(item)
        elif change == "deleted":
            session.delete(item)
        elif change == "another-tenant":  # a delivery naming another tenant's endpoint
            item.tenant_id = 2
        else:
            webhooks.update_endpoint(item, events=["order.paid"])
    assert statuses(attempt(app, delivery_settings, registry)) == {str(run_id): "succeeded"}
    assert receiver.requests == []
    skipped = {
        "disabled": "endpoint-disabled",
        "deleted": "endpoint-deleted",
        "another-tenant": "endpoint-of-another-tenant",
    }.get(change, "event-unsubscribed")
    assert support.trail(engine, run_id)[-1].detail["webhook"]["skipped"] == skipped


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost"])
def test_the_guard_refuses_loopback_at_the_first_attempt_without_the_allow_list(
    app: sessionmaker[Session],
    engine: sa.Engine,
    receiver: Receiver,
    delivery_settings: OutboxSettings,
    registry: Registry,
    host: str,
) -> None:
    endpoint(app, receiver.url(host=host), events=["invoice.sent"])
    [run_id] = publish(app).values()
    report = attempt(app, delivery_settings.replace(webhook_allowed_hosts=()), registry)
    assert report.by_run_id(run_id).status == "failed"
    assert receiver.requests == []
    run = support.run_row(engine, run_id)
    assert (run.attempts, run.last_error_type) == (1, "sqla_outbox.errors.WebhookRefused")
    assert run.last_error.startswith(f"destination-refused: {host} ")
    assert "(loopback)" in run.last_error
    failed = support.trail(engine, run_id)[-1]
    assert failed.detail["reason"] == "permanent-error"
    assert "loopback" in failed.detail["webhook"]["refused"]


def test_a_name_resolving_to_a_private_address_is_refused_and_never_connected(
    app: sessionmaker[Session],
    engine: sa.Engine,
    delivery_settings: OutboxSettings,
    registry: Registry,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    looked_up: list[str] = []

    def resolve(host: str, port: int) -> list[str]:
        looked_up.append(host)
        return ["10.20.30.40"]

    monkeypatch.setattr(destination_guard, "resolver", resolve)
    endpoint(app, "https://hooks.tenant.test/in", events=["invoice.sent"])
    [run_id] = publish(app).values()
    assert statuses(attempt(app, delivery_settings, registry)) == {str(run_id): "failed"}
    assert looked_up == ["hooks.tenant.test"]
    run = support.run_row(engine, run_id)
    assert run.attempts == 1
    assert "hooks.tenant.test resolves to 10.20.30.40 (private)" in run.last_error
    assert "address" not in support.trail(engine, run_id)[-1].detail["webhook"]  # no connection made


def test_the_connection_goes_to_the_checked_address_and_keeps_the_host_name(
    app: sessionmaker[Session],
    engine: sa.Engine,
    receiver: Receiver,
    delivery_settings: OutboxSettings,
    registry: Registry,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    answers = iter([["127.0.0.1"]])  # a second lookup (a rebinding window) would fail the test
    monkeypatch.setattr(destination_guard, "resolver", lambda host, port: next(answers))
    endpoint(app, receiver.url(host="receiver.test"), events=["invoice.sent"])
    [run_id] = publish(app).values()
    settings = delivery_settings.replace(webhook_allowed_hosts=("receiver.test:1024-65535",))
    assert statuses(attempt(app, settings, registry)) == {str(run_id): "succeeded"}
    [request] = receiver.requests
    assert request.headers["host"] == f"receiver.test:{receiver.port}"
    record = support.trail(engine, run_id)[-1].detail["webhook"]
    assert (record["address"], record["destination"]) == (
        "127.0.0.1",
        f"http://receiver.test:{receiver.port}",
    )


def test_tls_uses_the_host_name_for_sni_and_certificate_checks(
    app: sessionmaker[Session],
    engine: sa.Engine,
    delivery_settings: OutboxSettings,
    registry: Registry,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> None:
    ca, cert, key = tls_files(tmp_path, "receiver.test")
    monkeypatch.setenv("SSL_CERT_FILE", str(ca))  # trust the test CA (as for an internal CA)
    monkeypatch.setattr(destination_guard, "resolver", lambda host, port: ["127.0.0.1"])
    secure = Receiver(tls=server_tls_context(cert, key))
    try:
        endpoint(app, secure.url(host="receiver.test", scheme="https"), events=["invoice.sent"])
        endpoint(app, secure.url(host="other.test", scheme="https"), events=["invoice.sent"])
        deliveries = publish(app)
        settings = delivery_settings.replace(
            webhook_allowed_hosts=("receiver.test:1024-65535", "other.test:1024-65535")
        )
        report = attempt(app, settings, registry)
        good, wrong_name = deliveries.values()
        assert statuses(report) == {str(good): "succeeded", str(wrong_name): "retrying"}
        [request] = secure.requests  # the certificate is for receiver.test only
        assert request.headers["host"] == f"receiver.test:{secure.port}"
        failure = support.trail(engine, wrong_name)[-1]
        assert failure.error_message.startswith("connection: https://other.test:")
        assert "CERTIFICATE_VERIFY_FAILED" in failure.error_message or "certificate" in failure.error_message
    finally:
        secure.close()
