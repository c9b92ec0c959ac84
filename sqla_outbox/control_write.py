"""Applying the ``Cancel`` and ``Reschedule`` objects of a flush: one statement per control.

The statements themselves, and how they serialise with the worker and the relay, are in
:mod:`sqla_outbox.lifecycle.controls`.
"""

from __future__ import annotations

from collections.abc import Sequence

from sqlalchemy.engine import Connection

from sqla_outbox.controls import Cancel, Control, ControlOutcome, Reschedule
from sqla_outbox.lifecycle.controls import cancel, reschedule

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
