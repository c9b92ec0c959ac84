"""``python -m sqla_outbox runs cancel`` and the dashboard's cancel: cancel runs as an operator.

The same statement as ``session.add(Cancel(...))`` (:mod:`sqla_outbox.control_write`),
run in a transaction of its own: queued and retrying runs become ``cancelled`` (a pending
outbox row is deleted, so the message is never sent), running runs are asked to stop,
finished runs are left alone and reported. The trail row of each affected run records
who asked (``worker_id`` and ``detail.cancelled_by``: ``operator:<user>@<host>`` from the
CLI, ``dashboard:<operator>`` from the dashboard).

A dry run executes the very same statement and rolls it back, so it reports exactly
what a real run would have done at that moment (including which runs had already been
sent); it takes the same row locks for that instant.
"""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import Sequence

from sqlalchemy.engine import Engine

from sqla_outbox import control_write
from sqla_outbox.controls import Cancel, ControlOutcome, RunControlResult
from sqla_outbox.ops.requeue import operator_id


@dataclasses.dataclass(frozen=True)
class CancelReport:
    """What ``runs cancel`` did (or, with ``dry_run``, would do).

    Attributes:
        dry_run: True when nothing was changed.
        by: Who was recorded as cancelling.
        results: One :class:`~sqla_outbox.controls.RunControlResult` per selected run.
    """

    dry_run: bool
    by: str
    results: list[RunControlResult]

    def count(self, outcome: ControlOutcome) -> int:
        return sum(1 for r in self.results if r.outcome is outcome)


def cancel_runs(
    engine: Engine,
    *,
    run_ids: Sequence[uuid.UUID] = (),
    task: str | None = None,
    tenant_id: int | None = None,
    idempotency_key: str | None = None,
    statuses: Sequence[str] | None = None,
    by: str | None = None,
    reason: str | None = None,
    dry_run: bool = False,
) -> CancelReport:
    """Cancel the selected runs in one transaction (see :class:`~sqla_outbox.controls.Cancel`
    for the selectors; at least one is needed).

    Args:
        engine: Engine on the outbox database.
        by: Who cancels (default :func:`~sqla_outbox.ops.requeue.operator_id`).
        dry_run: Run the statement and roll it back.

    Raises:
        InvalidControl: No selector, conflicting selectors, a bad status.
    """
    who = by or operator_id()
    control = Cancel(
        list(run_ids) or None,
        task=task,
        tenant_id=tenant_id,
        idempotency_key=idempotency_key,
        statuses=statuses,
        by=who,
        reason=reason,
    )
    with engine.connect() as connection:
        transaction = connection.begin()
        try:
            results = control_write.cancel(connection, control)
        except BaseException:
            transaction.rollback()
            raise
        if dry_run:
            transaction.rollback()
        else:
            transaction.commit()
    control.record(results)
    return CancelReport(dry_run=dry_run, by=control.by, results=control.results)
