"""The task catalog, ``tasks.json``: which tasks and events exist, and where they go.

The API process validates every dispatch against the catalog and finds an event's
subscribers in it, so it never imports worker code. The worker writes the file from its
registered handlers (``python -m sqla_outbox catalog write``) and application CI checks that it is
current (``python -m sqla_outbox catalog write --check``).

Format (version 1)::

    {
      "version": 1,
      "tasks": {
        "send_receipt": {"queue": "critical", "scope": "tenant", "timeout_seconds": 30},
        "nightly_report": {"queue": "bulk", "scope": "platform",
                           "schedule": {"cron": "0 3 * * *"}}
      },
      "events": {
        "order.placed": {"subscribers": ["send_receipt", "update_stock"]}
      }
    }

``queue`` is one of critical, default, bulk, maintenance (default ``default``) or a
queue the catalog declares under ``queues``::

      "queues": {
        "reminders": {"visibility_timeout_seconds": 3600, "message_retention_seconds": 1209600,
                      "max_receive_count": 7, "weight": 2}
      }

Every field of a declared queue is optional (defaults: visibility 120 s, the settings'
``sqs_message_retention_seconds`` and ``max_receive_count``, weight 1); names are 1..40
letters, digits, ``-`` and ``_`` and cannot be one of the four. ``docs/queues.md``. ``scope``
is ``tenant`` (a dispatch must carry ``tenant_id``), ``platform`` (it must not), or
``any`` (default). ``timeout_seconds`` is the per-attempt limit the worker applies
(optional; 0 means no limit). ``schedule`` declares a recurring platform run: ``{"cron": "<5 fields>"}`` or
``{"every_seconds": N}``; with ``"tenants": {"table": "tenants", "column": "id"}`` (column
default ``id``) or ``"tenants": {"query": "SELECT id FROM tenants WHERE active"}`` it is
fanned out: one run per listed tenant per slot (``sqla_outbox.relay.schedule``).
Names are 1..200 characters of letters, digits and ``_ . : -``.
The loader validates the file against a JSON Schema and then checks that every subscriber
is a known task; errors name the file and the JSON path of the bad entry.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, Literal

import jsonschema

from sqla_outbox import errors, queues, types
from sqla_outbox.queues import QueueRegistry
from sqla_outbox.types import PRIORITY_MAX, PRIORITY_MIN, QUEUE_NAME_PATTERN, QUEUE_NAMES

CATALOG_VERSION = 1
NAME_PATTERN = rf"^{types.NAME_PATTERN}(?![\s\S])"
"""JSON Schema ``pattern`` of task and event names: the whole string (the lookahead, not
``$``, ends it, because Python's ``$`` also matches before a trailing newline)."""

Scope = Literal["tenant", "platform", "any"]

_IDENTIFIER = r"^[A-Za-z_][A-Za-z0-9_$]{0,62}(\.[A-Za-z_][A-Za-z0-9_$]{0,62})?$"
"""A table (optionally ``schema.table``) or column name of a tenant fan-out schedule:
unquoted PostgreSQL identifiers only, at most 63 characters each (NAMEDATALEN - 1)."""

SCHEMA: dict[str, Any] = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "title": "sqla_outbox task catalog",
    "type": "object",
    "additionalProperties": False,
    "required": ["version", "tasks"],
    "properties": {
        "version": {"const": CATALOG_VERSION},
        "queues": {
            "type": "object",
            "propertyNames": {
                "pattern": rf"^{QUEUE_NAME_PATTERN}(?![\s\S])",
                "not": {"enum": list(QUEUE_NAMES)},
            },
            "additionalProperties": {
                "type": "object",
                "additionalProperties": False,
                "properties": {
                    # SQS SetQueueAttributes: VisibilityTimeout 0..43200 s,
                    # MessageRetentionPeriod 60..1209600 s, maxReceiveCount 1..1000
                    "visibility_timeout_seconds": {"type": "integer", "minimum": 0, "maximum": 43200},
                    "message_retention_seconds": {"type": "integer", "minimum": 60, "maximum": 1209600},
                    "max_receive_count": {"type": "integer", "minimum": 1, "maximum": 1000},
                    "weight": {"type": "integer", "minimum": 1, "maximum": 1000},
                    "description": {"type": "string"},
                },
            },
        },
        "tasks": {
            "type": "object",
            "propertyNames": {"pattern": NAME_PATTERN},
            "additionalProperties": {
                "type": "object",
                "additionalProperties": False,
                "properties": {
                    "queue": {"type": "string", "pattern": rf"^{QUEUE_NAME_PATTERN}(?![\s\S])"},
                    "scope": {"enum": ["tenant", "platform", "any"]},
                    "timeout_seconds": {"type": "number", "minimum": 0},
                    "priority": {"type": "integer", "minimum": PRIORITY_MIN, "maximum": PRIORITY_MAX},
                    "description": {"type": "string"},
                    "schedule": {
                        "type": "object",
                        "additionalProperties": False,
                        "oneOf": [{"required": ["cron"]}, {"required": ["every_seconds"]}],
                        "properties": {
                            "cron": {"type": "string", "minLength": 9},
                            "every_seconds": {"type": "number", "minimum": 1},
                            "tenants": {
                                "type": "object",
                                "additionalProperties": False,
                                "oneOf": [{"required": ["query"]}, {"required": ["table"]}],
                                "properties": {
                                    "query": {"type": "string", "minLength": 8},
                                    "table": {"type": "string", "pattern": _IDENTIFIER},
                                    "column": {"type": "string", "pattern": _IDENTIFIER},
                                },
                            },
                        },
                    },
                },
            },
        },
        "events": {
            "type": "object",
            "propertyNames": {"pattern": NAME_PATTERN},
            "additionalProperties": {
                "type": "object",
                "additionalProperties": False,
                "required": ["subscribers"],
                "properties": {
                    "subscribers": {
                        "type": "array",
                        "uniqueItems": True,
                        "items": {"type": "string", "pattern": NAME_PATTERN},
                    },
                    "description": {"type": "string"},
                },
            },
        },
    },
}


DEFAULT_QUEUE_VISIBILITY_SECONDS = queues.DECLARED_VISIBILITY_SECONDS
"""Visibility timeout of a declared queue that gives none (the ``default`` queue's)."""

QueueSpec = queues.Queue
"""A queue the catalog declares (:class:`sqla_outbox.queues.Queue`)."""


@dataclasses.dataclass(frozen=True)
class TaskSpec:
    """One task as the API side knows it.

    Attributes:
        name: Task name, as given to ``Dispatch`` and ``@task``.
        queue: Logical queue the task's runs are sent to.
        scope: ``tenant`` (tenant_id required), ``platform`` (forbidden) or ``any``.
        timeout_seconds: Per-attempt limit in seconds; 0 means no limit; None the queue default.
        schedule: ``{"cron": ...}`` or ``{"every_seconds": ...}`` for recurring runs.
        description: Free text for humans.
        priority: Default priority of the task's runs (1..10, lower first); None: by
            trigger (:data:`sqla_outbox.types.TRIGGER_PRIORITIES`).
    """

    name: str
    queue: str = "default"
    scope: Scope = "any"
    timeout_seconds: float | None = None
    schedule: Mapping[str, Any] | None = None
    description: str | None = None
    priority: int | None = None

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"queue": self.queue, "scope": self.scope}
        if self.priority is not None:
            out["priority"] = self.priority
        if self.timeout_seconds is not None:
            out["timeout_seconds"] = self.timeout_seconds
        if self.schedule is not None:
            out["schedule"] = dict(self.schedule)
        if self.description:
            out["description"] = self.description
        return out


@dataclasses.dataclass(frozen=True)
class Catalog:
    """Tasks and events known to the application.

    Attributes:
        tasks: Task name → :class:`TaskSpec`.
        events: Event name → subscriber task names, in catalog order.
        source: Where the catalog came from (a path), for error messages.
        queues: Declared queue name → :class:`QueueSpec` (the four defaults not included).
    """

    tasks: Mapping[str, TaskSpec]
    events: Mapping[str, tuple[str, ...]] = dataclasses.field(default_factory=dict)
    source: str | None = None
    queues: Mapping[str, QueueSpec] = dataclasses.field(default_factory=dict)

    # --- loading -------------------------------------------------------------------------
    @classmethod
    def load(cls, path: str | Path) -> Catalog:
        """Read and validate a catalog file.

        Raises:
            CatalogError: The file is missing, is not JSON, or does not match the format;
                the message gives the file and the JSON path of the bad entry.
        """
        path = Path(path)
        try:
            text = path.read_text(encoding="utf-8")
        except FileNotFoundError as exc:
            raise errors.CatalogError(
                "catalog file not found (set SQLA_OUTBOX_CATALOG_PATH, or generate it with "
                "`python -m sqla_outbox catalog write`)",
                path=str(path),
            ) from exc
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise errors.CatalogError(
                f"not valid JSON: {exc.msg} (line {exc.lineno}, column {exc.colno})",
                path=str(path),
            ) from exc
        return cls.from_dict(data, source=str(path))

    @classmethod
    def queue_names_at(cls, path: str | Path) -> tuple[str, ...]:
        """The queues the catalog file at ``path`` knows (the four defaults, then declared
        ones); only the four when there is no file there (operations commands that run
        without a catalog).

        Raises:
            CatalogError: The file exists but is not a valid catalog.
        """
        return cls.load(path).queue_names() if Path(path).exists() else QUEUE_NAMES

    @classmethod
    def queue_registry_at(cls, path: str | Path) -> QueueRegistry:
        """The queue registry of the catalog file at ``path``; the built-in queues only when
        there is no file there.

        Raises:
            CatalogError: The file exists but is not a valid catalog.
        """
        return cls.load(path).queue_registry if Path(path).exists() else queues.BUILTIN_REGISTRY

    @classmethod
    def unknown_task_at(cls, path: str | Path, task: str) -> str | None:
        """Why ``task`` is not a task of the catalog file at ``path`` (a sentence naming the
        file), or None when it is, or when there is no file there to ask (operations commands
        that run without a catalog). Operators' commands use it so that a mistyped name in
        a pause or a cancel is refused instead of silently matching nothing.

        Raises:
            CatalogError: The file exists but is not a valid catalog.
        """
        if not Path(path).exists():
            return None
        tasks = cls.load(path).tasks
        if task in tasks:
            return None
        return f"no task {task!r} in the catalog {str(path)!r} (check the name: it would match nothing)"

    @classmethod
    def from_dict(cls, data: Any, *, source: str | None = None) -> Catalog:
        """Validate a parsed catalog document and build the :class:`Catalog`.

        Raises:
            CatalogError: The document does not match the format or names an unknown
                subscriber.
        """
        validator = jsonschema.Draft202012Validator(SCHEMA)
        problems = sorted(validator.iter_errors(data), key=lambda e: list(e.absolute_path))
        if problems:
            first = problems[0]
            pointer = _pointer(first.absolute_path)
            message = first.message
            if first.validator == "pattern" and first.validator_value == NAME_PATTERN:
                message = f"{first.instance!r} is not a valid name (1..200 letters, digits, _ . : -)"
            raise errors.CatalogError(message, path=source, pointer=pointer or None)
        tasks = {
            name: TaskSpec(
                name=name,
                queue=spec.get("queue", "default"),
                scope=spec.get("scope", "any"),
                timeout_seconds=spec.get("timeout_seconds"),
                schedule=spec.get("schedule"),
                description=spec.get("description"),
                priority=spec.get("priority"),
            )
            for name, spec in data["tasks"].items()
        }
        declared = {name: queues.Queue.from_dict(name, spec) for name, spec in data.get("queues", {}).items()}
        for name, task in tasks.items():
            if task.queue not in QUEUE_NAMES and task.queue not in declared:
                raise errors.CatalogError(
                    f"queue {task.queue!r} is neither one of {', '.join(QUEUE_NAMES)} nor declared "
                    "under 'queues'",
                    path=source,
                    pointer=f"tasks.{name}.queue",
                )
        events: dict[str, tuple[str, ...]] = {}
        for event, spec in data.get("events", {}).items():
            for index, subscriber in enumerate(spec["subscribers"]):
                if subscriber not in tasks:
                    raise errors.CatalogError(
                        f"subscriber {subscriber!r} is not a task in this catalog",
                        path=source,
                        pointer=f"events.{event}.subscribers[{index}]",
                    )
            events[event] = tuple(spec["subscribers"])
        for name, task in tasks.items():
            if (
                task.schedule is not None
                and "cron" in task.schedule
                and not _valid_cron(task.schedule["cron"])
            ):
                raise errors.CatalogError(
                    f"{task.schedule['cron']!r} is not a five-field cron expression",
                    path=source,
                    pointer=f"tasks.{name}.schedule.cron",
                )
            fans_out = task.schedule is not None and "tenants" in task.schedule
            if task.schedule is not None and task.scope == "tenant" and not fans_out:
                raise errors.CatalogError(
                    "a scheduled task runs without a tenant unless its schedule lists tenants "
                    '("tenants": {"table": ...} or {"query": ...}); its scope cannot be \'tenant\'',
                    path=source,
                    pointer=f"tasks.{name}.schedule",
                )
            if fans_out and task.scope == "platform":
                raise errors.CatalogError(
                    "a schedule fanned out to tenants dispatches with a tenant_id; "
                    "scope 'platform' forbids it",
                    path=source,
                    pointer=f"tasks.{name}.schedule.tenants",
                )
        return cls(tasks=tasks, events=events, source=source, queues=declared)

    @classmethod
    def build(
        cls,
        tasks: Iterable[TaskSpec],
        events: Mapping[str, Iterable[str]],
        queues: Iterable[QueueSpec] = (),
    ) -> Catalog:
        """Build a catalog from specs (the worker's registry uses this), validated."""
        document: dict[str, Any] = {
            "version": CATALOG_VERSION,
            "tasks": {t.name: t.to_dict() for t in tasks},
            "events": {e: {"subscribers": list(subs)} for e, subs in events.items()},
        }
        declared = {q.name: q.to_dict() for q in queues}
        if declared:
            document["queues"] = declared
        return cls.from_dict(document)

    # --- queries -------------------------------------------------------------------------
    def task(self, name: str) -> TaskSpec:
        """Return the spec of ``name``.

        Raises:
            UnknownTask: ``name`` is not in the catalog.
        """
        try:
            return self.tasks[name]
        except KeyError:
            where = f" ({self.source})" if self.source else ""
            raise errors.UnknownTask(name, f"not in the task catalog{where}") from None

    @functools.cached_property
    def queue_registry(self) -> QueueRegistry:
        """Every queue this catalog knows: the built-in ones, then the declared ones
        (:class:`sqla_outbox.queues.QueueRegistry`)."""
        return QueueRegistry(self.queues.values())

    def queue_names(self) -> tuple[str, ...]:
        """The four default queues, then the declared ones in catalog order."""
        return self.queue_registry.names

    def check_queue(self, queue: str, *, task: str) -> None:
        """Raise :class:`~sqla_outbox.errors.UnknownQueue` (naming ``task``) unless ``queue``
        is a default or declared queue."""
        if queue not in self.queue_registry:
            self.queue_registry.check(queue, task=task, where=f" ({self.source})" if self.source else "")

    def subscribers(self, event: str) -> tuple[str, ...]:
        """Return the subscriber tasks of ``event`` (possibly empty).

        Raises:
            UnknownEvent: ``event`` is not in the catalog.
        """
        try:
            return self.events[event]
        except KeyError:
            where = f" ({self.source})" if self.source else ""
            raise errors.UnknownEvent(event, f"not in the task catalog{where}") from None

    def to_dict(self) -> dict[str, Any]:
        """The catalog document, with tasks and events sorted by name (declared queues
        first, when there are any)."""
        queues = {name: self.queues[name].to_dict() for name in sorted(self.queues)}
        return {
            "version": CATALOG_VERSION,
            **({"queues": queues} if queues else {}),
            "tasks": {name: self.tasks[name].to_dict() for name in sorted(self.tasks)},
            "events": {name: {"subscribers": list(self.events[name])} for name in sorted(self.events)},
        }

    def to_json(self) -> str:
        """The catalog document as stable, diff-friendly JSON text (trailing newline)."""
        return json.dumps(self.to_dict(), indent=2, sort_keys=False) + "\n"


def _valid_cron(expression: str) -> bool:
    from croniter import croniter  # type: ignore[import-untyped]

    return len(expression.split()) == 5 and bool(croniter.is_valid(expression))


def _pointer(path: Iterable[Any]) -> str:
    out = ""
    for part in path:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else str(part)
    return out
