"""An operator's statements on a run: requeue a failed run, unpark or re-send its outbox row.

The guardrails (the run is locked and checked, no other unfinished run holds its
idempotency key, a DLQ body is verified) are the callers' (:mod:`sqla_outbox.ops.requeue`,
:mod:`sqla_outbox.ops.resend`); these statements are what they apply, in the caller's
transaction. Each act is recorded with :func:`record`: a trail row with the operator as
``worker_id`` (``operator:<user>@<host>`` or ``dashboard:<name>``).

Declared transition: ``failed → queued`` (:func:`run_to_queued`). A re-send leaves a
``queued`` run ``queued``.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from sqlalchemy import Text, bindparam, text
from sqlalchemy.dialects.postgresql import UUID
from sqlalchemy.engine import Connection

from sqla_outbox import charsets
from sqla_outbox.lifecycle import columns
from sqla_outbox.types import TRIGGER_PRIORITIES

MANUAL_PRIORITY = TRIGGER_PRIORITIES["manual"]
"""A requeued run goes out at this priority, or its own if that is higher (lower number)."""

_RUN_ID = bindparam("run_id", type_=UUID(as_uuid=True))

_RUN_TO_QUEUED = text(
    """
UPDATE task_runs
SET status = 'queued', finished_at = NULL, dead_lettered_at = NULL, lease_owner = NULL,
    lease_expires_at = NULL, available_at = clock_timestamp(), updated_at = clock_timestamp()
WHERE run_id = :run_id AND status = 'failed'
"""
).bindparams(_RUN_ID)
_RUN_TOUCHED = text(
    "UPDATE task_runs SET available_at = clock_timestamp(), updated_at = clock_timestamp() "
    "WHERE run_id = :run_id AND status = 'queued'"
).bindparams(_RUN_ID)
_RESET_ROW = {
    table: text(
        f"""
UPDATE {table} SET sent_at = NULL, parked_at = NULL, attempts = 0, available_at = clock_timestamp(),
    priority = LEAST(priority, {MANUAL_PRIORITY})
WHERE run_id = :run_id RETURNING id
"""
    ).bindparams(_RUN_ID)
    for table in columns.OUTBOX_TABLES
}
_RECREATE_ROW = {
    table: text(
        columns.outbox_from_run(
            table,
            where="r.run_id = :run_id",
            envelope="CAST(:envelope AS jsonb)",
            available_at="clock_timestamp()",
            priority=f"LEAST(r.priority, {MANUAL_PRIORITY})",
        )
    ).bindparams(_RUN_ID)
    for table in columns.OUTBOX_TABLES
}
_UNPARK_ROW = {
    table: text(
        f"""
UPDATE {table} SET parked_at = NULL, attempts = 0, available_at = clock_timestamp()
WHERE run_id = :run_id AND parked_at IS NOT NULL AND sent_at IS NULL
"""
    ).bindparams(_RUN_ID)
    for table in columns.OUTBOX_TABLES
}
_RESEND_ROW = {
    table: text(
        f"""
UPDATE {table} SET sent_at = NULL, parked_at = NULL, attempts = 0, available_at = clock_timestamp()
WHERE run_id = :run_id AND sent_at IS NOT NULL
"""
    ).bindparams(_RUN_ID)
    for table in columns.OUTBOX_TABLES
}
_TRAIL = text(
    columns.trail_insert(
        dict(
            run_id=":run_id",
            status="'queued'",
            attempt=":attempt",
            worker_id=":worker",
            detail="CAST(:detail AS jsonb)",
        )
    )
).bindparams(_RUN_ID, bindparam("detail", type_=Text))


def run_to_queued(connection: Connection, run_id: uuid.UUID) -> bool:
    """``failed → queued``: the run is due now, its finish and DLQ marks cleared
    (``attempts`` and ``last_error*`` stay as history). False when it was not ``failed``."""
    return bool(connection.execute(_RUN_TO_QUEUED, {"run_id": run_id}).rowcount)


def touch_queued(connection: Connection, run_id: uuid.UUID) -> None:
    """A ``queued`` run whose message is sent again: its ``available_at`` and ``updated_at``
    become now (``status`` flags it unreceived again only after the threshold)."""
    connection.execute(_RUN_TOUCHED, {"run_id": run_id})


def reset_row(connection: Connection, table: str, run_id: uuid.UUID) -> bool:
    """Make the run's outbox row pending and due now (sent, parked or not), at most at
    :data:`MANUAL_PRIORITY`, its send attempts reset. False when the row is gone (purged)."""
    return connection.execute(_RESET_ROW[table], {"run_id": run_id}).first() is not None


def recreate_row(connection: Connection, table: str, run_id: uuid.UUID, *, envelope: str) -> None:
    """Write the run's outbox row again after a purge, due now, from the run (queue,
    tenant, priority at most :data:`MANUAL_PRIORITY`) and ``envelope`` (JSON text, checked
    by the caller to be the run's)."""
    connection.execute(_RECREATE_ROW[table], {"run_id": run_id, "envelope": envelope})


def unpark_row(connection: Connection, table: str, run_id: uuid.UUID) -> None:
    """Put a parked row back: ``parked_at`` cleared, send attempts reset, due now."""
    connection.execute(_UNPARK_ROW[table], {"run_id": run_id})


def resend_row(connection: Connection, table: str, run_id: uuid.UUID) -> None:
    """Make a sent row pending again, due now (its message never reached a worker)."""
    connection.execute(_RESEND_ROW[table], {"run_id": run_id})


def record(
    connection: Connection, run_id: uuid.UUID, *, attempt: int | None, operator: str, detail: dict[str, Any]
) -> None:
    """The trail row of an operator's act on a run (status ``queued``).

    Args:
        attempt: The run's attempts so far (the act belongs to no attempt).
        operator: Who acted, stored as ``worker_id``.
        detail: JSON context; strings from untrusted sources (DLQ attributes) are made safe
            for ``jsonb`` (:func:`sqla_outbox.charsets.jsonb_safe`).
    """
    connection.execute(
        _TRAIL,
        {
            "run_id": run_id,
            "attempt": attempt,
            "worker": operator,
            "detail": json.dumps(charsets.jsonb_safe(detail)),
        },
    )
