"""The retry rules: how many tries a run gets and how long it waits before the next one.

Every delay sqla_outbox waits before trying again is computed here, on top of the one
formula of :mod:`sqla_outbox.backoff` (capped exponential, with or without equal jitter):

* **After a transient handler failure** (:func:`failure_delay`): the task's backoff,
  ``base * 2 ** (spent - 1)`` capped at ``cap``, drawn uniformly between half and all of
  it (equal jitter; AWS Architecture Blog, "Exponential Backoff And Jitter"), where
  ``spent`` counts the tries the run used (:func:`tries_spent`). A handler's
  :class:`~sqla_outbox.errors.Retry` replaces the backoff; a webhook receiver's
  ``Retry-After`` (:class:`~sqla_outbox.errors.WebhookFailed`) only lengthens it, so a
  receiver asking for 2 s cannot spend every try within seconds.
* **How many tries** (:func:`exhausted`): a transient failure on the run's
  ``max_receives``-th try fails the run for good (``retries-exhausted``). Tries are the
  larger of the SQS receive count of this delivery and the run's attempts: a deferral
  sends a fresh message whose receive count starts again at 1, while attempts count every
  execution (ADR 0014). A delivery received more often than that without a verdict
  (workers killed mid-attempt) fails before it runs (:func:`receive_limit_passed`).
* **After a failed send to SQS** (:func:`send_delay`): the relay's backoff on the row's
  failed sends, no jitter (one relay sends a row; there is nothing to spread).
* **Before a deferred run is sent again** (:func:`deferral_delay`): no worker implements
  its task (1 s doubling to 60 s) or its flow control refused it
  (``limits_throttle_delay_seconds`` doubling, equal jitter).
* **Reconnecting** (:class:`sqla_outbox.backoff.Doubling`): the loops that wait for a
  database, SQS or Valkey to come back.

SQS bounds what a message can wait hidden: at most 12 hours in all after its first
receive (SQS ChangeMessageVisibility, :data:`~sqla_outbox.types.SQS_MAX_VISIBILITY_SECONDS`).
Where the delay goes (the message's visibility, or the outbox) is the verdict's business
(:mod:`sqla_outbox.lifecycle.verdict`), not this module's.

Pure functions, no I/O; ``tests/unit/test_lifecycle_rules.py`` covers them.
"""

from __future__ import annotations

import dataclasses
import random

from sqla_outbox import backoff, errors
from sqla_outbox.types import SQS_MAX_VISIBILITY_SECONDS

NO_HANDLER_FIRST_SECONDS = 1.0
NO_HANDLER_MAX_SECONDS = 60.0
"""A run no worker here implements is sent again after 1 s, doubling per such deferral,
at most 60 s (the relay also holds rows no live worker implements, so this only spaces out
copies a mixed fleet hands around)."""


@dataclasses.dataclass(frozen=True)
class RetryPolicy:
    """How a task retries transient failures; None fields use the worker settings.

    Attributes:
        max_receives: A transient failure on this try or later fails the run for good and
            sends it to the DLQ (default ``worker_max_receives``, 5). Must stay below the
            queue's redrive ``maxReceiveCount`` (7) so the runtime, not SQS, decides.
        backoff_base_seconds: Nominal delay after the first failure; doubles per try,
            with equal jitter (default ``worker_backoff_base_seconds``, 5 s).
        backoff_max_seconds: Cap of the nominal delay (default
            ``worker_backoff_max_seconds``, 900 s; SQS allows at most 43,200 s of
            visibility).

    Raises:
        ConfigurationError: ``max_receives`` < 1, or a backoff outside 0..43,200 s.
    """

    max_receives: int | None = None
    backoff_base_seconds: float | None = None
    backoff_max_seconds: float | None = None

    def __post_init__(self) -> None:
        if self.max_receives is not None and self.max_receives < 1:
            raise errors.ConfigurationError("max_receives must be >= 1", option="RetryPolicy.max_receives")
        for name in ("backoff_base_seconds", "backoff_max_seconds"):
            value = getattr(self, name)
            if value is not None and not 0 <= value <= SQS_MAX_VISIBILITY_SECONDS:
                raise errors.ConfigurationError(
                    f"{name} must be within 0..43200 s", option=f"RetryPolicy.{name}"
                )


@dataclasses.dataclass(frozen=True)
class RetryRules:
    """The resolved rules one task's attempts follow (a :class:`RetryPolicy` over the settings).

    Attributes:
        max_receives: Tries a run gets (>= 1).
        backoff_base_seconds / backoff_max_seconds: The backoff's nominal first delay and
            its cap, seconds.
        permanent: Exception types that mean "do not retry", besides
            :class:`~sqla_outbox.errors.PermanentError` (``@task(permanent=...)``).
    """

    max_receives: int
    backoff_base_seconds: float
    backoff_max_seconds: float
    permanent: tuple[type[BaseException], ...] = ()

    @classmethod
    def resolve(
        cls,
        policy: RetryPolicy,
        *,
        default_max_receives: int,
        default_base_seconds: float,
        default_max_seconds: float,
        permanent: tuple[type[BaseException], ...] = (),
    ) -> RetryRules:
        """The policy's values, each None replaced by the default (the worker settings
        ``worker_max_receives``, ``worker_backoff_base_seconds``, ``worker_backoff_max_seconds``)."""
        return cls(
            max_receives=policy.max_receives or default_max_receives,
            backoff_base_seconds=(
                default_base_seconds if policy.backoff_base_seconds is None else policy.backoff_base_seconds
            ),
            backoff_max_seconds=(
                default_max_seconds if policy.backoff_max_seconds is None else policy.backoff_max_seconds
            ),
            permanent=permanent,
        )

    def is_permanent(self, exc: BaseException) -> bool:
        """Whether ``exc`` fails the run for good rather than being retried."""
        return isinstance(exc, errors.PermanentError) or isinstance(exc, self.permanent)


def tries_spent(receive_count: int, attempt: int) -> int:
    """Tries a run has used, counting this one: the larger of the delivery's SQS receive
    count and the run's attempt number (a deferral's fresh message starts at receive 1)."""
    return max(receive_count, attempt)


def exhausted(spent: int, rules: RetryRules) -> bool:
    """Whether a transient failure on try ``spent`` fails the run for good."""
    return spent >= rules.max_receives


def receive_limit_passed(receive_count: int, rules: RetryRules) -> bool:
    """Whether a delivery was received more often than the run has tries (earlier
    attempts were lost to crashes before they could record a verdict)."""
    return receive_count > rules.max_receives


def backoff_bounds(
    spent: int, rules: RetryRules, *, ceiling: float = SQS_MAX_VISIBILITY_SECONDS
) -> tuple[float, float]:
    """The range the task's backoff after a failure on try ``spent`` is drawn from, seconds.

    Equal jitter: between half and all of the nominal ``n = min(cap, base * 2 ** (spent -
    1), ceiling)``; the base is the nominal first delay, not a minimum.

    Args:
        spent: :func:`tries_spent` (1 for the first); any integer (the exponent is capped
            before the power is computed).
        rules: The task's rules.
        ceiling: The longest delay that can be given, seconds.
    """
    nominal = backoff.exponential_seconds(
        spent - 1, base=rules.backoff_base_seconds, cap=rules.backoff_max_seconds
    )
    return backoff.equal_jitter_bounds(max(0.0, min(nominal, ceiling)))


def handler_backoff(
    spent: int,
    rules: RetryRules,
    *,
    ceiling: float = SQS_MAX_VISIBILITY_SECONDS,
    rng: random.Random | None = None,
) -> float:
    """The task's backoff after a transient failure on try ``spent``: drawn uniformly within
    :func:`backoff_bounds` (``rng``: a seeded random source for tests)."""
    low, high = backoff_bounds(spent, rules, ceiling=ceiling)
    return rng.uniform(low, high) if rng is not None else random.uniform(low, high)  # noqa: S311 - jitter


def failure_delay(
    spent: int,
    rules: RetryRules,
    *,
    requested: float | None = None,
    at_least: float | None = None,
    ceiling: float = SQS_MAX_VISIBILITY_SECONDS,
    rng: random.Random | None = None,
) -> float:
    """Seconds until the next try after a transient failure.

    Args:
        spent / rules / rng: As for :func:`handler_backoff`.
        requested: A delay the handler asked for (``Retry(delay_seconds)``): it replaces
            the backoff.
        at_least: A floor from outside (a webhook receiver's ``Retry-After``): it only
            lengthens the backoff.
        ceiling: The longest delay that can be given, seconds.

    Returns:
        Seconds within ``[0, ceiling]``.
    """
    if requested is not None:
        return max(0.0, min(requested, ceiling))
    computed = handler_backoff(spent, rules, ceiling=ceiling, rng=rng)
    if at_least is not None:
        return max(0.0, min(max(computed, at_least), ceiling))
    return computed


def hideable(delay_seconds: float, visibility_left_seconds: float) -> bool:
    """Whether a received message can wait ``delay_seconds`` hidden. SQS keeps a message
    hidden at most until 12 hours after its first receive (SQS ChangeMessageVisibility);
    ``visibility_left_seconds`` is what is left of that. With less than a second left,
    nothing is hideable: asking for visibility 0 near the ceiling would make every further
    try run back to back. A wait that cannot be given this way goes through the outbox."""
    return delay_seconds <= visibility_left_seconds and visibility_left_seconds >= 1


def send_delay(failed_sends: int, *, base_seconds: float, max_seconds: float) -> float:
    """Seconds the relay waits before sending a row again after SQS failed it.

    Args:
        failed_sends: The row's failed sends before this one (``outbox.attempts``).
        base_seconds / max_seconds: ``relay_backoff_base_seconds`` / ``relay_backoff_max_seconds``.

    Returns:
        ``min(max, base * 2 ** failed_sends)``: 1 s, 2 s, 4 s, ... (no jitter).
    """
    return backoff.exponential_seconds(failed_sends, base=base_seconds, cap=max_seconds)


def deferral_delay(
    deferrals: int,
    *,
    first_seconds: float,
    max_seconds: float,
    jitter: bool,
    rng: random.Random | None = None,
) -> float:
    """Seconds before a deferred run is sent again, growing with its earlier deferrals.

    Args:
        deferrals: Earlier deferrals of the run with the same reason.
        first_seconds / max_seconds: The first delay and the cap.
        jitter: Draw between half and all of the delay (runs refused together come back
            spread out).
    """
    nominal = backoff.exponential_seconds(deferrals, base=first_seconds, cap=max_seconds)
    return backoff.equal_jitter(nominal, rng) if jitter else nominal


def no_handler_delay(deferrals: int) -> float:
    """:func:`deferral_delay` for a run no worker here implements (see
    :data:`NO_HANDLER_MAX_SECONDS`)."""
    return deferral_delay(
        deferrals, first_seconds=NO_HANDLER_FIRST_SECONDS, max_seconds=NO_HANDLER_MAX_SECONDS, jitter=False
    )
