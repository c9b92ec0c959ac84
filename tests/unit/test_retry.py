"""The retry rules (``sqla_outbox.lifecycle.retry``): tries, backoff and jitter, a handler's
``Retry``, a webhook receiver's ``Retry-After``, the SQS ceiling, send and deferral delays.

Every retry delay of the library is computed by that module, so a change of a rule changes
it and this test (a receiver answering ``Retry-After: 2`` once spent all five attempts
within ten seconds: Retry-After only lengthens the backoff)."""

from __future__ import annotations

import random
import re
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sqla_outbox import backoff, errors
from sqla_outbox.lifecycle import retry

PACKAGE = Path(__file__).resolve().parents[2] / "sqla_outbox"
RULES = retry.RetryRules(max_receives=5, backoff_base_seconds=5.0, backoff_max_seconds=900.0)
FLAT = retry.RetryRules(max_receives=5, backoff_base_seconds=90.0, backoff_max_seconds=90.0)
"""A backoff of 90 s nominal on every try: drawn within [45, 90]."""


@pytest.mark.parametrize("spent", [1, 2, 3, 4, 5, 30])
def test_the_backoff_is_exponential_equally_jittered_and_capped(spent: int) -> None:
    nominal = min(900, 5 * 2 ** (spent - 1))
    assert retry.backoff_bounds(spent, RULES) == (nominal / 2, nominal)
    rng = random.Random(7)
    for _ in range(50):
        assert nominal / 2 <= retry.handler_backoff(spent, RULES, rng=rng) <= nominal


@settings(max_examples=300, deadline=None)
@given(spent=st.integers(min_value=0, max_value=1_000_000), seed=st.integers(0, 2**32))
def test_the_backoff_is_finite_for_any_streak(spent: int, seed: int) -> None:
    delay = retry.handler_backoff(spent, RULES, rng=random.Random(seed))
    nominal = min(900, 5 * 2 ** max(0, min(spent - 1, backoff.MAX_EXPONENT)))
    assert nominal / 2 <= delay <= nominal


def test_the_ceiling_cuts_the_nominal_delay_before_the_jitter() -> None:
    assert retry.backoff_bounds(20, retry.RetryRules(5, 60, 43_200), ceiling=140) == (70, 140)


def _delay(**kwargs: float | None) -> float:
    return retry.failure_delay(2, FLAT, rng=random.Random(3), **kwargs)  # type: ignore[arg-type]


def test_retry_after_only_lengthens_the_backoff() -> None:
    assert 45.0 <= _delay(at_least=2.0) <= 90.0
    assert _delay(at_least=120.0) == 120.0


def test_a_handlers_retry_delay_replaces_the_backoff() -> None:
    assert _delay(requested=2.0) == 2.0


def test_nothing_waits_past_the_ceiling() -> None:
    assert _delay(at_least=43_000.0, ceiling=600.0) == 600.0
    assert _delay(requested=900.0, ceiling=600.0) == 600.0
    assert 15.0 <= _delay(ceiling=30.0) <= 30.0


def test_tries_are_the_larger_of_receives_and_attempts() -> None:
    assert retry.tries_spent(1, 5) == 5 and retry.tries_spent(3, 1) == 3
    assert retry.exhausted(5, RULES) and not retry.exhausted(4, RULES)
    assert retry.receive_limit_passed(6, RULES) and not retry.receive_limit_passed(5, RULES)


def test_rules_resolve_the_policy_over_the_settings() -> None:
    resolved = retry.RetryRules.resolve(
        retry.RetryPolicy(backoff_base_seconds=0),
        default_max_receives=5,
        default_base_seconds=5,
        default_max_seconds=900,
    )
    assert (resolved.max_receives, resolved.backoff_base_seconds, resolved.backoff_max_seconds) == (5, 0, 900)
    with pytest.raises(errors.ConfigurationError, match="max_receives"):
        retry.RetryPolicy(max_receives=0)


def test_send_and_deferral_delays_double_from_their_first_delay() -> None:
    assert [retry.send_delay(n, base_seconds=1, max_seconds=300) for n in (0, 1, 2, 9, 10_000)] == [
        1,
        2,
        4,
        300,
        300,
    ]
    assert [retry.no_handler_delay(n) for n in (0, 1, 5, 6, 99)] == [1, 2, 32, 60, 60]
    jittered = retry.deferral_delay(3, first_seconds=1, max_seconds=10, jitter=True, rng=random.Random(1))
    assert 4 <= jittered <= 8


def test_no_module_of_the_package_computes_a_retry_delay_itself() -> None:
    """The doubling loops and backoff formulas live in backoff.py and lifecycle/retry.py only."""
    doubling = re.compile(
        r"\w+\s*=\s*min\(\s*\w+\s*\*\s*2\b|\b2\s*\*\*\s*\w*(?:attempt|deferral|receive|failure)"
    )
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        if rel in ("backoff.py", "lifecycle/retry.py"):
            continue
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if doubling.search(line):
                offenders.append(f"{rel}:{number}: {line.strip()}")
    assert offenders == []
