"""``@task(rate_limit=, concurrency=, breaker=)``: checked when the task module is imported."""

from __future__ import annotations

import pytest

from sqla_outbox import errors
from sqla_outbox.worker import Breaker, Registry
from sqla_outbox.worker.limits import RateLimit


def handler(payload: object) -> None:
    pass


@pytest.mark.parametrize(
    ("text", "count", "period"),
    [("100/m", 100, 60), ("5/s", 5, 1), ("1000/h", 1000, 3600), ("10/30s", 10, 30), (" 3 / 2 min ", 3, 120)],
)
def test_rate_limit_forms(text: str, count: int, period: int) -> None:
    assert RateLimit.parse(text, task="t") == RateLimit(count, period)


@pytest.mark.parametrize(
    "text", ["100", "100/", "/m", "100/d", "0/m", "-1/m", "1.5/m", "100/m/s", "5/0s", "1/25h"]
)
def test_bad_rate_limits_name_the_task(text: str) -> None:
    registry = Registry()
    with pytest.raises(errors.ConfigurationError, match=r"task 'charge'.*rate_limit"):
        registry.task("charge", rate_limit=text)(handler)
    assert "charge" not in registry.tasks


@pytest.mark.parametrize("value", [0, -1, 10_001, 2.5, True, "5"])
def test_bad_concurrency_names_the_task(value: object) -> None:
    with pytest.raises(errors.ConfigurationError, match=r"task 'charge'.*concurrency"):
        Registry().task("charge", concurrency=value)(handler)  # type: ignore[arg-type]


def test_breaker_defaults_follow_the_reference_design() -> None:
    registry = Registry()
    registry.task("charge", breaker="payments-api")(handler)
    expected = Breaker("payments-api", failures=5, open_seconds=30, successes=2)
    assert registry.breakers["payments-api"] == expected


def test_tasks_share_a_breaker_and_its_settings_whatever_the_order() -> None:
    registry = Registry()
    registry.task("refund", breaker="payments-api")(handler)
    registry.task("charge", breaker=Breaker("payments-api", failures=3, open_seconds=10))(handler)
    registry.task("void", breaker="payments-api")(handler)
    assert registry.breakers["payments-api"] == Breaker("payments-api", failures=3, open_seconds=10)
    assert {registry.tasks[n].limits.breaker.key for n in ("refund", "charge", "void")} == {"payments-api"}  # type: ignore[union-attr]


def test_conflicting_breaker_settings_are_refused() -> None:
    registry = Registry()
    registry.task("charge", breaker=Breaker("payments-api", failures=3))(handler)
    with pytest.raises(errors.ConfigurationError, match=r"task 'refund'.*already declared"):
        registry.task("refund", breaker=Breaker("payments-api", failures=4))(handler)


@pytest.mark.parametrize(
    "breaker",
    [
        "",
        "bad key",
        "x" * 101,
        Breaker("k", failures=0),
        Breaker("k", open_seconds=0),
        Breaker("k", successes=101),
        Breaker("k", max_outage_seconds=-1),
        Breaker("k", max_outage_seconds=604_801),
        5,
    ],
)
def test_bad_breakers_name_the_task(breaker: object) -> None:
    with pytest.raises(errors.ConfigurationError, match=r"task 'charge'.*breaker"):
        Registry().task("charge", breaker=breaker)(handler)  # type: ignore[arg-type]


def test_preflight_warns_when_limits_have_no_valkey() -> None:
    from sqla_outbox.config import OutboxSettings

    registry = Registry()
    registry.task("charge", concurrency=2)(handler)
    warnings = registry.preflight(OutboxSettings(valkey_url=None), queues=["default"])
    assert any("charge" in w and "valkey_url" in w for w in warnings)
    assert not any("valkey_url" in w for w in registry.preflight(OutboxSettings(), queues=["default"]))
