"""Applying the ``Cancel`` and ``Reschedule`` objects of a flush: one statement per control.

The statements themselves, and how they serialise with the worker and the relay, are in
:mod:`sqla_outbox.lifecycle.controls`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sqlalchemy.engine import Connection

from sqla_outbox.controls import Cancel, Control, ControlOutcome, Reschedule, RunControlResult
from sqla_outbox.lifecycle import controls as statements
from sqla_outbox.types import FINISHED_STATUSES

__all__ = ["apply_controls", "cancel", "reschedule"]


def apply_controls(connection: Connection, controls: Sequence[Control], *, notify: bool = False) -> int:
    """Apply each control in order, one statement each; record their results on them.

    Args:
        connection: The flushing session's connection (or an operator's), inside a
            transaction: the controls take effect when it commits.
        controls: :class:`~sqla_outbox.controls.Cancel` / ``Reschedule`` objects.
        notify: With the PostgreSQL wake, a reschedule that moved a row also NOTIFYs the
            relay (delivered only on commit), so an earlier due time is seen at once.

    Returns:
        Outbox rows rescheduled (the caller wakes the relay after commit when > 0).

    When a statement fails, the controls recorded before it are forgotten again
    (:meth:`~sqla_outbox.controls.Control.forget`): the failure aborts the transaction that
    applied them.
    """
    moved_total = 0
    try:
        for control in controls:
            if isinstance(control, Cancel):
                control.record(cancel(connection, control))
            elif isinstance(control, Reschedule):
                results = reschedule(connection, control, notify=notify)
                moved_total += sum(r.outcome is ControlOutcome.RESCHEDULED for r in results)
                control.record(results)
    except BaseException:
        for control in controls:
            control.forget()
        raise
    return moved_total


def cancel(connection: Connection, control: Cancel) -> list[RunControlResult]:
    """Run one cancel statement (:func:`sqla_outbox.lifecycle.controls.cancel`); return what
    happened to each selected run."""
    detail: dict[str, Any] = {"cancelled_by": control.by}
    if control.reason:
        detail["reason"] = control.reason
    rows = statements.cancel(connection, control.selection, by=control.by, detail=detail)
    results = []
    for row in rows:
        if row.status == "running":
            outcome = ControlOutcome.STOP_REQUESTED
        elif row.status in FINISHED_STATUSES:
            outcome = ControlOutcome.FINISHED
        else:
            outcome = ControlOutcome.CANCELLED
        results.append(
            RunControlResult(
                run_id=row.run_id,
                task=row.task,
                tenant_id=row.tenant_id,
                outcome=outcome,
                previous_status=row.status,
                was_sent=outcome is ControlOutcome.CANCELLED and not row.unsent,
            )
        )
    return results


def reschedule(
    connection: Connection, control: Reschedule, *, notify: bool = False
) -> list[RunControlResult]:
    """Run one reschedule statement (:func:`sqla_outbox.lifecycle.controls.reschedule`);
    return what happened to each selected run."""
    rows = statements.reschedule(
        connection,
        control.selection,
        by=control.by,
        detail={"rescheduled_by": control.by},
        available_at=control.available_at,
        delay=control.delay,
        notify=notify,
    )
    results = []
    for row in rows:
        if row.available_at is not None:
            outcome = ControlOutcome.RESCHEDULED
        elif row.status in FINISHED_STATUSES:
            outcome = ControlOutcome.FINISHED
        else:
            outcome = ControlOutcome.ALREADY_SENT
        results.append(
            RunControlResult(
                run_id=row.run_id,
                task=row.task,
                tenant_id=row.tenant_id,
                outcome=outcome,
                previous_status=row.status,
                available_at=row.available_at,
            )
        )
    return results
