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

``queue`` is one of critical, default, bulk, maintenance (default ``default``). ``scope``
is ``tenant`` (a dispatch must carry ``tenant_id``), ``platform`` (it must not), or
``any`` (default). ``timeout_seconds`` is the per-attempt limit the worker applies
(optional; 0 means no limit). ``schedule`` declares a recurring platform run: ``{"cron": "<5 fields>"}`` or
``{"every_seconds": N}``. Names are 1..200 characters of letters, digits and ``_ . : -``.
The loader validates the file against a JSON Schema and then checks that every subscriber
is a known task; errors name the file and the JSON path of the bad entry.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, Literal

import jsonschema

from sqla_outbox import errors, types
from sqla_outbox.types import QUEUE_NAMES

CATALOG_VERSION = 1
NAME_PATTERN = rf"^{types.NAME_PATTERN}(?![\s\S])"
"""JSON Schema ``pattern`` of task and event names: the whole string (the lookahead, not
``$``, ends it, because Python's ``$`` also matches before a trailing newline)."""

Scope = Literal["tenant", "platform", "any"]

SCHEMA: dict[str, Any] = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "title": "sqla_outbox task catalog",
    "type": "object",
    "additionalProperties": False,
    "required": ["version", "tasks"],
    "properties": {
        "version": {"const": CATALOG_VERSION},
        "tasks": {
            "type": "object",
            "propertyNames": {"pattern": NAME_PATTERN},
            "additionalProperties": {
                "type": "object",
                "additionalProperties": False,
                "properties": {
                    "queue": {"enum": list(QUEUE_NAMES)},
                    "scope": {"enum": ["tenant", "platform", "any"]},
                    "timeout_seconds": {"type": "number", "minimum": 0},
                    "description": {"type": "string"},
                    "schedule": {
                        "type": "object",
                        "additionalProperties": False,
                        "minProperties": 1,
                        "maxProperties": 1,
                        "properties": {
                            "cron": {"type": "string", "minLength": 9},
                            "every_seconds": {"type": "number", "minimum": 1},
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
    """

    name: str
    queue: str = "default"
    scope: Scope = "any"
    timeout_seconds: float | None = None
    schedule: Mapping[str, Any] | None = None
    description: str | None = None

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"queue": self.queue, "scope": self.scope}
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
    """

    tasks: Mapping[str, TaskSpec]
    events: Mapping[str, tuple[str, ...]] = dataclasses.field(default_factory=dict)
    source: str | None = None

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
            )
            for name, spec in data["tasks"].items()
        }
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
            if task.schedule is not None and task.scope == "tenant":
                raise errors.CatalogError(
                    "a scheduled task runs without a tenant; its scope cannot be 'tenant'",
                    path=source,
                    pointer=f"tasks.{name}.schedule",
                )
        return cls(tasks=tasks, events=events, source=source)

    @classmethod
    def build(cls, tasks: Iterable[TaskSpec], events: Mapping[str, Iterable[str]]) -> Catalog:
        """Build a catalog from specs (the worker's registry uses this), validated."""
        document = {
            "version": CATALOG_VERSION,
            "tasks": {t.name: t.to_dict() for t in tasks},
            "events": {e: {"subscribers": list(subs)} for e, subs in events.items()},
        }
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
        """The catalog document, with tasks and events sorted by name."""
        return {
            "version": CATALOG_VERSION,
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
