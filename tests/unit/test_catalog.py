"""Catalog format: loading, validation errors that point at the bad entry."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sqla_outbox import errors
from sqla_outbox.catalog import Catalog, TaskSpec
from tests.support import CATALOG


def test_valid_catalog_loads(tmp_path: Path) -> None:
    path = tmp_path / "tasks.json"
    path.write_text(json.dumps(CATALOG))
    catalog = Catalog.load(path)
    assert catalog.task("charge_card").queue == "critical"
    assert catalog.task("charge_card").scope == "tenant"
    assert catalog.task("audit").scope == "any"
    assert catalog.subscribers("user.created") == ("send_welcome", "index_user")
    assert catalog.subscribers("nobody.listens") == ()


def test_round_trip_through_to_json() -> None:
    catalog = Catalog.from_dict(CATALOG)
    assert Catalog.from_dict(json.loads(catalog.to_json())) == catalog


@pytest.mark.parametrize(
    ("mutate", "pointer", "fragment"),
    [
        (lambda d: d["tasks"]["audit"].update(queue="urgent"), "tasks.audit.queue", "urgent"),
        (lambda d: d["tasks"]["audit"].update(retries=3), "tasks.audit", "retries"),
        (lambda d: d.update(version=2), "version", "1 was expected"),
        (
            lambda d: d["events"]["user.created"]["subscribers"].append("ghost"),
            "events.user.created.subscribers[2]",
            "ghost",
        ),
        (lambda d: d["tasks"].update({"bad name": {}}), "tasks", "bad name"),
        (
            lambda d: d["tasks"]["charge_card"].update(schedule={"cron": "0 3 * * *"}),
            "tasks.charge_card.schedule",
            "scope cannot be 'tenant'",
        ),
    ],
)
def test_errors_point_at_the_bad_entry(mutate, pointer: str, fragment: str, tmp_path: Path) -> None:
    doc = json.loads(json.dumps(CATALOG))
    mutate(doc)
    path = tmp_path / "tasks.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(errors.CatalogError) as caught:
        Catalog.load(path)
    assert caught.value.pointer == pointer
    assert fragment in str(caught.value)
    assert str(path) in str(caught.value)


def test_missing_file_and_bad_json(tmp_path: Path) -> None:
    with pytest.raises(errors.CatalogError, match="not found"):
        Catalog.load(tmp_path / "absent.json")
    bad = tmp_path / "tasks.json"
    bad.write_text("{ nope")
    with pytest.raises(errors.CatalogError, match="not valid JSON"):
        Catalog.load(bad)


def test_unknown_names_raise_dispatch_errors() -> None:
    catalog = Catalog.from_dict(CATALOG)
    with pytest.raises(errors.UnknownTask) as caught:
        catalog.task("ghost")
    assert caught.value.task == "ghost"
    with pytest.raises(errors.UnknownEvent):
        catalog.subscribers("ghost.event")


def test_build_from_specs() -> None:
    catalog = Catalog.build([TaskSpec("a", queue="bulk")], {"e": ["a"]})
    assert catalog.task("a").queue == "bulk"
    assert catalog.subscribers("e") == ("a",)


def test_a_bad_name_is_explained_in_words_not_as_a_regular_expression() -> None:
    """Trial finding: ``@task(name="bad name")`` showed the schema's raw pattern."""
    with pytest.raises(errors.CatalogError) as caught:
        Catalog.from_dict({"version": 1, "tasks": {"bad name": {"queue": "default", "scope": "tenant"}}})
    assert "'bad name' is not a valid name (1..200 letters, digits, _ . : -)" in str(caught.value)
    assert "A-Za-z" not in str(caught.value)
