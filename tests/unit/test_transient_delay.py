"""How long a message hides after a transient failure: the task's backoff, a handler's
``Retry`` delay, and a webhook receiver's ``Retry-After`` (trial finding: a receiver
answering ``Retry-After: 2`` spent all five attempts within ten seconds)."""

from __future__ import annotations

from sqla_outbox.worker.outcome import transient_delay


def test_retry_after_only_lengthens_the_backoff() -> None:
    assert transient_delay(45.0, delay=None, at_least=2.0, allowed=43_140) == 45.0
    assert transient_delay(45.0, delay=None, at_least=120.0, allowed=43_140) == 120.0


def test_a_handlers_retry_delay_replaces_the_backoff() -> None:
    assert transient_delay(45.0, delay=2.0, at_least=None, allowed=43_140) == 2.0


def test_nothing_hides_a_message_past_what_sqs_still_allows() -> None:
    assert transient_delay(45.0, delay=None, at_least=43_000.0, allowed=600.0) == 600.0
    assert transient_delay(45.0, delay=900.0, at_least=None, allowed=600.0) == 600.0
    assert transient_delay(30.0, delay=None, at_least=None, allowed=600.0) == 30.0
