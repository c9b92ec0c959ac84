"""Backoff arithmetic over any failure streak, and the character rules of PostgreSQL and SQS."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sqla_outbox import backoff, charsets

STREAKS = st.integers(min_value=0, max_value=1_000_000)


@settings(max_examples=300, deadline=None)
@given(attempts=STREAKS, base=st.floats(0.001, 60), cap=st.floats(0.001, 43_200))
def test_relay_backoff_is_finite_and_capped_for_any_streak(attempts: int, base: float, cap: float) -> None:
    delay = backoff.exponential_seconds(attempts, base=base, cap=cap)
    assert 0 <= delay <= cap
    assert delay == min(cap, base * 2 ** min(attempts, backoff.MAX_EXPONENT))


def test_the_exponent_is_capped_before_the_power_is_computed() -> None:
    # 2.0 ** 1100 overflows a float; the streak of the example must not
    assert backoff.exponential_seconds(1100, base=1, cap=300) == 300
    assert backoff.exponential_seconds(10**12, base=5, cap=900) == 900
    assert backoff.exponential_seconds(-3, base=5, cap=900) == 5
    with pytest.raises(ValueError):
        backoff.exponential_seconds(1, base=-1, cap=10)


@pytest.mark.parametrize(
    ("text", "postgres", "sqs"),
    [
        ("upstream said \x00", "upstream said \\x00", "upstream said \\x00"),
        ("bell \x07 esc \x1b", "bell \x07 esc \x1b", "bell \\x07 esc \\x1b"),
        ("lone \ud800 surrogate", "lone \\ud800 surrogate", "lone \\ud800 surrogate"),
        ("nonchars \ufffe\uffff", "nonchars \ufffe\uffff", "nonchars \\ufffe\\uffff"),
        ("tab\tnl\ncr\r é 中 😀 \x7f", "tab\tnl\ncr\r é 中 😀 \x7f", "tab\tnl\ncr\r é 中 😀 \x7f"),
    ],
)
def test_each_boundary_replaces_what_it_refuses_visibly(text: str, postgres: str, sqs: str) -> None:
    assert charsets.for_postgres(text) == postgres
    assert charsets.for_sqs(text) == sqs
    assert charsets.storable(charsets.for_postgres(text))
    assert charsets.sqs_allowed(charsets.for_sqs(text)) and charsets.storable(charsets.for_sqs(text))


def test_text_that_needs_nothing_is_returned_as_it_is() -> None:
    text = "plain ascii and é中😀"
    assert charsets.for_postgres(text) is text
    assert charsets.for_sqs(text) is text


def test_jsonb_values_are_made_safe_at_any_depth() -> None:
    value = {"k\x00": ["a\x00", {"b": "\ud800"}], "n": 3, "ok": None}
    safe = charsets.jsonb_safe(value)
    assert safe == {"k\\x00": ["a\\x00", {"b": "\\ud800"}], "n": 3, "ok": None}
    assert "\\u0000" not in json.dumps(safe)


def test_the_reconnect_delay_doubles_to_its_cap_and_resets() -> None:
    delay = backoff.Doubling(0.5, 10.0)
    seen = [delay.current]
    for _ in range(6):
        seen.append(delay.grow())
    assert seen == [0.5, 1, 2, 4, 8, 10, 10]
    delay.reset()
    assert delay.current == 0.5
    with pytest.raises(ValueError):
        backoff.Doubling(0, 1)
