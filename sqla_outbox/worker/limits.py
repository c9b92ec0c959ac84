"""Per-task flow-control declarations: ``rate_limit``, ``concurrency`` and ``breaker`` on ``@task``.

::

    @task("charge_card", rate_limit="100/m", concurrency=5, breaker="payments-api")
    def charge_card(payload, ctx): ...

    @task("refund_card", breaker=Breaker("payments-api", failures=3, open_seconds=60))
    def refund_card(payload, ctx): ...

These are only the declarations, checked when the task module is imported (a bad value
raises :class:`~sqla_outbox.errors.ConfigurationError` naming the task); the worker's
admission gate (:mod:`sqla_outbox.worker.gate`) enforces them across every worker
process through Valkey. ``docs/flow-control.md`` describes the semantics.
"""

from __future__ import annotations

import dataclasses
import re

from sqla_outbox import errors

PERIOD_SECONDS = {"s": 1, "sec": 1, "second": 1, "m": 60, "min": 60, "minute": 60, "h": 3600, "hour": 3600}
"""Units a ``rate_limit`` string may use (``"100/m"``, ``"5/s"``, ``"1000/h"``, ``"10/30s"``)."""

_RATE = re.compile(r"^\s*(\d+)\s*/\s*(\d*)\s*([a-z]+)\s*$")
_BREAKER_KEY = re.compile(r"[A-Za-z0-9_.:-]{1,100}")
MAX_PERIOD_SECONDS = 86_400
MAX_CONCURRENCY = 10_000
MAX_OUTAGE_SECONDS = 604_800
"""Longest ``Breaker.max_outage_seconds``: 7 days, as long as Valkey keeps a breaker's
record after its last outcome."""


@dataclasses.dataclass(frozen=True)
class RateLimit:
    """At most ``count`` admissions in any window of ``period_seconds`` (a sliding window,
    across all worker processes).

    Attributes:
        count: Admissions per window, 1..1,000,000.
        period_seconds: Window length, 1..86,400 s.
    """

    count: int
    period_seconds: int

    @classmethod
    def parse(cls, text: str, *, task: str) -> RateLimit:
        """Read ``"N/unit"`` or ``"N/Kunit"`` (unit ``s``, ``m`` or ``h``; ``"100/m"``,
        ``"10/30s"``).

        Raises:
            ConfigurationError: Anything else, naming the task and the accepted forms.
        """
        if not isinstance(text, str):
            raise errors.ConfigurationError(
                f"task {task!r}: rate_limit must be a string such as '100/m', got {type(text).__name__}",
                option="@task(rate_limit)",
            )
        match = _RATE.match(text.lower())
        unit = PERIOD_SECONDS.get(match.group(3)) if match else None
        if match is None or unit is None:
            raise errors.ConfigurationError(
                f"task {task!r}: rate_limit {text!r} is not 'N/s', 'N/m', 'N/h' or 'N/<K><unit>' "
                "(e.g. '100/m', '5/s', '10/30s')",
                option="@task(rate_limit)",
            )
        count = int(match.group(1))
        period = int(match.group(2) or 1) * unit
        if not 1 <= count <= 1_000_000 or not 1 <= period <= MAX_PERIOD_SECONDS:
            raise errors.ConfigurationError(
                f"task {task!r}: rate_limit {text!r} must allow 1..1000000 runs per 1 s..24 h",
                option="@task(rate_limit)",
            )
        return cls(count, period)

    def __str__(self) -> str:
        return f"{self.count}/{self.period_seconds}s"


@dataclasses.dataclass(frozen=True)
class Breaker:
    """A circuit breaker on an integration key, shared by every task that names the key.

    Defaults follow the BullMQ design (``docs/flow-control.md``): ``failures`` failures in
    a row open it; after ``open_seconds`` it is half-open and lets ``successes`` probe
    runs through at a time; that many successes close it, one failure opens it again.
    Only outcomes of runs admitted in the breaker's current period count (a run admitted
    before it opened cannot close it or open it again; ``docs/flow-control.md``).

    Attributes:
        key: Integration key, ``[A-Za-z0-9_.:-]{1,100}``.
        failures: Consecutive failures that open it (1..1000, default 5).
        open_seconds: How long it stays open before probing (1..86,400 s, default 30).
        successes: Successes in half-open that close it (1..100, default 2).
        max_outage_seconds: The breaker's retry horizon (0..604,800 s, default 600): while
            it has been open (or probing) for less than this since it last closed, a
            transient failure that finds it open (the failure that opened it, a failed
            probe) is deferred to its next probe time without counting the attempt
            (:func:`sqla_outbox.lifecycle.verdict.ride_out`); past it, failures count as
            usual and exhausted runs reach the DLQ. 0: failures always count.
    """

    key: str
    failures: int = 5
    open_seconds: float = 30.0
    successes: int = 2
    max_outage_seconds: float = 600.0

    def check(self, task: str) -> Breaker:
        """Raises ConfigurationError (naming ``task``) for a bad key or setting."""
        # fullmatch: ``$`` would also match before a trailing newline ("payments-api\n")
        if not isinstance(self.key, str) or not _BREAKER_KEY.fullmatch(self.key):
            raise errors.ConfigurationError(
                f"task {task!r}: breaker key {self.key!r} must match [A-Za-z0-9_.:-]{{1,100}}",
                option="@task(breaker)",
            )
        for name, low, high in (
            ("failures", 1, 1000),
            ("open_seconds", 1, 86_400),
            ("successes", 1, 100),
            ("max_outage_seconds", 0, MAX_OUTAGE_SECONDS),
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or not low <= value <= high:
                raise errors.ConfigurationError(
                    f"task {task!r}: breaker {self.key!r} {name} must be within {low}..{high}, got {value!r}",
                    option="@task(breaker)",
                )
        return self


@dataclasses.dataclass(frozen=True)
class TaskLimits:
    """What a task declared: each part None when not set.

    Attributes:
        rate: :class:`RateLimit`. concurrency: Runs at once across all workers (1..10,000).
        breaker: :class:`Breaker`.
    """

    rate: RateLimit | None = None
    concurrency: int | None = None
    breaker: Breaker | None = None

    @property
    def any(self) -> bool:
        return self.rate is not None or self.concurrency is not None or self.breaker is not None

    @classmethod
    def declare(
        cls,
        task: str,
        *,
        rate_limit: str | None,
        concurrency: int | None,
        breaker: str | Breaker | None,
        known_breakers: dict[str, Breaker],
    ) -> TaskLimits:
        """Check ``@task``'s flow-control options.

        Args:
            task: The task's name (for messages).
            rate_limit / concurrency / breaker: As given to ``@task``.
            known_breakers: Breakers other tasks of the registry declared with explicit
                settings, by key: a key named by string takes their settings (or the
                defaults until one is declared; the registry keeps the declared settings
                per key, :attr:`Registry.breakers`); a :class:`Breaker` with other settings
                than an earlier explicit declaration of its key is refused.

        Raises:
            ConfigurationError: A bad value or conflicting breaker settings, naming the task.
        """
        rate = None if rate_limit is None else RateLimit.parse(rate_limit, task=task)
        if concurrency is not None and (
            isinstance(concurrency, bool)
            or not isinstance(concurrency, int)
            or not 1 <= concurrency <= MAX_CONCURRENCY
        ):
            raise errors.ConfigurationError(
                f"task {task!r}: concurrency must be an integer within 1..{MAX_CONCURRENCY}, "
                f"got {concurrency!r}",
                option="@task(concurrency)",
            )
        declared: Breaker | None
        if breaker is None:
            declared = None
        elif isinstance(breaker, str):
            declared = known_breakers.get(breaker) or Breaker(breaker).check(task)
        elif isinstance(breaker, Breaker):
            declared = breaker.check(task)
            earlier = known_breakers.get(breaker.key)
            if earlier is not None and earlier != declared:
                raise errors.ConfigurationError(
                    f"task {task!r}: breaker {breaker.key!r} is already declared with other settings "
                    f"({earlier}); declare its settings once and name it by key elsewhere",
                    option="@task(breaker)",
                )
        else:
            raise errors.ConfigurationError(
                f"task {task!r}: breaker must be a key such as 'payments-api' or a Breaker(...), "
                f"got {type(breaker).__name__}",
                option="@task(breaker)",
            )
        return cls(rate=rate, concurrency=concurrency, breaker=declared)
