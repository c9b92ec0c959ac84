"""How long a message hides after a transient failure: the task's backoff, a handler's
``Retry`` delay, and a webhook receiver's ``Retry-After`` (a receiver answering
``Retry-After: 2`` once spent all five attempts within ten seconds)."""

from __future__ import annotations

import random

from sqla_outbox.lifecycle import retry

FLAT = retry.RetryRules(max_receives=5, backoff_base_seconds=90.0, backoff_max_seconds=90.0)
"""A backoff of 90 s nominal on every try: drawn within [45, 90]."""


def _delay(**kwargs: float | None) -> float:
    return retry.failure_delay(2, FLAT, rng=random.Random(3), **kwargs)  # type: ignore[arg-type]


def test_retry_after_only_lengthens_the_backoff() -> None:
    assert 45.0 <= _delay(at_least=2.0) <= 90.0
    assert _delay(at_least=120.0) == 120.0


def test_a_handlers_retry_delay_replaces_the_backoff() -> None:
    assert _delay(requested=2.0) == 2.0


def test_nothing_hides_a_message_past_what_sqs_still_allows() -> None:
    assert _delay(at_least=43_000.0, ceiling=600.0) == 600.0
    assert _delay(requested=900.0, ceiling=600.0) == 600.0
    assert 15.0 <= _delay(ceiling=30.0) <= 30.0
