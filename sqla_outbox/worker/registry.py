"""Registering task handlers: the ``@task`` decorator and the registry behind it.

::

    from sqla_outbox.worker import task, TaskContext

    @task("send_receipt", queue="critical", scope="tenant", timeout_seconds=30)
    def send_receipt(payload: dict, ctx: TaskContext) -> None:
        ...

    @task("award_loyalty", queue="bulk", subscribes=["order.placed"],
          permanent=(KeyError,), retry=RetryPolicy(backoff_base_seconds=10))
    async def award_loyalty(payload: dict, ctx: TaskContext) -> None:
        ...

A handler takes the payload, or the payload and a :class:`~sqla_outbox.worker.context.
TaskContext`. Sync handlers run on their own thread; ``async def`` handlers run on the
worker's event loop. The registry also produces the catalog (``tasks.json``) that the
API side reads: ``python -m sqla_outbox catalog write``.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import inspect
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from sqla_outbox import errors, maintenance, queues, webhooks
from sqla_outbox.catalog import DEFAULT_QUEUE_VISIBILITY_SECONDS, Catalog, QueueSpec, Scope, TaskSpec
from sqla_outbox.config import OutboxSettings
from sqla_outbox.lifecycle import retry
from sqla_outbox.lifecycle.retry import RetryRules
from sqla_outbox.types import PRIORITY_MAX, PRIORITY_MIN, QUEUE_NAMES, is_priority
from sqla_outbox.worker.limits import Breaker, TaskLimits

RetryPolicy = retry.RetryPolicy
"""How a task retries transient failures (:class:`sqla_outbox.lifecycle.retry.RetryPolicy`)."""


@dataclasses.dataclass(frozen=True)
class TaskDefinition:
    """A registered handler and its options.

    Attributes:
        name: Task name. handler: The function. queue: Logical queue.
        scope: ``tenant``, ``platform`` or ``any`` (checked by the API side).
        timeout_seconds: Per-attempt limit (None: the queue default; 0: no limit).
        priority: Default priority of its runs (1..10, lower first; None: by trigger).
        retry: :class:`RetryPolicy`.
        permanent: Exception types that mean "do not retry" besides
            :class:`~sqla_outbox.errors.PermanentError`.
        subscribes: Events this task receives.
        schedule: ``{"cron": ...}`` or ``{"every_seconds": ...}`` for recurring runs.
        is_async: The handler is a coroutine function.
        takes_context: The handler takes ``(payload, ctx)`` rather than ``(payload)``.
        limits: Rate limit, concurrency cap and breaker (:mod:`sqla_outbox.worker.limits`).
    """

    name: str
    handler: Callable[..., Any]
    queue: str = "default"
    scope: Scope = "any"
    timeout_seconds: float | None = None
    retry: RetryPolicy = dataclasses.field(default_factory=RetryPolicy)
    permanent: tuple[type[BaseException], ...] = ()
    subscribes: tuple[str, ...] = ()
    schedule: Mapping[str, Any] | None = None
    description: str | None = None
    priority: int | None = None
    is_async: bool = False
    takes_context: bool = True
    limits: TaskLimits = dataclasses.field(default_factory=TaskLimits)

    def effective_timeout(self) -> float | None:
        """Seconds an attempt may run, or None for no limit."""
        if self.timeout_seconds is None:
            return queues.BUILTIN_REGISTRY.attempt_timeout_seconds(self.queue)
        return None if self.timeout_seconds == 0 else self.timeout_seconds

    def retry_rules(self, settings: OutboxSettings) -> RetryRules:
        """The task's :class:`~sqla_outbox.lifecycle.retry.RetryRules`: its ``retry``
        policy over the worker settings (``worker_max_receives``,
        ``worker_backoff_base_seconds``, ``worker_backoff_max_seconds``) and its
        ``permanent`` types."""
        return retry.RetryRules.resolve(
            self.retry,
            default_max_receives=settings.worker_max_receives,
            default_base_seconds=settings.worker_backoff_base_seconds,
            default_max_seconds=settings.worker_backoff_max_seconds,
            permanent=self.permanent,
        )

    def spec(self) -> TaskSpec:
        return TaskSpec(
            name=self.name,
            queue=self.queue,
            scope=self.scope,
            timeout_seconds=self.timeout_seconds,
            schedule=self.schedule,
            description=self.description,
            priority=self.priority,
        )


class Registry:
    """Task name → :class:`TaskDefinition`. The module-level :data:`registry` is the default.

    ``Registry()`` starts empty (tests that want an exact set of tasks);
    :meth:`with_builtins` adds sqla_outbox's own tasks (``maintenance.purge``), as the
    default registry does.
    """

    def __init__(self) -> None:
        self.tasks: dict[str, TaskDefinition] = {}
        self.breakers: dict[str, Breaker] = {}
        """Breaker settings by integration key (the defaults unless a task declared them)."""
        self._explicit_breakers: dict[str, Breaker] = {}
        self.queues: dict[str, QueueSpec] = {}

    def queue(
        self,
        name: str,
        *,
        visibility_timeout_seconds: int = DEFAULT_QUEUE_VISIBILITY_SECONDS,
        message_retention_seconds: int | None = None,
        max_receive_count: int | None = None,
        weight: int = 1,
        description: str | None = None,
    ) -> QueueSpec:
        """Declare a queue besides the four defaults; the catalog written from this registry
        lists it under ``queues`` (``docs/queues.md``). Declare it before the ``@task`` that
        uses it. Fields: :class:`~sqla_outbox.catalog.QueueSpec`.

        Raises:
            ConfigurationError: A bad name (or one of the four), a value outside the SQS
                limits (visibility 0..43200 s, retention 60..1209600 s, maxReceiveCount
                1..1000), or ``name`` declared before with other values.
        """
        spec = QueueSpec(
            name=name,
            visibility_timeout_seconds=visibility_timeout_seconds,
            message_retention_seconds=message_retention_seconds,
            max_receive_count=max_receive_count,
            weight=weight,
            description=description,
        )
        existing = self.queues.get(name)
        if existing is not None and existing != spec:
            raise errors.ConfigurationError(
                f"queue {name!r} is already declared as {existing}", option="queue()"
            )
        try:  # the catalog's own rules, checked now
            Catalog.build([], {}, [spec])
        except errors.CatalogError as exc:
            raise errors.ConfigurationError(f"queue {name!r}: {exc}", option="queue()") from None
        self.queues[name] = spec
        return spec

    @classmethod
    def with_builtins(cls) -> Registry:
        """A registry holding sqla_outbox's built-in tasks (:data:`sqla_outbox.maintenance.
        BUILTIN_HANDLERS`), registered with their catalog options."""
        registry = cls()
        registry.register_builtins()
        return registry

    def register_builtins(self) -> None:
        """Register sqla_outbox's built-in tasks (idempotent)."""
        for spec, handler in maintenance.BUILTIN_HANDLERS.values():
            self.task(
                spec.name,
                queue=spec.queue,
                scope=spec.scope,
                timeout_seconds=spec.timeout_seconds,
                schedule=spec.schedule,
                description=spec.description,
            )(handler)

    def webhook_events(
        self, *events: str, queue: str | None = None, retry: RetryPolicy | None = None
    ) -> None:
        """Declare webhook events: publishing one schedules a delivery to each subscribed,
        enabled endpoint of the tenant (``docs/webhooks.md``).

        Registers the built-in task ``webhooks.deliver`` (once; later calls add events) as
        a subscriber of ``events``, so the catalog written from this registry marks them.

        Args:
            *events: Event names.
            queue: Queue of the deliveries (default ``default``; set on the first call).
            retry: Retry policy of the deliveries (default: backoff from 60 s, doubling,
                capped at 1 h; ``max_receives`` from the worker settings).

        Raises:
            ConfigurationError: A bad event name or queue, or a different queue or retry
                policy than an earlier call gave.
        """
        spec = webhooks.WEBHOOK_SPEC
        existing = self.tasks.get(spec.name)
        if existing is not None and (
            (queue is not None and queue != existing.queue) or (retry is not None and retry != existing.retry)
        ):
            raise errors.ConfigurationError(
                f"{spec.name} is already registered with queue {existing.queue!r} and {existing.retry}",
                option="webhook_events",
            )
        subscribes = [*(existing.subscribes if existing else ()), *(e for e in events)]
        if existing is not None:
            del self.tasks[spec.name]  # registered again below with the added events
        try:
            self.task(
                spec.name,
                queue=existing.queue if existing else (queue or spec.queue),
                scope=spec.scope,
                timeout_seconds=spec.timeout_seconds,
                retry=existing.retry if existing else (retry or WEBHOOK_RETRY),
                subscribes=dict.fromkeys(subscribes),
                description=spec.description,
            )(_deliver_webhook)
        except errors.ConfigurationError:
            if existing is not None:  # a bad name: the earlier declaration stands
                self.tasks[spec.name] = existing
            raise

    def task(
        self,
        name: str,
        *,
        queue: str = "default",
        scope: Scope = "any",
        timeout_seconds: float | None = None,
        retry: RetryPolicy | None = None,
        permanent: Iterable[type[BaseException]] = (),
        subscribes: Iterable[str] = (),
        schedule: Mapping[str, Any] | None = None,
        description: str | None = None,
        rate_limit: str | None = None,
        concurrency: int | None = None,
        breaker: str | Breaker | None = None,
        priority: int | None = None,
    ) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
        """Decorator registering a handler for ``name``.

        Flow control (``docs/flow-control.md``), enforced across all worker processes;
        a run held back by any of them is deferred through the outbox, spending no
        attempt and no receive:

        * ``rate_limit``: ``"N/s"``, ``"N/m"``, ``"N/h"`` or ``"N/<K><unit>"`` (``"100/m"``,
          ``"10/30s"``): at most N runs start in any such sliding window.
        * ``concurrency``: at most this many runs of the task at once (1..10,000).
        * ``breaker``: an integration key (``"payments-api"``; several tasks may share it)
          or a :class:`~sqla_outbox.worker.limits.Breaker` with its settings.

        Raises:
            ConfigurationError: Unknown queue or scope, a bad timeout or priority, a name or event name
                outside ``[A-Za-z0-9_.:-]{1,200}``, a bad schedule (cron expression or
                interval), a bad ``rate_limit``/``concurrency``/``breaker`` or breaker
                settings that conflict with another task's, or ``name`` already registered
                to another function. Raised when the module is imported, not later when
                the catalog is written.
        """
        known = queues.QueueRegistry(self.queues.values())
        if queue not in known:
            raise errors.ConfigurationError(
                f"task {name!r}: unknown queue {queue!r}; expected one of "
                f"{', '.join(known.names)} (declare more with queue() before the @task)",
                option="@task(queue)",
            )
        if scope not in ("tenant", "platform", "any"):
            raise errors.ConfigurationError(f"task {name!r}: unknown scope {scope!r}", option="@task(scope)")
        if timeout_seconds is not None and timeout_seconds < 0:
            raise errors.ConfigurationError(f"task {name!r}: timeout_seconds must be >= 0", option="@task")
        if priority is not None and not is_priority(priority):
            raise errors.ConfigurationError(
                f"task {name!r}: priority must be an integer within {PRIORITY_MIN}..{PRIORITY_MAX} "
                f"(lower runs first), got {priority!r}",
                option="@task(priority)",
            )
        if schedule is not None and not isinstance(schedule, Mapping):
            raise errors.ConfigurationError(
                f"task {name!r}: schedule must be a mapping such as {{'cron': '0 3 * * *'}} or "
                f"{{'every_seconds': 3600}}, got {type(schedule).__name__}",
                option="@task(schedule)",
            )
        limits = TaskLimits.declare(
            name,
            rate_limit=rate_limit,
            concurrency=concurrency,
            breaker=breaker,
            known_breakers=self._explicit_breakers,
        )

        def decorate(handler: Callable[..., Any]) -> Callable[..., Any]:
            existing = self.tasks.get(name)
            if existing is not None and existing.handler is not handler:
                qualname = getattr(existing.handler, "__qualname__", existing.handler)
                raise errors.ConfigurationError(
                    f"task {name!r} is already registered to {qualname}", option="@task"
                )
            signature = inspect.signature(handler).parameters.values()
            parameters = [p for p in signature if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
            required = [p for p in parameters if p.default is p.empty]
            required_keywords = [
                p.name for p in signature if p.kind == p.KEYWORD_ONLY and p.default is p.empty
            ]
            takes_varargs = any(p.kind == p.VAR_POSITIONAL for p in signature)
            if len(required) > 2 or required_keywords or (not parameters and not takes_varargs):
                raise errors.ConfigurationError(
                    f"task {name!r}: the handler {getattr(handler, '__qualname__', handler)} must take "
                    "(payload) or (payload, ctx)",
                    option="@task",
                )
            definition = TaskDefinition(
                name=name,
                handler=handler,
                queue=queue,
                scope=scope,
                timeout_seconds=timeout_seconds,
                retry=retry or RetryPolicy(),
                permanent=tuple(permanent),
                subscribes=tuple(subscribes),
                schedule=dict(schedule) if schedule else None,
                description=description or (inspect.getdoc(handler) or "").split("\n")[0] or None,
                priority=priority,
                is_async=inspect.iscoroutinefunction(handler),
                takes_context=len(parameters) >= 2,
                limits=limits,
            )
            try:  # the catalog's own rules (name pattern, schedule), checked at import time
                Catalog.build(
                    [definition.spec()],
                    {event: [name] for event in definition.subscribes},
                    self.queues.values(),
                )
            except errors.CatalogError as exc:
                where = f"{handler.__module__}.{getattr(handler, '__qualname__', handler)}"
                raise errors.ConfigurationError(f"task {name!r} ({where}): {exc}", option="@task") from None
            self.tasks[name] = definition
            if limits.breaker is not None:
                key = limits.breaker.key
                if isinstance(breaker, Breaker):
                    self._explicit_breakers[key] = limits.breaker
                    self.breakers[key] = limits.breaker
                else:
                    self.breakers.setdefault(key, limits.breaker)
            return handler

        return decorate

    def get(self, name: str) -> TaskDefinition:
        """Raises :class:`~sqla_outbox.errors.HandlerNotFound` for unknown names."""
        try:
            return self.tasks[name]
        except KeyError:
            raise errors.HandlerNotFound(name) from None

    def preflight(
        self, settings: OutboxSettings, *, queues: Iterable[str], queues_chosen: bool = True
    ) -> list[str]:
        """Check that a worker with these registrations can serve ``queues``.

        Args:
            settings: The worker's settings (``max_receive_count``, ``worker_max_receives``).
            queues: The logical queues the worker will consume.
            queues_chosen: The operator named ``queues`` (``--queues``); False when they are
                the default four, where a queue no task uses is expected (see
                :meth:`unserved_queues`) and not warned about.

        Returns:
            Warnings: a chosen queue no registered task routes to (any message on it
            would be handed back to the outbox, never run); a task's or the worker's
            ``max_receives`` not below the ``max_receive_count`` setting (SQS would move
            messages to the DLQ before the worker records a verdict). The worker refuses
            that conflict at start against each queue's actual ``RedrivePolicy``, which
            may differ from the setting. Tasks with flow control but no ``valkey_url``
            (limits then hold per process only).

        Raises:
            ConfigurationError: No task besides the built-in ones is registered (the task
                modules were not imported: every message would go to the DLQ); an
                ``async def`` handler is registered but greenlet, which SQLAlchemy's
                asyncio support needs, cannot be imported.
        """
        queues = tuple(queues)
        # (webhooks.deliver counts as the application's: it exists only once a task module
        # declared webhook events, so a webhook-only worker is a real worker)
        own = [d for d in self.tasks.values() if d.name not in maintenance.BUILTIN_TASKS]
        if not own and any(queue != "maintenance" for queue in queues):
            raise errors.ConfigurationError(
                "no task handlers are registered: name your task modules (e.g. --imports "
                "myapp.tasks); without them no message would ever run (each is handed back to the outbox)",
                option="--imports / SQLA_OUTBOX_WORKER_IMPORTS",
            )
        warnings = []
        redrive = settings.max_receive_count  # what provisioning sets; the worker also reads the queues'
        if settings.worker_max_receives >= redrive:
            warnings.append(
                f"worker_max_receives ({settings.worker_max_receives}) is not below max_receive_count "
                f"({redrive}): with that redrive policy SQS dead-letters messages before the worker "
                "records a verdict (the worker checks each queue's actual RedrivePolicy at start)"
            )
        for definition in self.tasks.values():
            limit = definition.retry.max_receives
            if limit is not None and limit >= redrive:
                warnings.append(
                    f"task {definition.name!r}: RetryPolicy(max_receives={limit}) is not below "
                    f"max_receive_count ({redrive}): with that redrive policy SQS dead-letters its "
                    "messages before the worker records a verdict"
                )
        if any(d.is_async for d in self.tasks.values()):
            if importlib.util.find_spec("greenlet") is None:
                names = ", ".join(sorted(d.name for d in self.tasks.values() if d.is_async))
                raise errors.ConfigurationError(
                    f"async handlers ({names}) need greenlet for SQLAlchemy's asyncio support: "
                    "pip install greenlet",
                    option="@task",
                )
        limited = sorted(d.name for d in self.tasks.values() if d.limits.any)
        if limited and not settings.valkey_url:
            warnings.append(
                f"tasks {', '.join(limited)} declare rate limits, concurrency caps or breakers, but no "
                "valkey_url is set: each worker process enforces them on its own, not across the fleet"
            )
        if not queues_chosen:
            return warnings
        known = set(QUEUE_NAMES) | set(self.queues)  # an unknown queue is refused at start instead
        return warnings + [
            f"no registered task uses queue {queue!r}: this worker would hand its messages back to the outbox"
            for queue in self.unserved_queues(queues)
            if queue in known
        ]

    def unserved_queues(self, queues: Iterable[str]) -> list[str]:
        """The queues of ``queues`` (in order) that no registered task routes to: a message
        there is handed back to the outbox, never run, until a worker with its task takes it
        (as in a rolling deploy)."""
        served = {d.queue for d in self.tasks.values()}
        return [queue for queue in queues if queue not in served]

    def catalog(self) -> Catalog:
        """The catalog these registrations describe (events from ``subscribes``)."""
        events: dict[str, list[str]] = {}
        for definition in sorted(self.tasks.values(), key=lambda d: d.name):
            for event in definition.subscribes:
                events.setdefault(event, []).append(definition.name)
        return Catalog.build([d.spec() for d in self.tasks.values()], events, self.queues.values())


WEBHOOK_RETRY = RetryPolicy(backoff_base_seconds=60, backoff_max_seconds=3600)
"""Default retry policy of webhook deliveries: 1 min, 2 min, 4 min, 8 min (with jitter)."""


def _deliver_webhook(payload: Any, ctx: Any) -> None:
    """The ``webhooks.deliver`` handler (httpx is imported only by workers that deliver)."""
    from sqla_outbox.worker.webhook_delivery import deliver

    deliver(payload, ctx)


registry = Registry.with_builtins()
"""The default registry that :func:`task` registers into (built-in tasks included)."""

task = registry.task
queue = registry.queue
webhook_events = registry.webhook_events
