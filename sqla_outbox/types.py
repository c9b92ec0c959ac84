"""Leaf types shared by every layer: JSON values, queue names, run statuses.

This module imports nothing from the package, so any module may import it.
"""

from __future__ import annotations

import enum
import re
import uuid
from collections.abc import Mapping, Sequence
from typing import Any, TypeAlias

JSONScalar: TypeAlias = str | int | float | bool | None
JSONValue: TypeAlias = JSONScalar | list["JSONValue"] | dict[str, "JSONValue"]
"""A value that ``json.dumps`` encodes without a custom encoder."""

JSONPayload: TypeAlias = Mapping[str, Any] | Sequence[Any] | str | int | float | bool | None
"""What ``Dispatch``/``Publish`` accept as a payload statically (``dict[str, object]`` from
mixed literals included); the value is checked to be plain JSON at construction."""

NAME_PATTERN = r"[A-Za-z0-9_.:-]{1,200}"
"""Task and event names: 1..200 letters, digits and ``_ . : -``."""

_NAME = re.compile(NAME_PATTERN)


def is_name(value: object) -> bool:
    """Whether ``value`` is a task or event name (:data:`NAME_PATTERN`), as a whole string.

    ``re.fullmatch``, not ``match`` with ``$``: ``$`` also matches before a trailing newline,
    so ``"record\\n"`` would pass (Python ``re`` documentation, "$").
    """
    return isinstance(value, str) and _NAME.fullmatch(value) is not None


RunId: TypeAlias = uuid.UUID
"""Identity of one unit of work: the outbox row, the envelope and the ``task_runs`` row share it."""


class QueueName(enum.StrEnum):
    """The four logical queues. The database CHECK constraints allow exactly these names.

    Default visibility timeouts (docs/concepts.md, "Queues"): critical 60 s, default 120 s, bulk 15 min,
    maintenance 5 min.
    """

    CRITICAL = "critical"
    DEFAULT = "default"
    BULK = "bulk"
    MAINTENANCE = "maintenance"


QUEUE_NAMES: tuple[str, ...] = tuple(q.value for q in QueueName)
"""The four default queues, always present. An application declares more in its catalog
(:class:`sqla_outbox.catalog.QueueSpec`)."""

QUEUE_NAME_PATTERN = r"[A-Za-z0-9_-]{1,40}"
"""Logical queue names: 1..40 letters, digits, ``-`` and ``_``. SQS queue names allow 1..80
of these characters (SQS CreateQueue, QueueName); the prefix (at most 60) and ``-dlq`` must
fit too, which provisioning checks."""

_QUEUE_NAME = re.compile(QUEUE_NAME_PATTERN)


def is_queue_name(value: object) -> bool:
    """Whether ``value`` is a well-formed logical queue name (:data:`QUEUE_NAME_PATTERN`)."""
    return isinstance(value, str) and _QUEUE_NAME.fullmatch(value) is not None


SQS_MAX_VISIBILITY_SECONDS = 43_200
"""Largest visibility timeout SQS accepts, and the longest a received message can stay hidden
in all, counted from its first receive: 12 hours (SQS ChangeMessageVisibility quota)."""


class RunStatus(enum.StrEnum):
    """Life cycle of a ``task_runs`` row.

    ``queued`` (at dispatch) → ``running`` → ``succeeded``; or ``running`` → ``retrying`` →
    ``running`` … → ``failed``. A run returned on worker shutdown goes back to ``queued``.
    ``cancelled``: a committed :class:`~sqla_outbox.controls.Cancel` ended it before it
    finished (``docs/cancellation.md``).
    """

    QUEUED = "queued"
    RUNNING = "running"
    RETRYING = "retrying"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"


RUN_STATUSES: tuple[str, ...] = tuple(s.value for s in RunStatus)
UNFINISHED_STATUSES: tuple[str, ...] = ("queued", "running", "retrying")
FINISHED_STATUSES: tuple[str, ...] = ("succeeded", "failed", "cancelled")

WAKE_CHANNEL = "sqla_outbox_wake"
"""PostgreSQL ``LISTEN``/``NOTIFY`` channel of the PostgreSQL wake. Notifications reach only
listeners of the same database, so one name serves every installation (one active relay
per database)."""

PRIORITY_MIN, PRIORITY_MAX = 1, 10
"""Run priority range; lower runs first (the BullMQ convention; docs/flow-control.md)."""
TRIGGER_PRIORITIES = {"webhook": 1, "manual": 2, "dispatch": 3, "schedule": 5}
"""Default priority by what started a run, when neither the dispatch nor the catalog sets
one: webhook deliveries 1, operator actions (requeue) 2, application dispatches 3 (BullMQ's
"external queue"), scheduled slots 5."""
DEFAULT_PRIORITY = TRIGGER_PRIORITIES["dispatch"]


def is_priority(value: object) -> bool:
    """True for an int (not bool) within ``PRIORITY_MIN..PRIORITY_MAX``."""
    return isinstance(value, int) and not isinstance(value, bool) and PRIORITY_MIN <= value <= PRIORITY_MAX
