"""Capped exponential backoff: the one formula every retry delay in sqla_outbox uses.

``delay = min(cap, base * 2 ** exponent)``, with the exponent capped *before* the power is
computed. A long failure streak (a send failing for days, an SQS receive count in the
thousands) must never make the arithmetic itself fail: PostgreSQL's ``power(2, 1024)``
raises "value out of range: overflow" and Python's ``5.0 * 2 ** 1100`` raises
``OverflowError``; either, raised after an SQS send, would roll back the bookkeeping of a
pass whose messages SQS had already accepted. Capping the exponent at
:data:`MAX_EXPONENT` (2^62 times any positive base already exceeds every cap sqla_outbox
allows) keeps the value finite for any attempt count.

Who uses it:

* the relay, after a failed send: ``exponential_seconds(attempts, base=relay_backoff_base,
  cap=relay_backoff_max)`` with ``attempts`` the failed sends before this one (1 s, 2 s,
  4 s, ... capped at 300 s by default; no jitter: one relay sends, nothing to spread);
* the worker, after a transient failure: :func:`equal_jitter` of ``exponential_seconds(
  receive_count - 1, ...)``: uniformly between **half and all** of the nominal delay
  (AWS Architecture Blog, "Exponential Backoff And Jitter", equal jitter), so the base is
  the nominal first delay, not a minimum: the first retry waits between base/2 and base;
* the loops that wait for a database, SQS or Valkey to come back: :class:`Doubling`.

The rules that choose base, cap and jitter for a run's retries live in
:mod:`sqla_outbox.lifecycle.retry`.

This module imports nothing from the package (a leaf).
"""

from __future__ import annotations

import math
import random

MAX_EXPONENT = 62
"""The largest exponent used: ``2 ** 62`` seconds is about 1.5e11 years, above any cap."""


def exponential_seconds(exponent: int, *, base: float, cap: float) -> float:
    """``min(cap, base * 2 ** exponent)``, computed without overflow for any ``exponent``.

    Args:
        exponent: Failures before this one (0 for the first); negative values count as 0,
            values above :data:`MAX_EXPONENT` as :data:`MAX_EXPONENT`.
        base: Delay for exponent 0, seconds (>= 0, finite).
        cap: Largest delay, seconds (>= 0, finite).

    Returns:
        Seconds, within ``[0, cap]``.

    Raises:
        ValueError: ``base`` or ``cap`` is negative or not finite.
    """
    if not (math.isfinite(base) and math.isfinite(cap)) or base < 0 or cap < 0:
        raise ValueError(f"backoff base and cap must be finite and >= 0, got {base!r} and {cap!r}")
    step = min(max(int(exponent), 0), MAX_EXPONENT)
    return float(min(cap, base * float(2**step)))


def equal_jitter_bounds(seconds: float) -> tuple[float, float]:
    """Equal jitter's range for a nominal delay: between half and all of ``seconds`` (>= 0)."""
    return seconds / 2, seconds


def equal_jitter(seconds: float, rng: random.Random | None = None) -> float:
    """A delay drawn uniformly within :func:`equal_jitter_bounds` (equal jitter).

    Args:
        seconds: The nominal delay (>= 0).
        rng: Random source (tests pass a seeded one); default the ``random`` module.

    Returns:
        Seconds within ``[seconds / 2, seconds]``.
    """
    low, high = equal_jitter_bounds(seconds)
    if rng is not None:
        return rng.uniform(low, high)
    return random.uniform(low, high)  # noqa: S311 - jitter, not a secret


class Doubling:
    """A reconnect delay: ``first`` seconds, doubling each time it grows, at most ``cap``.

    The loops that wait for a service to come back keep one: they wait :attr:`current`,
    call :meth:`grow` after another failure and :meth:`reset` once the service answers.

    Args:
        first: The first delay, seconds (> 0, finite).
        cap: The largest delay, seconds (>= ``first``, finite).

    Raises:
        ValueError: ``first`` or ``cap`` is out of range.
    """

    def __init__(self, first: float, cap: float) -> None:
        if not (math.isfinite(first) and math.isfinite(cap)) or first <= 0 or cap < first:
            raise ValueError(f"need 0 < first <= cap, both finite; got {first!r} and {cap!r}")
        self.first = first
        self.cap = cap
        self._failures = 0

    @property
    def current(self) -> float:
        """The delay to wait now, seconds: ``min(cap, first * 2 ** failures)``."""
        return exponential_seconds(self._failures, base=self.first, cap=self.cap)

    def grow(self) -> float:
        """Count one more failure; return the new :attr:`current`."""
        if self.current < self.cap:
            self._failures += 1
        return self.current

    def reset(self) -> None:
        """Back to ``first`` (the service answered)."""
        self._failures = 0
