"""The verdict on an attempt: succeeded, retry after N seconds, or failed for good.

One pure function, :func:`decide`, turns what an attempt did (returned, or raised an
exception, or ran out of time) into a :class:`Verdict`; the worker
(:mod:`sqla_outbox.worker.handle`) and the inline test runner
(:mod:`sqla_outbox.testing.inline`) both call it and apply the verdict with the statements
of :mod:`sqla_outbox.lifecycle.attempts`, so an application's tests classify failures
exactly as production does. The rules, in order:

1. The handler returned → ``succeed``.
2. :class:`~sqla_outbox.errors.PermanentError`, or a type the task lists in
   ``@task(permanent=...)`` → ``fail`` with reason ``permanent-error`` (never retried).
3. Anything else, :class:`~sqla_outbox.errors.Retry` and the attempt's own timeout
   (:class:`~sqla_outbox.errors.AttemptTimeout`) included, is transient: on the run's last
   try (:func:`~sqla_outbox.lifecycle.retry.exhausted`) → ``fail`` with reason
   ``retries-exhausted``; otherwise → ``retry`` after
   :func:`~sqla_outbox.lifecycle.retry.failure_delay` (the backoff; ``Retry``'s delay
   replaces it; a webhook receiver's ``Retry-After`` lengthens it), through the received
   message's visibility when it can stay hidden that long, else through the outbox (a
   fresh message, due after the delay; no try is spent on the switch).

Before an attempt starts, :func:`before_attempt` fails a delivery that was received more
often than the run has tries (``receive-limit``).

A verdict also says how the attempt counts for a circuit breaker
(:attr:`Verdict.breaker_outcome`): a success closes, a transient failure counts against
the integration, a permanent error (bad input) counts for nothing (ADR 0014).

Once the breaker has recorded a transient failure, :func:`ride_out` may turn the verdict
into ``defer``: a failure that finds the breaker open (it opened it, or a probe failed and
opened it again) is the outage's, not the run's, so while the outage is younger than the
breaker's retry horizon (``Breaker.max_outage_seconds``) the run goes back to the outbox,
due when the breaker probes again, and the attempt is not counted (SPEC: holding work back
never spends a run's attempts nor sends it to the DLQ).

What does not come from a handler's outcome is not decided here: a committed ``Cancel``
(the run ends ``cancelled``) and a lost lease (the runner reconciles with the run's
current status).
"""

from __future__ import annotations

import dataclasses
import enum
import random

from sqla_outbox import errors
from sqla_outbox.lifecycle import retry
from sqla_outbox.types import SQS_MAX_VISIBILITY_SECONDS


class Kind(enum.StrEnum):
    """What the verdict does to the run."""

    SUCCEED = "succeed"  # running → succeeded
    RETRY = "retry"  # running → retrying, next try after delay_seconds
    FAIL = "fail"  # running → failed, message to the DLQ
    DEFER = "defer"  # running → queued through the outbox after delay_seconds, attempt not counted


class Via(enum.StrEnum):
    """How a RETRY's message comes back after its delay."""

    VISIBILITY = "visibility"  # the received message, hidden for the delay (ChangeMessageVisibility)
    OUTBOX = "outbox"  # a fresh message: the outbox row pending again, due after the delay


@dataclasses.dataclass(frozen=True)
class Verdict:
    """The decision on one attempt.

    Attributes:
        kind: :class:`Kind`.
        reason: For FAIL: ``permanent-error``, ``retries-exhausted`` or ``receive-limit``
            (recorded in the trail's ``detail.reason`` and the DLQ message's ``reason``);
            for DEFER: :data:`OUTAGE_DEFERRAL` (the trail's ``detail.deferred``).
        delay_seconds: For RETRY and DEFER: seconds until the next try (0..43,200).
        via: For RETRY: :attr:`Via.VISIBILITY` when the received message can stay hidden
            that long, else :attr:`Via.OUTBOX` (SQS hides a message at most 12 hours after
            its first receive, and a copy received elsewhere since has a stale handle:
            never ask for visibility 0, which would make the remaining tries run back to
            back).
        breaker_outcome: ``success``, ``failure``, ``neutral`` or ``refund`` (the attempt
            never ran: its admission is given back) for the task's breaker.
        error: The exception the attempt raised (None on success).
    """

    kind: Kind
    reason: str | None = None
    delay_seconds: float = 0.0
    via: Via = Via.VISIBILITY
    breaker_outcome: str = "success"
    error: BaseException | None = None


def decide(
    error: BaseException | None,
    rules: retry.RetryRules,
    *,
    receive_count: int,
    attempt: int,
    visibility_left_seconds: float = SQS_MAX_VISIBILITY_SECONDS,
    rng: random.Random | None = None,
) -> Verdict:
    """The verdict on an attempt that returned (``error`` None) or raised ``error``.

    Args:
        error: What the handler raised; :class:`~sqla_outbox.errors.AttemptTimeout` when
            the attempt's own timeout fired.
        rules: The task's :class:`~sqla_outbox.lifecycle.retry.RetryRules`.
        receive_count: SQS ``ApproximateReceiveCount`` of the delivery (1 for the first).
        attempt: The run's attempt number (``task_runs.attempts`` after the lease).
        visibility_left_seconds: How long the received message can still be hidden
            (the worker: what SQS's 12-hour ceiling leaves, from the message's first
            receive); a longer delay retries through the outbox (:attr:`Via.OUTBOX`).
        rng: Random source for the backoff's jitter (tests pass a seeded one).

    Returns:
        The :class:`Verdict`.
    """
    if error is None:
        return Verdict(Kind.SUCCEED)
    if rules.is_permanent(error):
        return Verdict(Kind.FAIL, reason="permanent-error", breaker_outcome="neutral", error=error)
    spent = retry.tries_spent(receive_count, attempt)
    if retry.exhausted(spent, rules):
        return Verdict(Kind.FAIL, reason="retries-exhausted", breaker_outcome="failure", error=error)
    requested = error.delay_seconds if isinstance(error, errors.Retry) else None
    at_least = error.retry_after_seconds if isinstance(error, errors.WebhookFailed) else None
    delay = retry.failure_delay(spent, rules, requested=requested, at_least=at_least, rng=rng)
    via = Via.VISIBILITY if retry.hideable(delay, visibility_left_seconds) else Via.OUTBOX
    return Verdict(Kind.RETRY, delay_seconds=delay, via=via, breaker_outcome="failure", error=error)


def before_attempt(receive_count: int, rules: retry.RetryRules) -> Verdict | None:
    """A FAIL verdict (``receive-limit``) for a delivery received more often than the run
    has tries, before its handler is called; None when the attempt may run."""
    if not retry.receive_limit_passed(receive_count, rules):
        return None
    error = errors.PermanentError(
        f"delivered {receive_count} times without a verdict (limit {rules.max_receives}); "
        "earlier attempts were lost (worker crash or kill)"
    )
    return Verdict(Kind.FAIL, reason="receive-limit", breaker_outcome="refund", error=error)


OUTAGE_DEFERRAL = "breaker-outage"
"""The deferral reason :func:`ride_out` gives (trail ``detail.deferred``, metrics ``reason``)."""


@dataclasses.dataclass(frozen=True)
class BreakerView:
    """A breaker as its gate left it after recording an attempt's failure.

    Attributes:
        state: ``closed``, ``half_open`` or ``open``.
        outage_seconds: Time since the breaker last left ``closed`` (seconds, the gate's
            clock); None while closed.
        admits_in_seconds: When the breaker may admit a run again: what is left of
            ``open_seconds`` while open, the caller's probe wait in half-open (seconds, >= 0).
        max_outage_seconds: The breaker's retry horizon (``Breaker.max_outage_seconds``).
    """

    state: str
    outage_seconds: float | None
    admits_in_seconds: float
    max_outage_seconds: float


def ride_out(decided: Verdict, breaker: BreakerView | None) -> Verdict:
    """The verdict on a transient failure once the run's breaker has recorded it.

    The rule (``docs/flow-control.md``, "Outages and retries"): a transient failure
    (RETRY, or FAIL with ``retries-exhausted``) that leaves the breaker not closed (this
    failure opened it, a probe failed and opened it again, or the attempt ended while it
    was open or probing) is deferred through the outbox with the attempt not counted,
    due in ``admits_in_seconds``, as long as the outage is younger than
    ``max_outage_seconds``. Anything else is returned unchanged: success, permanent errors,
    ``receive-limit``, failures while the breaker is closed (they count, as without a
    breaker), and every failure once the outage is older than the horizon (then runs
    spend their tries and exhausted ones reach the DLQ, as documented).

    Args:
        decided: :func:`decide`'s verdict on the attempt.
        breaker: The run's breaker after the gate recorded the failure; None when the task
            has no breaker (or the gate did not say).

    Returns:
        ``decided``, or a DEFER verdict with :data:`OUTAGE_DEFERRAL` and the same error.
    """
    if breaker is None or decided.breaker_outcome != "failure":
        return decided
    transient = decided.kind is Kind.RETRY or (
        decided.kind is Kind.FAIL and decided.reason == "retries-exhausted"
    )
    if not transient or breaker.state == "closed" or breaker.outage_seconds is None:
        return decided
    if breaker.outage_seconds >= breaker.max_outage_seconds:
        return decided
    delay = min(max(breaker.admits_in_seconds, 0.0), float(SQS_MAX_VISIBILITY_SECONDS))
    return Verdict(
        Kind.DEFER,
        reason=OUTAGE_DEFERRAL,
        delay_seconds=delay,
        breaker_outcome=decided.breaker_outcome,
        error=decided.error,
    )
