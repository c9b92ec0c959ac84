"""Durations as operators type them, and ages as the ops CLI prints them (pure logic)."""

from __future__ import annotations

import datetime as dt

import pytest

from sqla_outbox import errors
from sqla_outbox.ops.durations import format_age, parse_duration


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("90s", 90),
        ("10m", 600),
        ("2h", 7200),
        ("7d", 604_800),
        ("1w", 604_800),
        ("1h30m", 5400),
        ("1d12h", 129_600),
        ("1.5h", 5400),
        (" 2H ", 7200),
        ("45", 45),
        ("0s", 0),
    ],
)
def test_parse_duration(text: str, seconds: float) -> None:
    assert parse_duration(text) == dt.timedelta(seconds=seconds)


@pytest.mark.parametrize("text", ["", "ten minutes", "10x", "h", "-5m", "5m-", "1..5h"])
def test_parse_duration_refuses_what_is_not_a_duration(text: str) -> None:
    with pytest.raises(errors.ConfigurationError, match="is not a duration"):
        parse_duration(text)


@pytest.mark.parametrize("text", ["999999999999999w", "99999999w", "36501d", "1e400", str(10**400)])
def test_parse_duration_refuses_durations_no_timestamp_can_hold(text: str) -> None:
    """They overflowed Python's timedelta (a traceback) or PostgreSQL's timestamps (a
    database error, exit 1; the dashboard's DLQ page answered 503)."""
    with pytest.raises(errors.ConfigurationError, match=r"longer than 100 years|is not a duration"):
        parse_duration(text)
    assert parse_duration("36500d") == dt.timedelta(days=36_500)


@pytest.mark.parametrize(
    ("seconds", "text"),
    [
        (None, "-"),
        (0, "0s"),
        (0.25, "0.2s"),
        (42.4, "42s"),
        (192, "3m 12s"),
        (7500, "2h 05m"),
        (4 * 86_400 + 3 * 3600 + 59, "4d 03h"),
        (-90, "in 1m 30s"),
    ],
)
def test_format_age(seconds: float | None, text: str) -> None:
    assert format_age(seconds) == text
