"""The queue registry: every queue, built in or declared in the catalog, with every property.

A queue is one SQS queue and its dead-letter queue (``<prefix><name>`` and
``<prefix><name>-dlq``), plus what the library does with it. Four queues are built in;
an application declares more under ``queues`` in its catalog (``tasks.json``, or
``registry.queue(...)`` in worker code). Every reader asks the registry: the relay (which
queues it reports in its gauges, how many it claims for in a pass), provisioning (the
attributes each queue and DLQ should have), the worker (the weights that share its slots,
its tasks' default attempt timeout, the lease it takes), ``status`` and the dashboard
(which queues they list and count). Adding a property to a queue is a field here, where the
catalog reads it, and the readers that act on it.

Properties (:class:`Queue`) and where their defaults come from:

========================  =========  ========  ======  ===========  ==========================
queue                     visibility  weight   attempt redrive       retention
                          timeout              timeout maxReceive-   (MessageRetention-
                                                        Count         Period)
========================  =========  ========  ======  ===========  ==========================
critical                  60 s       8         30 s    setting       setting
default                   120 s      4         300 s   setting       setting
bulk                      900 s      2         1800 s  setting       setting
maintenance               300 s      1         900 s   setting       setting
declared                  120 s      1         300 s   its own, or   its own, or the setting
                                                        the setting
========================  =========  ========  ======  ===========  ==========================

Settings override what is deployed (:meth:`QueueRegistry.deployed`):
``queue_visibility_timeouts`` (any queue) > ``visibility_timeout_<queue>_seconds`` (the four
built-in queues) > the queue's own; ``max_receive_count`` and
``sqs_message_retention_seconds`` apply where the queue gives none; ``queue_prefix`` names
them in SQS.

Imports only leaves (errors, types); the settings it reads are passed in
(:class:`DeploySettings`, which :class:`sqla_outbox.config.OutboxSettings` is).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator
from typing import Any, Protocol

from sqla_outbox import errors
from sqla_outbox.types import QUEUE_NAMES, SQS_MAX_VISIBILITY_SECONDS

DECLARED_VISIBILITY_SECONDS = 120
"""Visibility timeout of a declared queue that gives none (the ``default`` queue's)."""

DECLARED_ATTEMPT_TIMEOUT_SECONDS = 300.0
"""Attempt timeout of the tasks of a declared queue that set none (the ``default`` queue's)."""


@dataclasses.dataclass(frozen=True)
class Queue:
    """One logical queue and its properties.

    Attributes:
        name: Logical name (``types.QUEUE_NAME_PATTERN``); SQS names ``<prefix><name>`` and
            ``<prefix><name>-dlq``.
        visibility_timeout_seconds: Visibility timeout ``provision`` gives it and its DLQ,
            0..43200 s (SQS VisibilityTimeout); settings override it.
        message_retention_seconds: MessageRetentionPeriod of the source queue, 60..1209600
            s; None: the setting ``sqs_message_retention_seconds``.
        max_receive_count: Redrive policy maxReceiveCount, 1..1000; None: the setting
            ``max_receive_count``.
        weight: Share of a worker's handler slots when queues are backed up, relative to
            the other queues it consumes (critical 8, default 4, bulk 2, maintenance 1).
        attempt_timeout_seconds: Per-attempt timeout of its tasks that set none, seconds.
        description: Free text for humans.
        builtin: One of the four built-in queues (not written to the catalog).
    """

    name: str
    visibility_timeout_seconds: int = DECLARED_VISIBILITY_SECONDS
    message_retention_seconds: int | None = None
    max_receive_count: int | None = None
    weight: int = 1
    attempt_timeout_seconds: float = DECLARED_ATTEMPT_TIMEOUT_SECONDS
    description: str | None = None
    builtin: bool = False

    def to_dict(self) -> dict[str, Any]:
        """The catalog's form of a declared queue (``tasks.json``, under ``queues``)."""
        out: dict[str, Any] = {"visibility_timeout_seconds": self.visibility_timeout_seconds}
        if self.message_retention_seconds is not None:
            out["message_retention_seconds"] = self.message_retention_seconds
        if self.max_receive_count is not None:
            out["max_receive_count"] = self.max_receive_count
        out["weight"] = self.weight
        if self.description:
            out["description"] = self.description
        return out

    @classmethod
    def from_dict(cls, name: str, spec: dict[str, Any]) -> Queue:
        """A declared queue from its catalog entry (already checked against the schema)."""
        return cls(
            name=name,
            visibility_timeout_seconds=spec.get("visibility_timeout_seconds", DECLARED_VISIBILITY_SECONDS),
            message_retention_seconds=spec.get("message_retention_seconds"),
            max_receive_count=spec.get("max_receive_count"),
            weight=spec.get("weight", 1),
            description=spec.get("description"),
        )


BUILTIN: tuple[Queue, ...] = (
    Queue("critical", 60, weight=8, attempt_timeout_seconds=30.0, builtin=True,
          description="short, user-facing work"),
    Queue("default", 120, weight=4, attempt_timeout_seconds=300.0, builtin=True,
          description="everything else"),
    Queue("bulk", 15 * 60, weight=2, attempt_timeout_seconds=1800.0, builtin=True,
          description="long or large batches"),
    Queue("maintenance", 5 * 60, weight=1, attempt_timeout_seconds=900.0, builtin=True,
          description="the library's own upkeep (the purge) and platform chores"),
)  # fmt: skip
"""The four built-in queues, always present (the database CHECK constraints allow them)."""

BUILTIN_BY_NAME: dict[str, Queue] = {q.name: q for q in BUILTIN}
assert tuple(BUILTIN_BY_NAME) == QUEUE_NAMES


class DeploySettings(Protocol):
    """The settings that say how queues are deployed (:class:`~sqla_outbox.config.OutboxSettings`
    has them, with ``visibility_timeout_<queue>_seconds`` for the built-in queues)."""

    @property
    def queue_visibility_timeouts(self) -> tuple[str, ...]: ...

    @property
    def sqs_message_retention_seconds(self) -> int: ...

    @property
    def max_receive_count(self) -> int: ...

    def queue_url_name(self, queue: str) -> str: ...

    def dlq_url_name(self, queue: str) -> str: ...


@dataclasses.dataclass(frozen=True)
class DeployedQueue:
    """A queue as deployed with the settings: what ``provision`` applies and workers expect.

    Attributes:
        queue: The :class:`Queue`.
        sqs_name / dlq_name: The SQS queue names (``queue_prefix`` + name, ``-dlq``).
        visibility_timeout_seconds: After the settings' overrides, seconds.
        message_retention_seconds: The source queue's retention, seconds.
        max_receive_count: The redrive policy's maxReceiveCount.
    """

    queue: Queue
    sqs_name: str
    dlq_name: str
    visibility_timeout_seconds: int
    message_retention_seconds: int
    max_receive_count: int


class QueueRegistry:
    """The built-in queues, then the declared ones in declaration order.

    Args:
        declared: The catalog's declared queues (:attr:`sqla_outbox.catalog.Catalog.queues`).

    Raises:
        CatalogError: A declared queue reuses a built-in name.
    """

    def __init__(self, declared: Iterable[Queue] = ()) -> None:
        self._queues: dict[str, Queue] = dict(BUILTIN_BY_NAME)
        for queue in declared:
            if queue.name in BUILTIN_BY_NAME:
                raise errors.CatalogError(f"queue {queue.name!r} is built in; declare another name")
            self._queues[queue.name] = queue

    @property
    def names(self) -> tuple[str, ...]:
        """Every queue name, built-in first."""
        return tuple(self._queues)

    @property
    def declared(self) -> tuple[Queue, ...]:
        """The declared queues only."""
        return tuple(q for q in self._queues.values() if not q.builtin)

    def __iter__(self) -> Iterator[Queue]:
        return iter(self._queues.values())

    def __len__(self) -> int:
        return len(self._queues)

    def __contains__(self, name: object) -> bool:
        return name in self._queues

    def get(self, name: str) -> Queue:
        """The queue named ``name``.

        Raises:
            KeyError: No such queue.
        """
        return self._queues[name]

    def check(self, name: str, *, task: str, where: str = "") -> Queue:
        """The queue named ``name`` for ``task``.

        Raises:
            UnknownQueue: No such queue (names the task and the queues there are).
        """
        try:
            return self._queues[name]
        except KeyError:
            raise errors.UnknownQueue(
                task,
                f"unknown queue {name!r}; expected one of {', '.join(self.names)} "
                f"(declare more under 'queues' in the task catalog{where})",
            ) from None

    def weights(self) -> dict[str, int]:
        """Queue → weight, for the worker's slot pool."""
        return {q.name: q.weight for q in self}

    def attempt_timeout_seconds(self, name: str) -> float:
        """The default attempt timeout of ``name``'s tasks (the ``default`` queue's for an
        unknown name)."""
        queue = self._queues.get(name) or self._queues["default"]
        return queue.attempt_timeout_seconds

    def deployed(self, name: str, settings: DeploySettings) -> DeployedQueue:
        """``name`` as the settings deploy it (see the module docstring for precedence).

        Raises:
            KeyError: No such queue.
        """
        queue = self._queues[name]
        return DeployedQueue(
            queue=queue,
            sqs_name=settings.queue_url_name(name),
            dlq_name=settings.dlq_url_name(name),
            visibility_timeout_seconds=visibility_timeout_seconds(queue, settings),
            message_retention_seconds=queue.message_retention_seconds
            or settings.sqs_message_retention_seconds,
            max_receive_count=queue.max_receive_count or settings.max_receive_count,
        )


def visibility_timeout_seconds(queue: Queue, settings: DeploySettings) -> int:
    """The visibility timeout ``queue`` is deployed with, seconds (0..43200, SQS
    VisibilityTimeout): ``queue_visibility_timeouts`` > ``visibility_timeout_<queue>_seconds``
    (built-in queues) > the queue's own."""
    for entry in settings.queue_visibility_timeouts:
        name, _, seconds = entry.partition("=")
        if name.strip() == queue.name:
            return min(int(seconds), SQS_MAX_VISIBILITY_SECONDS)
    if queue.builtin:
        return int(getattr(settings, f"visibility_timeout_{queue.name}_seconds"))
    return queue.visibility_timeout_seconds


BUILTIN_REGISTRY = QueueRegistry()
"""The registry without a catalog: the four built-in queues."""
