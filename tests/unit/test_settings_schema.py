"""Every setting is declared once (type, range, secrecy) and the declaration is what is enforced.

These tests walk the fields of ``OutboxSettings``: a new field without a range, a bound that
construction does not enforce exactly, or a secret-looking field that ``redacted()`` would
print fail here.
"""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any

import pytest
from click.testing import CliRunner

from sqla_outbox import errors, settings_schema
from sqla_outbox.cli.config import config_command
from sqla_outbox.config import OutboxSettings, env_names
from sqla_outbox.settings_schema import Setting

FIELDS = {field.name: field for field in dataclasses.fields(OutboxSettings)}
DEFAULTS = OutboxSettings()


def kind(field: dataclasses.Field[Any]) -> str:
    return str(field.type).removesuffix(" | None")


NUMBERS = [name for name, field in FIELDS.items() if kind(field) in ("int", "float")]
TEXTS = [name for name, field in FIELDS.items() if kind(field) in ("str", "tuple[str, ...]")]


# --- every field is declared ---------------------------------------------------------------------
def test_every_field_has_a_type_the_environment_can_spell() -> None:
    """``from_env`` reads int, float, bool, str and comma-separated lists; a field of any
    other type could not be set from the environment."""
    for name, field in FIELDS.items():
        assert kind(field) in ("int", "float", "bool", "str", "tuple[str, ...]"), (name, field.type)
        assert settings_schema.of(field).doc, name


@pytest.mark.parametrize("name", NUMBERS)
def test_every_number_declares_its_range_or_says_it_has_none(name: str) -> None:
    spec = settings_schema.of(FIELDS[name])
    assert spec.is_number or spec.unbounded, (
        f"{name}: declare minimum=/above=/at_least= and/or maximum=, or unbounded=True"
    )


def test_rules_fit_the_type_they_are_declared_on() -> None:
    for name, field in FIELDS.items():
        spec = settings_schema.of(field)
        if name not in NUMBERS:
            assert not (spec.is_number or spec.unbounded), f"{name}: a bound on a {field.type}"
        if name not in TEXTS:
            assert (spec.choices, spec.pattern, spec.min_length) == ((), None, None), name
        if spec.at_least is not None:
            assert spec.at_least in NUMBERS and NUMBERS.index(spec.at_least) < NUMBERS.index(name), (
                f"{name}: at_least names a number declared before it"
            )


@pytest.mark.parametrize(
    ("rule", "contradiction"),
    [
        ({"minimum": 0, "above": 0}, "one lower bound"),
        ({"minimum": 0, "unbounded": True}, "contradict"),
        ({"pattern": "[a-z]+"}, "need shape"),
        ({"mask": str.upper}, "needs secret"),
        ({"maximum": "10"}, "bounds are numbers"),
    ],
)
def test_a_declaration_that_contradicts_itself_is_refused(rule: dict[str, Any], contradiction: str) -> None:
    with pytest.raises(TypeError, match=contradiction):
        Setting("A setting.", **rule)


# --- the declared bounds are the enforced bounds -----------------------------------------------------
def below(name: str, value: float) -> float:
    return value - 1 if kind(FIELDS[name]) == "int" else math.nextafter(value, -math.inf)


def beyond(name: str, value: float) -> float:
    return value + 1 if kind(FIELDS[name]) == "int" else math.nextafter(value, math.inf)


def build(name: str, value: float) -> OutboxSettings:
    """Settings with ``name`` at ``value`` and the fields declared ``at_least`` it raised to
    match, so only ``name``'s own rule decides."""
    values: dict[str, Any] = {name: value}
    for other, field in FIELDS.items():
        if settings_schema.of(field).at_least == name:
            values[other] = max(value, getattr(DEFAULTS, other))
    return OutboxSettings(**values)


def probes(name: str) -> tuple[list[float], list[float]]:
    """(values at the declared bounds, values just past them) for one number."""
    spec = settings_schema.of(FIELDS[name])
    accepted: list[float] = []
    refused: list[float] = []
    if spec.minimum is not None:
        accepted.append(spec.minimum)
        refused.append(below(name, spec.minimum))
    if spec.above is not None:
        accepted.append(beyond(name, spec.above))
        refused.append(spec.above)
    if spec.maximum is not None:
        accepted.append(spec.maximum)
        refused.append(beyond(name, spec.maximum))
    if spec.at_least is not None:
        floor = getattr(DEFAULTS, spec.at_least)
        accepted.append(floor)
        refused.append(below(name, floor))
    return accepted, refused


@pytest.mark.parametrize("name", [n for n in NUMBERS if not settings_schema.of(FIELDS[n]).unbounded])
def test_declared_bounds_are_enforced_exactly(name: str) -> None:
    """At a bound: accepted. One step past it (1 for an integer, the next float for a
    number): refused, naming the variable, the range and the value."""
    spec = settings_schema.of(FIELDS[name])
    accepted, refused = probes(name)
    assert accepted and refused
    for value in accepted:
        assert getattr(build(name, value), name) == value
    for value in refused:
        with pytest.raises(errors.ConfigurationError) as caught:
            build(name, value)
        assert caught.value.option == env_names(name)[0]
        message = str(caught.value)
        assert message.startswith(f"{env_names(name)[0]}: must be "), message
        assert spec.bounds_text() in message and "got" in message, message


@pytest.mark.parametrize("name", [n for n in NUMBERS if settings_schema.is_optional(FIELDS[n])])
def test_an_optional_number_may_be_unset(name: str) -> None:
    assert getattr(OutboxSettings(**{name: None}), name) is None
    env = {env_names(name)[0]: "none"}
    assert getattr(OutboxSettings.from_env(env), name) is None


@pytest.mark.parametrize("name", [n for n in NUMBERS if not settings_schema.is_optional(FIELDS[n])])
def test_a_number_that_is_not_optional_must_be_set(name: str) -> None:
    with pytest.raises(errors.ConfigurationError, match=rf"^{env_names(name)[0]}: must be set$"):
        OutboxSettings(**{name: None})


@pytest.mark.parametrize(
    ("name", "text", "message"),
    [
        ("worker_concurrency", "1001", "must be within 1..1000, got 1001"),
        ("wake_timeout_ms", "0", "must be within 1..10000 ms, got 0"),
        ("relay_sweep_interval_seconds", "0", "must be > 0 s, got 0"),
        ("webhook_timeout_seconds", "301", "must be > 0 and <= 300 s, got 301"),
        (
            "visibility_timeout_bulk_seconds",
            "43201",
            "must be within 0..43200 s (SQS VisibilityTimeout), got 43201",
        ),
        ("health_port", "70000", "must be a TCP port (0..65535), got 70000"),
        ("purge_failed_after_days", "-1", "must be >= 0, got -1"),
        ("relay_backoff_max_seconds", "0.5", "must be >= relay_backoff_base_seconds, got 0.5"),
        (
            "limits_throttle_delay_max_seconds",
            "0.5",
            "must be within limits_throttle_delay_seconds..3600 s, got 0.5",
        ),
    ],
)
def test_a_refused_environment_value_is_named_with_its_range(name: str, text: str, message: str) -> None:
    with pytest.raises(errors.ConfigurationError) as caught:
        OutboxSettings.from_env({env_names(name)[0]: text})
    assert str(caught.value) == f"{env_names(name)[0]}: {message}"


def test_texts_follow_their_declared_shape() -> None:
    cases = {
        "queue_prefix": ("a-b_9", "bad prefix"),
        "tenant_foreign_key": ("billing.accounts.id", "accounts"),
        "health_host": ("::1", "bad host!"),
        "dashboard_host": ("localhost", "  "),
        "webhook_allowed_hosts": (("10.1.2.0/24:443",), ("10.1.2.0/24:443", "no spaces")),
        "wake_key": ("k", ""),
    }
    for name, (good, bad) in cases.items():
        assert getattr(OutboxSettings(**{name: good}), name) == good
        with pytest.raises(errors.ConfigurationError) as caught:
            OutboxSettings(**{name: bad})
        assert caught.value.option == env_names(name)[0]


# --- secrets ---------------------------------------------------------------------------------------
SECRET_WORDS = {"key", "keys", "token", "tokens", "secret", "secrets", "password", "auth", "credentials"}
"""Words of a field name (between underscores) that suggest a secret."""
NOT_SECRETS = {
    "wake_key": "the name of a Valkey list",
    "tenant_foreign_key": "a table.column",
    "sqs_kms_key_id": "names a KMS key (an id or alias): grants nothing, and provision logs it",
}
SECRETS = [name for name in FIELDS if settings_schema.of(FIELDS[name]).secret]


def test_every_field_named_like_a_secret_is_declared_secret() -> None:
    for name in FIELDS:
        if SECRET_WORDS & set(name.split("_")) and name not in NOT_SECRETS:
            assert name in SECRETS, f"{name} looks like a secret: declare secret=True (or say why not)"
    for name in NOT_SECRETS:
        assert name in FIELDS and name not in SECRETS and SECRET_WORDS & set(name.split("_")), name
    assert {"signing_keys", "dashboard_token", "dashboard_basic_auth"} <= set(SECRETS)


def secret_sample(name: str) -> Any:
    """A valid value of a secret field, holding the word ``s3cret``."""
    for text in ("s3cret-0123456789abcdef", "ops:s3cret-0123456789abcdef"):
        value: Any = (text,) if kind(FIELDS[name]) == "tuple[str, ...]" else text
        try:
            OutboxSettings(**{name: value})
        except errors.ConfigurationError:
            continue
        return value
    raise AssertionError(f"no sample value fits {name}'s rule: add one here")


@pytest.mark.parametrize("name", SECRETS)
def test_every_secret_is_masked_by_redacted_and_the_config_command(name: str) -> None:
    value = secret_sample(name)
    shown = OutboxSettings(**{name: value}).redacted()
    assert "s3cret" not in json.dumps(shown), shown[name]
    text = ",".join(value) if isinstance(value, tuple) else value
    result = CliRunner().invoke(config_command, ["--json"], env={env_names(name)[0]: text})
    assert result.exit_code == 0, result.output
    assert "s3cret" not in result.output and json.loads(result.output)[name] == shown[name]


@pytest.mark.parametrize("name", SECRETS)
def test_a_refused_secret_is_not_shown(name: str) -> None:
    bad = ("s3cret",) if kind(FIELDS[name]) == "tuple[str, ...]" else "s3cret"
    with pytest.raises(errors.ConfigurationError) as caught:
        OutboxSettings(**{name: bad})
    assert caught.value.option == env_names(name)[0] and "s3cret" not in str(caught.value)


def test_masks_keep_the_shape_of_the_value() -> None:
    settings = OutboxSettings(
        signing_keys=("k" * 16, "j" * 16), dashboard_token="t" * 16, dashboard_basic_auth="ops:" + "p" * 12
    )
    shown = settings.redacted()
    assert shown["signing_keys"] == ["***", "***"]
    assert (shown["dashboard_token"], shown["dashboard_basic_auth"]) == ("***", "ops:***")
    assert OutboxSettings().redacted()["dashboard_token"] is None


def test_the_reference_shows_each_range_and_secret() -> None:
    from sqla_outbox.config import reference_markdown

    rows = {line.split(" | ")[0].strip("| `"): line for line in reference_markdown().splitlines()}
    assert "| integer, 1..1000 |" in rows["worker_concurrency"]
    assert (
        "| number, `worker_backoff_base_seconds`..43200 (SQS VisibilityTimeout maximum) |"
        in (rows["worker_backoff_max_seconds"])
    )
    assert "| one of `auto`, `valkey`, `postgres`, `both`, `none` |" in rows["wake_mode"]
    for name in FIELDS:
        assert rows[name].split(" | ")[5] == ("yes" if name in SECRETS else ""), name
