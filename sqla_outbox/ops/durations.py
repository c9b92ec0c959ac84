"""Durations as operators type them (``90s``, ``10m``, ``2h``, ``7d``, ``1h30m``) and ages as
the CLI prints them.

Units: ``s`` seconds, ``m`` minutes, ``h`` hours, ``d`` days, ``w`` weeks. Parts may be
combined, largest first or not (``1d12h``); a bare number means seconds. Decimals are
allowed (``1.5h``).
"""

from __future__ import annotations

import datetime as dt
import re

from sqla_outbox import errors

_UNIT_SECONDS = {"s": 1, "m": 60, "h": 3600, "d": 86_400, "w": 604_800}
_PART = re.compile(r"(\d+(?:\.\d+)?)([smhdw])")
_WHOLE = re.compile(r"(?:\d+(?:\.\d+)?[smhdw])+")


MAX_DURATION_DAYS = 36_500
"""Longest duration accepted: 100 years. Anything longer is a typo, and subtracted from
now it would leave PostgreSQL's timestamp range (4713 BC to 294276 AD) or Python's."""


def parse_duration(value: str) -> dt.timedelta:
    """Parse ``10m``, ``2h``, ``7d``, ``1h30m`` or a number of seconds.

    Args:
        value: The text; surrounding spaces and case are ignored.

    Returns:
        A non-negative ``timedelta`` of at most :data:`MAX_DURATION_DAYS` days.

    Raises:
        ConfigurationError: The text is not a duration, or a longer one than 100 years.
    """
    text = value.strip().lower().replace(" ", "")
    if re.fullmatch(r"\d+(?:\.\d+)?", text):
        seconds = float(text)
    elif not text or not _WHOLE.fullmatch(text):
        raise errors.ConfigurationError(
            f"{value!r} is not a duration; use a number with s, m, h, d or w (10m, 2h, 7d, 1h30m)",
            option="duration",
        )
    else:
        seconds = sum(float(number) * _UNIT_SECONDS[unit] for number, unit in _PART.findall(text))
    if not seconds <= MAX_DURATION_DAYS * 86_400:  # also inf and nan
        raise errors.ConfigurationError(
            f"{value!r} is longer than {MAX_DURATION_DAYS // 365} years: check the number", option="duration"
        )
    return dt.timedelta(seconds=seconds)


def format_age(seconds: float | None) -> str:
    """A short human age: ``42s``, ``3m 12s``, ``2h 05m``, ``4d 03h``; ``-`` for None.

    Negative values (a time in the future, e.g. a delayed row) get a leading ``in``.
    """
    if seconds is None:
        return "-"
    if seconds < 0:
        return "in " + format_age(-seconds)
    whole = int(seconds)
    if whole < 60:
        return f"{seconds:.0f}s" if seconds >= 1 or seconds == 0 else f"{seconds:.1f}s"
    minutes, secs = divmod(whole, 60)
    if minutes < 60:
        return f"{minutes}m {secs:02d}s"
    hours, minutes = divmod(minutes, 60)
    if hours < 24:
        return f"{hours}h {minutes:02d}m"
    days, hours = divmod(hours, 24)
    return f"{days}d {hours:02d}h"
