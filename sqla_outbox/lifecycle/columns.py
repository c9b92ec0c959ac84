"""One column list per table, for every statement that writes a row again after its creation.

An outbox row is written again when the relay must send a run a second time and the row
was purged (a deferral, a DLQ requeue); a trail row is written by every transition. When
a column is added to one of these tables (the run's priority was the first to be
forgotten: a deferred run whose row was purged came back at priority 3), it is added
here, with where its value comes from, and every such statement writes it.

* :data:`OUTBOX_COLUMNS`: the outbox row's columns and, for each, the ``task_runs``
  expression that gives its value when the row is written again from its run (``r`` is
  the run). The envelope has none (the run does not keep one): the statement must give it.
  :mod:`sqla_outbox.write` creates rows with the same columns
  (``tests/unit/test_lifecycle_rules.py`` checks it).
* :data:`TRAIL_COLUMNS`: the trail row's columns; :func:`trail_insert` writes all of them,
  NULL where the statement gives no value.

Both produce SQL text at import time; nothing here runs at dispatch or per message.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

OUTBOX_TABLES = ("outbox_messages", "platform_outbox_messages")
"""Tenant work and platform work; the same shape but for ``tenant_id``."""


@dataclasses.dataclass(frozen=True)
class OutboxColumn:
    """One column of an outbox row.

    Attributes:
        name: The column.
        from_run: SQL giving its value from the run ``r`` (``task_runs AS r``); None when
            the statement must give it.
        tenant_only: Only ``outbox_messages`` has it.
    """

    name: str
    from_run: str | None
    tenant_only: bool = False


OUTBOX_COLUMNS: tuple[OutboxColumn, ...] = (
    OutboxColumn("tenant_id", "r.tenant_id", tenant_only=True),
    OutboxColumn("run_id", "r.run_id"),
    OutboxColumn("queue", "r.queue"),
    OutboxColumn("envelope", None),
    OutboxColumn("available_at", "r.available_at"),
    OutboxColumn("priority", "r.priority"),
)
"""The columns a statement writes into an outbox row (``id``, ``created_at``, ``sent_at``,
``attempts``, ``parked_at`` and ``last_error`` start at their defaults)."""

TRAIL_COLUMNS: tuple[str, ...] = (
    "run_id",
    "status",
    "attempt",
    "receive_count",
    "worker_id",
    "error_type",
    "error_message",
    "traceback",
    "detail",
)
"""The columns of a trail row a statement writes (``id`` and ``at`` are defaults)."""


def outbox_columns(table: str) -> tuple[str, ...]:
    """The names of :data:`OUTBOX_COLUMNS` that ``table`` has, in order.

    Raises:
        ValueError: ``table`` is not an outbox table.
    """
    if table not in OUTBOX_TABLES:
        raise ValueError(f"not an outbox table: {table!r}")
    return tuple(c.name for c in OUTBOX_COLUMNS if table == "outbox_messages" or not c.tenant_only)


def outbox_from_run(table: str, *, where: str, **given: str) -> str:
    """``INSERT INTO <table> (<columns>) SELECT <values> FROM task_runs AS r WHERE <where>``.

    Args:
        table: An outbox table.
        where: The condition selecting the run(s) (e.g. ``r.run_id = :run_id``).
        given: SQL for the columns whose value does not come from the run as it is
            (``envelope`` always; ``available_at`` or ``priority`` to override).

    Raises:
        ValueError: A column has no value (neither given nor from the run), or a given
            name is not a column of ``table``.
    """
    names = outbox_columns(table)
    unknown = set(given) - set(names)
    if unknown:
        raise ValueError(f"not columns of {table}: {sorted(unknown)}")
    values = []
    for column in OUTBOX_COLUMNS:
        if column.name not in names:
            continue
        value = given.get(column.name, column.from_run)
        if value is None:
            raise ValueError(f"{table}.{column.name} needs a value: the run does not keep one")
        values.append(value)
    return (
        f"INSERT INTO {table} ({', '.join(names)})\n"
        f"SELECT {', '.join(values)}\nFROM task_runs AS r WHERE {where}"
    )


def trail_insert(values: Mapping[str, str], *, source: str | None = None) -> str:
    """An ``INSERT INTO task_run_trail`` of every :data:`TRAIL_COLUMNS` column.

    Args:
        values: SQL per column; ``run_id`` and ``status`` are required, others are NULL
            when not given.
        source: ``FROM ...`` clause text (without ``FROM``) for an ``INSERT ... SELECT``;
            None for ``INSERT ... VALUES``.

    Raises:
        ValueError: A required column is missing or a name is not a trail column.
    """
    unknown = set(values) - set(TRAIL_COLUMNS)
    if unknown:
        raise ValueError(f"not columns of task_run_trail: {sorted(unknown)}")
    for required in ("run_id", "status"):
        if required not in values:
            raise ValueError(f"a trail row needs {required}")
    expressions = ", ".join(values.get(c, "NULL") for c in TRAIL_COLUMNS)
    head = f"INSERT INTO task_run_trail ({', '.join(TRAIL_COLUMNS)})"
    if source is None:
        return f"{head}\nVALUES ({expressions})"
    return f"{head}\nSELECT {expressions}\nFROM {source}"
