"""Queues of your own: catalog declarations, settings, worker queue selection and weights."""

from __future__ import annotations

import asyncio

import pytest

from sqla_outbox import errors
from sqla_outbox.catalog import Catalog, QueueSpec
from sqla_outbox.config import OutboxSettings
from sqla_outbox.worker.consumer import consumed_queues, queue_weights
from sqla_outbox.worker.receive import SlotPool
from sqla_outbox.worker.registry import Registry

DOC = {
    "version": 1,
    "queues": {"reminders": {"visibility_timeout_seconds": 3600, "weight": 2}, "exports": {}},
    "tasks": {"remind": {"queue": "reminders"}, "export": {"queue": "exports"}},
}


def test_declared_queues_are_read_with_defaults() -> None:
    catalog = Catalog.from_dict(DOC)
    assert catalog.queue_names() == ("critical", "default", "bulk", "maintenance", "reminders", "exports")
    assert catalog.queues["exports"] == QueueSpec("exports", visibility_timeout_seconds=120, weight=1)
    assert Catalog.from_dict(catalog.to_dict()) == Catalog.from_dict(DOC)  # round trip


@pytest.mark.parametrize(
    ("queues", "tasks", "message"),
    [
        ({"bulk": {}}, {}, "should not be valid"),  # redeclaring one of the four
        ({"bad name": {}}, {}, "does not match"),
        ({"r": {"visibility_timeout_seconds": 43201}}, {}, "43200"),  # SQS VisibilityTimeout limit
        ({"r": {"message_retention_seconds": 59}}, {}, "60"),
        ({}, {"t": {"queue": "nowhere"}}, "neither one of critical"),
    ],
)
def test_bad_queue_declarations_are_refused(queues: dict, tasks: dict, message: str) -> None:
    with pytest.raises(errors.CatalogError, match=message):
        Catalog.from_dict({"version": 1, "queues": queues, "tasks": tasks})


def test_visibility_timeouts_of_every_queue_are_settings() -> None:
    settings = OutboxSettings(queue_visibility_timeouts=("reminders=900", "critical=90"))
    assert settings.visibility_timeout_seconds("reminders", 3600) == 900  # setting > catalog
    assert settings.visibility_timeout_seconds("critical") == 90  # setting > per-queue field
    assert settings.visibility_timeout_seconds("bulk") == 900  # SPEC default 15 min
    assert settings.visibility_timeout_seconds("exports", 300) == 300  # catalog
    assert OutboxSettings(visibility_timeout_default_seconds=30).visibility_timeout_seconds("default") == 30


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (("reminders=43201",), "0..43200 s \\(SQS VisibilityTimeout\\)"),
        (("reminders",), "not name=seconds"),
        (("bad name=10",), "not name=seconds"),
    ],
)
def test_bad_visibility_settings_are_refused(value: tuple[str, ...], message: str) -> None:
    with pytest.raises(errors.ConfigurationError, match=message):
        OutboxSettings(queue_visibility_timeouts=value)


def test_visibility_settings_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SQLA_OUTBOX_QUEUE_VISIBILITY_TIMEOUTS", "reminders=3600, bulk=60")
    settings = OutboxSettings.from_env()
    assert settings.visibility_timeout_seconds("reminders") == 3600
    assert settings.visibility_timeout_seconds("bulk") == 60


def test_worker_consumes_declared_queues_by_name_defaults_first() -> None:
    catalog = Catalog.from_dict(DOC)
    settings = OutboxSettings(worker_queues=("exports", "reminders", "critical"))
    assert consumed_queues(settings, catalog) == ["critical", "reminders", "exports"]
    with pytest.raises(errors.ConfigurationError, match="unknown queue\\(s\\) 'nightly'"):
        consumed_queues(OutboxSettings(worker_queues=("nightly",)), catalog)
    assert queue_weights(catalog)["reminders"] == 2 and queue_weights(catalog)["critical"] == 8


def test_a_declared_queue_gets_its_weighted_share_of_slots() -> None:
    """reminders (weight 2) and maintenance (weight 1), both backed up: about 2 to 1."""

    async def scenario() -> list[str]:
        pool = SlotPool(1, queue_weights(Catalog.from_dict(DOC)))
        grants: list[str] = []
        held: list[asyncio.Task[None]] = []

        async def handler(count: int) -> None:
            await asyncio.sleep(0.001)
            pool.release(count)

        async def receiver(queue: str) -> None:
            while len(grants) < 90:
                got = await pool.acquire(queue, 1)
                grants.append(queue)
                held.append(asyncio.create_task(handler(got)))

        await asyncio.wait_for(asyncio.gather(receiver("reminders"), receiver("maintenance")), 10)
        return grants

    grants = asyncio.run(scenario())
    ratio = grants.count("reminders") / max(1, grants.count("maintenance"))
    assert 1.5 <= ratio <= 2.5, ratio


def test_registry_declares_queues_and_writes_them_to_the_catalog() -> None:
    registry = Registry()
    with pytest.raises(errors.ConfigurationError, match="declare more with queue\\(\\)"):
        registry.task("remind", queue="reminders")(lambda payload: None)
    registry.queue("reminders", visibility_timeout_seconds=3600, weight=2)
    registry.task("remind", queue="reminders")(lambda payload: None)
    catalog = registry.catalog()
    assert catalog.queues["reminders"].visibility_timeout_seconds == 3600
    assert catalog.tasks["remind"].queue == "reminders"
    with pytest.raises(errors.ConfigurationError, match="already declared"):
        registry.queue("reminders", visibility_timeout_seconds=60)
    with pytest.raises(errors.ConfigurationError, match="43200"):
        registry.queue("slow", visibility_timeout_seconds=50_000)
