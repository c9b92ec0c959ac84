"""The statements behind ``Cancel`` and ``Reschedule``: one per control, in the caller's transaction.

Declared transitions: ``queued → cancelled`` and ``retrying → cancelled``
(:func:`cancel_statement`); a running run only gets ``cancel_requested_at`` (its worker
ends it, :func:`sqla_outbox.lifecycle.attempts.mark_cancelled`).

Each statement locks the runs it selects (``FOR UPDATE`` on ``task_runs``), so it
serialises with the worker's transitions and the relay's claim:

* The relay claims outbox rows ``FOR UPDATE SKIP LOCKED`` and sets ``sent_at`` in the
  claiming transaction. A cancel that deletes a pending row first holds its lock, so the
  relay skips the row and, if the cancel commits, never sends it. A cancel that meets a
  row the relay is sending waits for the relay's commit; PostgreSQL then re-checks
  ``sent_at IS NULL`` on the new row version (READ COMMITTED), which fails: the row stays,
  the run still becomes ``cancelled``, and the worker that receives the message
  acknowledges it without calling the handler.
* Each affected run gets a trail row whose ``worker_id`` is the control's ``by`` (who or
  what asked, as operator actions record it) and whose ``detail`` says what happened. Its
  ``attempt`` is the running attempt for a stop request, else NULL: like a requeue, a
  cancel of a run that is not running belongs to no attempt.
* The worker's ``running → succeeded|retrying|failed|queued`` updates are guarded by
  ``cancel_requested_at IS NULL``: whichever of the cancel and the worker's transition
  commits first wins, and the other sees it.

Statements are built per shape of the selection (by run ids, by key, by filters) so each
uses an index (the primary key, the idempotency indexes, the task/tenant indexes); the
text is cached per shape.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import functools
import json
import uuid
from typing import Any, Protocol

from sqlalchemy import BigInteger, DateTime, Interval, Text, bindparam, text
from sqlalchemy.dialects.postgresql import ARRAY, UUID
from sqlalchemy.engine import Connection

from sqla_outbox.lifecycle import columns
from sqla_outbox.types import FINISHED_STATUSES, WAKE_CHANNEL


class RunSelection(Protocol):
    """Which runs a control applies to (:class:`sqla_outbox.controls.Selection` is one):
    by run ids; else by task, tenant, idempotency key (the unfinished run with it, else the
    newest finished one) and statuses."""

    @property
    def run_ids(self) -> tuple[uuid.UUID, ...]: ...

    @property
    def task(self) -> str | None: ...

    @property
    def tenant_id(self) -> int | None: ...

    @property
    def idempotency_key(self) -> str | None: ...

    @property
    def statuses(self) -> tuple[str, ...]: ...


_PENDING = "o.sent_at IS NULL AND o.parked_at IS NULL"
_CANCEL_TRAIL = columns.trail_insert(
    dict(
        run_id="t.run_id",
        status="CASE WHEN t.status = 'running' THEN 'running' ELSE 'cancelled' END",
        attempt="CASE WHEN t.status = 'running' THEN t.attempts END",
        worker_id=":by",
        detail="CAST(:detail AS jsonb) || jsonb_build_object('from', t.status, "
        "'cancel', CASE WHEN t.status = 'running' THEN 'requested' ELSE 'done' END, "
        "'unsent', EXISTS (SELECT 1 FROM gone WHERE gone.run_id = t.run_id))",
    ),
    source="target AS t WHERE t.status IN ('queued', 'retrying', 'running')",
)
_RESCHEDULE_TRAIL = columns.trail_insert(
    dict(
        run_id="t.run_id",
        status="t.status",
        worker_id=":by",
        detail="CAST(:detail AS jsonb) || jsonb_build_object('available_at', m.available_at)",
    ),
    source="target AS t JOIN moved AS m USING (run_id)",
)


def _where(selection: RunSelection) -> tuple[str, str]:
    """``(WHERE clause, ORDER/LIMIT tail)`` selecting the control's runs from ``task_runs r``."""
    if selection.run_ids:
        return "r.run_id = ANY(:run_ids)", ""
    parts = []
    if selection.task is not None:
        parts.append("r.task = :task")
    if selection.idempotency_key is not None:
        parts.append("r.idempotency_key = :key AND r.tenant_id IS NOT DISTINCT FROM :tenant_id")
        # the unfinished run with this key, else the newest finished one
        finished = ", ".join(f"'{s}'" for s in FINISHED_STATUSES)
        return " AND ".join(parts), f"ORDER BY (r.status IN ({finished})), r.created_at DESC LIMIT 1"
    if selection.tenant_id is not None:
        parts.append("r.tenant_id = :tenant_id")
    parts.append("r.status = ANY(:statuses)")
    return " AND ".join(parts), ""


def _target(selection: RunSelection) -> str:
    where, tail = _where(selection)
    return f"""
target AS (
    SELECT r.run_id, r.task, r.tenant_id, r.status, r.attempts FROM task_runs AS r
    WHERE {where} {tail}
    FOR UPDATE OF r
)"""


_BINDS = (
    bindparam("run_ids", type_=ARRAY(UUID(as_uuid=True))),
    bindparam("statuses", type_=ARRAY(Text)),
    bindparam("tenant_id", type_=BigInteger),
    bindparam("key", type_=Text),
    bindparam("task", type_=Text),
    bindparam("detail", type_=Text),
    bindparam("by", type_=Text),
)


def _bound(sql: str, *extra: Any) -> Any:
    """``text(sql)`` with the types of the parameters it uses."""
    return text(sql).bindparams(*(b for b in (*_BINDS, *extra) if f":{b.key}" in sql))


@functools.lru_cache(maxsize=16)
def cancel_statement(shape: tuple[bool, bool, bool, bool]) -> Any:
    selection = _shape_selection(shape)
    return _bound(
        f"""
WITH {_target(selection).strip()},
unsent AS (
    DELETE FROM outbox_messages AS o USING target AS t
    WHERE o.run_id = t.run_id AND t.status IN ('queued', 'retrying') AND {_PENDING}
    RETURNING o.run_id
),
unsent_platform AS (
    DELETE FROM platform_outbox_messages AS o USING target AS t
    WHERE o.run_id = t.run_id AND t.status IN ('queued', 'retrying') AND {_PENDING}
    RETURNING o.run_id
),
gone AS (SELECT run_id FROM unsent UNION ALL SELECT run_id FROM unsent_platform),
stopped AS (
    UPDATE task_runs AS r
    SET status = 'cancelled', finished_at = clock_timestamp(), updated_at = clock_timestamp(),
        cancel_requested_at = clock_timestamp(), lease_owner = NULL, lease_expires_at = NULL
    FROM target AS t WHERE r.run_id = t.run_id AND t.status IN ('queued', 'retrying')
    RETURNING r.run_id
),
asked AS (
    UPDATE task_runs AS r
    SET cancel_requested_at = COALESCE(r.cancel_requested_at, clock_timestamp()),
        updated_at = clock_timestamp()
    FROM target AS t WHERE r.run_id = t.run_id AND t.status = 'running'
    RETURNING r.run_id
),
trail AS (
    {_CANCEL_TRAIL}
)
SELECT t.run_id, t.task, t.tenant_id, t.status,
       EXISTS (SELECT 1 FROM gone WHERE gone.run_id = t.run_id) AS unsent
FROM target AS t
"""
    )


@functools.lru_cache(maxsize=32)
def reschedule_statement(shape: tuple[bool, bool, bool, bool], notify: bool) -> Any:
    selection = _shape_selection(shape)
    moves = []
    for name, table in (("moved_tenant", "outbox_messages"), ("moved_platform", "platform_outbox_messages")):
        moves.append(
            f"""
{name} AS (
    UPDATE {table} AS o
    SET available_at = COALESCE(CAST(:available_at AS timestamptz),
                                clock_timestamp() + CAST(:delay AS interval))
    FROM target AS t
    WHERE o.run_id = t.run_id AND t.status IN ('queued', 'retrying') AND {_PENDING}
    RETURNING o.run_id, o.available_at
)"""
        )
    wake = f",\nwake AS (SELECT pg_notify('{WAKE_CHANNEL}', '') FROM moved LIMIT 1)" if notify else ""
    join_wake = " LEFT JOIN wake ON true" if notify else ""
    return _bound(
        f"""
WITH {_target(selection).strip()},{",".join(moves)},
moved AS (SELECT * FROM moved_tenant UNION ALL SELECT * FROM moved_platform),
runs AS (
    UPDATE task_runs AS r SET available_at = m.available_at, updated_at = clock_timestamp()
    FROM moved AS m WHERE r.run_id = m.run_id
    RETURNING r.run_id
),
trail AS (
    {_RESCHEDULE_TRAIL}
){wake}
SELECT t.run_id, t.task, t.tenant_id, t.status, m.available_at
FROM target AS t LEFT JOIN moved AS m USING (run_id){join_wake}
""",
        bindparam("available_at", type_=DateTime(timezone=True)),
        bindparam("delay", type_=Interval),
    )


def _shape(selection: RunSelection) -> tuple[bool, bool, bool, bool]:
    return (
        bool(selection.run_ids),
        selection.task is not None,
        selection.tenant_id is not None,
        selection.idempotency_key is not None,
    )


@dataclasses.dataclass(frozen=True)
class _Shape:
    """A stand-in selection with the shape's fields present (values are bound later)."""

    run_ids: tuple[uuid.UUID, ...]
    task: str | None
    tenant_id: int | None
    idempotency_key: str | None
    statuses: tuple[str, ...] = ()


def _shape_selection(shape: tuple[bool, bool, bool, bool]) -> RunSelection:
    by_id, task, tenant, key = shape
    return _Shape(
        run_ids=(uuid.UUID(int=0),) if by_id else (),
        task="t" if task else None,
        tenant_id=0 if tenant else None,
        idempotency_key="k" if key else None,
    )


def _params(selection: RunSelection, by: str, detail: dict[str, Any]) -> dict[str, Any]:
    return {
        "run_ids": list(selection.run_ids),
        "statuses": list(selection.statuses),
        "tenant_id": selection.tenant_id,
        "key": selection.idempotency_key,
        "task": selection.task,
        "detail": json.dumps(detail),
        "by": by,
    }


def cancel(connection: Connection, selection: RunSelection, *, by: str, detail: dict[str, Any]) -> list[Any]:
    """Run one cancel statement on the runs ``selection`` names.

    Args:
        connection: Inside the caller's transaction (the flushing session's, or an operator's).
        selection: Which runs (:class:`RunSelection`; ``sqla_outbox.controls.Selection``).
        by: Who asked, recorded as the trail rows' ``worker_id``.
        detail: Extra JSON context for the trail rows.

    Returns:
        One row per selected run: ``run_id, task, tenant_id, status`` (the status it had)
        and ``unsent`` (its pending outbox row was deleted).
    """
    return list(connection.execute(cancel_statement(_shape(selection)), _params(selection, by, detail)))


def reschedule(
    connection: Connection,
    selection: RunSelection,
    *,
    by: str,
    detail: dict[str, Any],
    available_at: dt.datetime | None,
    delay: dt.timedelta | None,
    notify: bool = False,
) -> list[Any]:
    """Run one reschedule statement: the pending outbox rows of the selected ``queued`` or
    ``retrying`` runs become due at ``available_at`` (or now + ``delay``).

    Args:
        notify: With the PostgreSQL wake, NOTIFY the relay when a row moved (delivered
            only if the transaction commits).

    Returns:
        One row per selected run: ``run_id, task, tenant_id, status`` and ``available_at``
        (the new due time; NULL when no pending row moved).
    """
    params = _params(selection, by, detail)
    params.update(available_at=available_at, delay=delay)
    return list(connection.execute(reschedule_statement(_shape(selection), notify), params))
