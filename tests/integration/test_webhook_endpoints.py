"""Webhook endpoints and the fan-out at publish, on a real PostgreSQL.

A publish of a webhook event schedules one ``webhooks.deliver`` run per subscribed,
enabled endpoint of its tenant, in the flush's one statement; other flushes never read
``webhook_endpoints``; the run holds the endpoint id and the event, never the URL or a
secret.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.orm import Session, sessionmaker

import sqla_outbox
from sqla_outbox import Dispatch, Publish, envelope, errors, webhooks
from sqla_outbox.catalog import Catalog
from sqla_outbox.config import OutboxSettings
from tests import support

WEBHOOK_CATALOG = support.WEBHOOK_CATALOG


@pytest.fixture
def catalog() -> Catalog:
    return Catalog.from_dict(WEBHOOK_CATALOG)


@pytest.fixture
def statements(engine: sa.Engine) -> Iterator[list[str]]:
    seen: list[str] = []

    def record(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        seen.append(statement)

    sa.event.listen(engine, "before_cursor_execute", record)
    yield seen
    sa.event.remove(engine, "before_cursor_execute", record)


def add_endpoints(app: sessionmaker[Session], *endpoints: Any) -> list[int]:
    with app() as session, session.begin():
        session.add_all(endpoints)
        session.flush()
        return [e.id for e in endpoints]


def delivery_rows(engine: sa.Engine) -> list[Any]:
    with engine.connect() as conn:
        return list(
            conn.execute(
                sa.text(
                    "SELECT r.run_id, r.task, r.event, r.tenant_id, r.idempotency_key, r.status, o.envelope "
                    "FROM task_runs r JOIN outbox_messages o USING (run_id) "
                    "WHERE r.task = 'webhooks.deliver' ORDER BY o.id"
                )
            )
        )


def test_publish_schedules_one_delivery_per_subscribed_enabled_endpoint_in_one_statement(
    app: sessionmaker[Session], engine: sa.Engine, statements: list[str]
) -> None:
    a, b, disabled, other_event, other_tenant = add_endpoints(
        app,
        webhooks.new_endpoint(tenant_id=1, url="https://a.example/in", events=["order.paid"]),
        webhooks.new_endpoint(tenant_id=1, url="https://b.example/in", events=["invoice.sent", "order.paid"]),
        webhooks.new_endpoint(tenant_id=1, url="https://c.example/in", events=["order.paid"], enabled=False),
        webhooks.new_endpoint(tenant_id=1, url="https://d.example/in", events=["invoice.sent"]),
        webhooks.new_endpoint(tenant_id=2, url="https://e.example/in", events=["order.paid"]),
    )
    statements.clear()
    with app() as session, session.begin():
        event = Publish("order.paid", {"order_id": 7, "total": "12.50"}, tenant_id=1)
        session.add(event)
        session.flush()
        deliveries = event.webhook_deliveries
    writes = [s for s in statements if "INSERT INTO task_runs" in s]
    assert len(writes) == 1 and "webhook_endpoints" in writes[0]
    assert set(deliveries) == {a, b}
    assert set(event.resolved_run_ids) == {"send_welcome"}
    rows = delivery_rows(engine)
    assert {row.run_id for row in rows} == set(deliveries.values())
    for row in rows:
        assert (row.task, row.event, row.tenant_id) == ("webhooks.deliver", "order.paid", 1)
        assert row.status == "queued"
        payload = json.loads(row.envelope["payload"])
        assert payload["endpoint_id"] == next(e for e, r in deliveries.items() if r == row.run_id)
        assert (payload["type"], payload["data"]) == ("order.paid", {"order_id": 7, "total": "12.50"})
        published = dt.datetime.fromisoformat(payload["timestamp"].replace("Z", "+00:00"))
        assert abs(published - dt.datetime.now(dt.UTC)) < dt.timedelta(minutes=1)
        text = json.dumps(row.envelope)
        assert "example" not in text and "whsec_" not in text  # no URL, no secret: the id only
        # the envelope is the one the worker decodes and compares (jsonb equality)
        decoded = envelope.decode(envelope.encode_document(row.envelope), max_bytes=262_144)
        assert decoded.task == "webhooks.deliver" and decoded.run_id == row.run_id
        with engine.connect() as conn:
            same = conn.execute(
                sa.text("SELECT CAST(:a AS jsonb) = CAST(:b AS jsonb)"),
                {"a": decoded.encode(), "b": json.dumps(row.envelope)},
            ).scalar()
        assert same
    assert not {disabled, other_event, other_tenant} & set(deliveries)


def test_rollback_takes_the_deliveries_with_it(app: sessionmaker[Session], engine: sa.Engine) -> None:
    add_endpoints(app, webhooks.new_endpoint(tenant_id=1, url="https://a.example/in", events=["order.paid"]))
    with app() as session:
        session.begin()
        session.add(Publish("order.paid", {"order_id": 1}, tenant_id=1))
        session.flush()
        session.rollback()
    assert delivery_rows(engine) == []


def test_a_webhook_publish_leaves_no_reference_cycles(app: sessionmaker[Session], engine: sa.Engine) -> None:
    """As for any dispatch (``test_dispatch``): the fan-out no longer points back to its
    Publish, so reference counting frees both once the flush is over."""
    from sqla_outbox.webhook_fanout import PreparedFanout

    add_endpoints(app, webhooks.new_endpoint(tenant_id=1, url="https://a.example/in", events=["order.paid"]))
    with support.cyclic_garbage(Publish, PreparedFanout) as garbage:
        with app() as session, session.begin():
            event = Publish("order.paid", {"order_id": 1}, tenant_id=1)
            session.add(event)
        deliveries = event.webhook_deliveries
        del event
    assert garbage == []
    assert {row.run_id for row in delivery_rows(engine)} == set(deliveries.values()) and len(deliveries) == 1


def test_a_refused_flush_names_no_deliveries(app: sessionmaker[Session], engine: sa.Engine) -> None:
    """The deliveries a refused flush wrote are taken back with it, and the publish says so."""
    add_endpoints(app, webhooks.new_endpoint(tenant_id=1, url="https://a.example/in", events=["order.paid"]))
    taken = uuid.uuid4()
    with app() as session, session.begin():
        session.add(Dispatch("send_welcome", tenant_id=1, run_id=taken))
    event = Publish("order.paid", {"order_id": 1}, tenant_id=1)
    with app() as session:
        session.add_all([event, Dispatch("audit", tenant_id=1, run_id=taken)])
        with pytest.raises(errors.InvalidDispatch, match="already belongs"):
            session.flush()
        session.commit()
    assert (event.webhook_deliveries, event.resolved_run_ids) == ({}, {})
    assert delivery_rows(engine) == []


def test_the_same_publish_added_again_schedules_its_deliveries_once(
    app: sessionmaker[Session], engine: sa.Engine
) -> None:
    """As a re-added Dispatch resolves to its run: a delivery's run id comes from the
    publish's own seed and the endpoint, so adding the same Publish again (in the same
    transaction or a later one) schedules no second delivery; another Publish does."""
    a, b = add_endpoints(
        app,
        webhooks.new_endpoint(tenant_id=1, url="https://a.example/in", events=["order.paid"]),
        webhooks.new_endpoint(tenant_id=1, url="https://b.example/in", events=["order.paid"]),
    )
    event = Publish("order.paid", {"order_id": 1}, tenant_id=1)
    with app() as session, session.begin():
        session.add(event)
        session.flush()
        first = dict(event.webhook_deliveries)
        session.add(event)
    with app() as session, session.begin():
        session.add(event)
    assert set(first) == {a, b}
    assert {row.run_id for row in delivery_rows(engine)} == set(first.values())
    with app() as session, session.begin():
        session.add(Publish("order.paid", {"order_id": 1}, tenant_id=1))
    assert len(delivery_rows(engine)) == 4


def test_only_webhook_events_read_the_endpoints(
    app: sessionmaker[Session], engine: sa.Engine, statements: list[str]
) -> None:
    add_endpoints(app, webhooks.new_endpoint(tenant_id=1, url="https://a.example/in", events=["order.paid"]))
    statements.clear()
    with app() as session, session.begin():
        session.add(Publish("user.created", {"user_id": 1}, tenant_id=1))
        session.add(Dispatch("audit", {}, tenant_id=1))
    with app() as session, session.begin():
        session.add(Dispatch("send_welcome", {}))
    assert statements and not [s for s in statements if "webhook_endpoints" in s]


def test_a_webhook_event_without_endpoints_writes_only_its_other_subscribers(
    app: sessionmaker[Session], engine: sa.Engine
) -> None:
    with app() as session, session.begin():
        event = Publish("order.paid", {"order_id": 1}, tenant_id=3)
        session.add(event)
        session.flush()
        assert event.webhook_deliveries == {}
    assert [r.task for r in support.runs(engine)] == ["send_welcome"]


def test_idempotency_key_dedupes_per_endpoint(app: sessionmaker[Session], engine: sa.Engine) -> None:
    a, b = add_endpoints(
        app,
        webhooks.new_endpoint(tenant_id=1, url="https://a.example/in", events=["invoice.sent"]),
        webhooks.new_endpoint(tenant_id=1, url="https://b.example/in", events=["invoice.sent"]),
    )
    with app() as session, session.begin():
        first = Publish("invoice.sent", {"invoice": 9}, tenant_id=1, idempotency_key="invoice-9")
        session.add(first)
    with app() as session, session.begin():
        again = Publish("invoice.sent", {"invoice": 9}, tenant_id=1, idempotency_key="invoice-9")
        session.add(again)
        session.flush()
        assert again.webhook_deliveries == {}  # both deliveries still unfinished: nothing new
    rows = delivery_rows(engine)
    assert sorted(r.idempotency_key for r in rows) == sorted([f"invoice-9@{a}", f"invoice-9@{b}"])


def test_delay_and_flush_order_with_other_runs(app: sessionmaker[Session], engine: sa.Engine) -> None:
    add_endpoints(app, webhooks.new_endpoint(tenant_id=1, url="https://a.example", events=["invoice.sent"]))
    with app() as session, session.begin():
        session.add(Dispatch("audit", {"n": 1}, tenant_id=1))
        session.add(Publish("invoice.sent", {"n": 2}, tenant_id=1, delay=dt.timedelta(hours=1)))
        session.add(Dispatch("audit", {"n": 3}, tenant_id=1))
    with engine.connect() as conn:
        rows = list(
            conn.execute(
                sa.text(
                    "SELECT envelope->>'task' AS task, available_at - created_at AS wait "
                    "FROM outbox_messages ORDER BY id"
                )
            )
        )
    assert [r.task for r in rows] == ["audit", "audit", "webhooks.deliver"]
    assert rows[2].wait > dt.timedelta(minutes=59)


def test_a_webhook_event_needs_a_tenant() -> None:
    catalog = Catalog.from_dict(WEBHOOK_CATALOG)
    with pytest.raises(errors.InvalidDispatch, match=r"webhook event.*pass tenant_id"):
        Publish("invoice.sent", {}).prepare(catalog, max_message_bytes=262_144)


def test_a_delivery_that_could_exceed_the_message_limit_is_refused_at_add() -> None:
    catalog = Catalog.from_dict(WEBHOOK_CATALOG)
    with pytest.raises(errors.EnvelopeTooLarge) as too_large:
        Publish("invoice.sent", {"blob": "x" * 2000}, tenant_id=1).prepare(catalog, max_message_bytes=2048)
    assert too_large.value.task == "webhooks.deliver"


def test_deleting_an_endpoint_is_plain_sql(app: sessionmaker[Session], engine: sa.Engine) -> None:
    [endpoint_id] = add_endpoints(
        app, webhooks.new_endpoint(tenant_id=1, url="https://a.example/in", events=["order.paid"])
    )
    with app() as session, session.begin():
        session.delete(session.get(webhooks.WebhookEndpoint, endpoint_id))
    with app() as session, session.begin():
        event = Publish("order.paid", {}, tenant_id=1)
        session.add(event)
        session.flush()
        assert event.webhook_deliveries == {}


# --- the endpoint API ------------------------------------------------------------------------


def test_endpoints_are_found_edited_rotated_and_disabled(app: sessionmaker[Session]) -> None:
    endpoint = webhooks.new_endpoint(tenant_id=4, url="https://a.example/in", events=["order.paid"])
    first_secret = webhooks.signing_secret(endpoint)
    assert first_secret.startswith("whsec_") and "whsec_" not in repr(endpoint)
    add_endpoints(app, endpoint, webhooks.new_endpoint(tenant_id=4, url="https://b.example", events=["x.y"]))
    with app() as session, session.begin():
        [found] = session.scalars(webhooks.select_endpoints(tenant_id=4, event="order.paid")).all()
        webhooks.update_endpoint(found, url="https://a.example/v2", events=["order.paid", "invoice.sent"])
        now = dt.datetime.now(dt.UTC)
        new_secret = webhooks.rotate_secret(found, keep_previous_for=dt.timedelta(hours=1), now=now)
        webhooks.disable_endpoint(found)
    with app() as session:
        [found] = session.scalars(webhooks.select_endpoints(tenant_id=4, event="invoice.sent")).all()
        assert (found.url, found.enabled) == ("https://a.example/v2", False)
        assert webhooks.signing_secret(found) == new_secret != first_secret
        assert webhooks.active_secrets(found.secrets, now) == [new_secret, first_secret]
        assert webhooks.active_secrets(found.secrets, now + dt.timedelta(hours=2)) == [new_secret]
        assert found.updated_at > found.created_at
        assert session.scalars(webhooks.select_endpoints(tenant_id=4, enabled=True)).one().url == (
            "https://b.example"
        )
        # a rotation with no grace drops the old secrets at once (a leaked secret)
        webhooks.rotate_secret(found, keep_previous_for=dt.timedelta(0))
        assert len(found.secrets) == 1


def test_the_endpoint_api_works_with_an_async_session(
    database_url: str, settings: OutboxSettings, catalog: Catalog, engine: sa.Engine
) -> None:
    from sqlalchemy.ext.asyncio import async_sessionmaker, create_async_engine

    async def scenario() -> dict[int, Any]:
        async_engine = create_async_engine(database_url)
        maker = async_sessionmaker(async_engine)
        sqla_outbox.install(maker, settings, catalog=catalog)
        try:
            async with maker() as session, session.begin():
                item = webhooks.new_endpoint(tenant_id=5, url="https://a.example/in", events=["order.paid"])
                session.add(item)
            async with maker() as session, session.begin():
                [found] = (await session.scalars(webhooks.select_endpoints(tenant_id=5))).all()
                webhooks.rotate_secret(found)
                event = Publish("order.paid", {"order_id": 3}, tenant_id=5)
                session.add(event)
                await session.flush()
                return event.webhook_deliveries
        finally:
            sqla_outbox.uninstall(maker)
            await async_engine.dispose()

    deliveries = asyncio.run(scenario())
    assert len(deliveries) == 1
    assert {r.run_id for r in delivery_rows(engine)} == set(deliveries.values())


@pytest.mark.parametrize(
    ("kwargs", "field", "fragment"),
    [
        ({"url": "ftp://a.example/in"}, "url", "is not http or https"),
        ({"url": "https://user:pw@a.example/in"}, "url", "user name or password"),
        ({"url": "https:///in"}, "url", "has no host"),
        ({"url": "https://a.example/a b"}, "url", "whitespace"),
        ({"url": "https://a.example:99999/"}, "url", "cannot be parsed"),
        ({"url": "https://a.example/" + "x" * 3000}, "url", "longer than"),
        ({"events": []}, "events", "at least one event"),
        ({"events": "order.paid"}, "events", "not a string"),
        ({"events": ["bad name"]}, "events", "not an event name"),
        ({"tenant_id": "3"}, "tenant_id", "integer"),
        ({"secret": "not-a-secret"}, "secret", "whsec_"),
        ({"secret": "whsec_c2hvcnQ="}, "secret", "24..64 random bytes"),
        ({"enabled": "yes"}, "enabled", "True or False"),
    ],
)
def test_bad_endpoint_settings_are_refused_naming_the_field(
    kwargs: dict[str, Any], field: str, fragment: str
) -> None:
    arguments: dict[str, Any] = {"tenant_id": 1, "url": "https://a.example/in", "events": ["order.paid"]}
    with pytest.raises(errors.InvalidEndpoint) as refused:
        webhooks.new_endpoint(**{**arguments, **kwargs})
    assert refused.value.field == field
    assert fragment in str(refused.value)


def test_events_can_be_checked_against_the_catalog(catalog: Catalog) -> None:
    webhooks.new_endpoint(tenant_id=1, url="https://a.example", events=["order.paid"], catalog=catalog)
    with pytest.raises(errors.InvalidEndpoint, match=r"'user\.created' is not a webhook event"):
        webhooks.new_endpoint(tenant_id=1, url="https://a.example", events=["user.created"], catalog=catalog)


def test_assert_published_counts_subscribers_not_deliveries(
    app: sessionmaker[Session], engine: sa.Engine
) -> None:
    from sqla_outbox.testing import assert_dispatched, assert_published

    add_endpoints(
        app,
        webhooks.new_endpoint(tenant_id=1, url="https://a.example", events=["order.paid"]),
        webhooks.new_endpoint(tenant_id=1, url="https://b.example", events=["order.paid"]),
    )
    with app() as session, session.begin():
        session.add(Publish("order.paid", {"order_id": 5}, tenant_id=1))
    assert_published(engine, "order.paid", payload={"order_id": 5}, subscribers=["send_welcome"], count=1)
    deliveries = assert_dispatched(engine, "webhooks.deliver", tenant_id=1)
    assert len(deliveries) == 2


def test_a_refused_flush_takes_back_its_webhook_deliveries_too(
    app: sessionmaker[Session], engine: sa.Engine
) -> None:
    """The flush's statement wrote the deliveries and the other subscriber's run before the
    run_id of another task's run was found: none of it stays, even when the error is caught
    and the transaction committed."""
    add_endpoints(app, webhooks.new_endpoint(tenant_id=1, url="https://a.example/in", events=["order.paid"]))
    taken = uuid.uuid4()
    with app() as session, session.begin():
        session.add(Dispatch("audit", tenant_id=1, run_id=taken))
    with app() as session:
        session.add(Publish("order.paid", {"order_id": 7}, tenant_id=1))
        session.add(Dispatch("send_welcome", tenant_id=1, run_id=taken))
        with pytest.raises(errors.InvalidDispatch, match="already belongs"):
            session.flush()
        session.commit()
    assert delivery_rows(engine) == []
    assert [row.run_id for row in support.runs(engine)] == [taken]
    assert support.count(engine, "outbox_messages") == 1
