"""``Cancel`` and ``Reschedule``: control runs in your own transaction with ``session.add``.

Like :class:`~sqla_outbox.dispatch.Dispatch`, both are mapped classes that the listeners
:func:`sqla_outbox.install` attaches take out of the session during flush; instead of
being INSERTed, each becomes one statement (:mod:`sqla_outbox.control_write`) in the
flushing transaction. So a control takes effect only if that transaction commits: a
rolled-back cancel cancels nothing, and the relay and workers never see an uncommitted
one. A flush writes its dispatches first, then applies its controls in the order added.

What a cancel does to each run it selects (``docs/cancellation.md``):

* ``queued`` or ``retrying``: the run becomes ``cancelled`` and its pending outbox row is
  deleted in the same statement, so an unsent run never reaches SQS. A run whose message
  is already in SQS is acknowledged and skipped by the worker that receives it; the
  handler is not called.
* ``running``: ``cancel_requested_at`` is set; the worker executing it sees the request
  (its heartbeat polls for it), signals the attempt through ``ctx.cancel_event`` (the
  signal timeouts use), discards whatever the handler did in its session, and records the
  run ``cancelled``. A handler that finishes before it notices still ends ``cancelled``:
  its ``succeeded`` is guarded by ``cancel_requested_at IS NULL``.
* finished (``succeeded``, ``failed``, ``cancelled``): left alone; the outcome says so.

A reschedule moves the ``available_at`` of a run whose outbox row is still pending
(earlier or later); a run already sent, running or finished is left alone and the outcome
says so.

After the flush, :attr:`Control.results` holds one :class:`RunControlResult` per run the
control selected (:attr:`Control.outcome` for a control naming one run).
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import enum
import uuid
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from sqla_outbox import charsets, errors
from sqla_outbox.dispatch import map_never_inserted
from sqla_outbox.types import UNFINISHED_STATUSES, is_name

if TYPE_CHECKING:
    from sqla_outbox.catalog import Catalog

DEFAULT_BY = "application"
"""Who a control is recorded as coming from when the caller does not say."""

_MAX_TEXT = 200
_MAX_KEY_LENGTH = 512


class ControlOutcome(enum.StrEnum):
    """What a control did to one run."""

    CANCELLED = "cancelled"
    """The run was queued or retrying: it is ``cancelled`` now and its handler never runs."""
    STOP_REQUESTED = "stop_requested"
    """The run was running: its worker is asked to stop it; it ends ``cancelled``."""
    RESCHEDULED = "rescheduled"
    """Its pending outbox row (and the run) now have the new ``available_at``."""
    ALREADY_SENT = "already_sent"
    """Reschedule only: the run's message was already sent (or it runs): left alone."""
    FINISHED = "finished"
    """The run had finished (``previous_status`` says how): left alone."""
    NOT_FOUND = "not_found"
    """No run matched (never dispatched, purged, or another key)."""


@dataclasses.dataclass(frozen=True)
class RunControlResult:
    """One run a control selected, and what happened to it.

    Attributes:
        run_id: The run (None only for NOT_FOUND of a control naming no run id).
        task / tenant_id: The run's task and tenant (None for NOT_FOUND).
        outcome: See :class:`ControlOutcome`.
        previous_status: The run's status when the control locked it (None for NOT_FOUND).
        was_sent: Cancel only: the run's message had already been sent to SQS (the worker
            acknowledges and skips it).
        available_at: Reschedule only: the new due time (database clock), when moved.
        external_effects_possible: Derived from ``previous_status`` (below).
    """

    run_id: uuid.UUID | None
    task: str | None
    tenant_id: int | None
    outcome: ControlOutcome
    previous_status: str | None = None
    was_sent: bool = False
    available_at: dt.datetime | None = None

    external_effects_possible: bool = dataclasses.field(init=False, default=False)
    """Whether a handler of this run may already have acted outside the database (sent an
    e-mail, charged a card): the run was ``running`` (a cancel stops the attempt; what it did
    before it saw the request stays done) or ``retrying`` (an earlier attempt ran). A cancel
    rolls back only the work done through ``ctx.session`` (docs/cancellation.md, "What a
    cancel does not undo")."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "external_effects_possible", self.previous_status in ("running", "retrying"))


@dataclasses.dataclass(frozen=True)
class Selection:
    """Which runs a control applies to (see :class:`Cancel` for the meaning of each)."""

    run_ids: tuple[uuid.UUID, ...] = ()
    task: str | None = None
    tenant_id: int | None = None
    idempotency_key: str | None = None
    statuses: tuple[str, ...] = UNFINISHED_STATUSES

    @property
    def single(self) -> bool:
        """Names one run: by run id or by idempotency key."""
        return len(self.run_ids) == 1 or self.idempotency_key is not None


class Control:
    """Shared state of :class:`Cancel` and :class:`Reschedule`.

    Attributes:
        by: Who or what asked (recorded in the trail). reason: Free text, or None.
        results: After flush, one :class:`RunControlResult` per selected run; before, [].
        applied: True once a flush applied it.
    """

    _sqla_outbox_slot: Any
    kind = "Control"

    def _init_selection(
        self,
        run_id: uuid.UUID | Sequence[uuid.UUID] | None,
        task: str | None,
        tenant_id: int | None,
        idempotency_key: str | None,
        statuses: Sequence[str] | None,
        by: str,
        reason: str | None,
    ) -> None:
        kind = self.kind
        run_ids: tuple[uuid.UUID, ...] = ()
        if run_id is not None:
            run_ids = (run_id,) if isinstance(run_id, uuid.UUID) else tuple(run_id)
            if not run_ids or not all(isinstance(r, uuid.UUID) for r in run_ids):
                raise errors.InvalidControl(
                    kind, f"run_id must be a uuid.UUID or a non-empty list of them, got {run_id!r}"
                )
            if task is not None or tenant_id is not None or idempotency_key is not None:
                raise errors.InvalidControl(
                    kind, "pass run_id alone, or task/tenant_id/idempotency_key filters"
                )
        if task is not None and not is_name(task):
            raise errors.InvalidControl(kind, f"task {task!r} is not a task name")
        if tenant_id is not None and (isinstance(tenant_id, bool) or not isinstance(tenant_id, int)):
            raise errors.InvalidControl(kind, f"tenant_id must be an integer, got {tenant_id!r}")
        if idempotency_key is not None:
            if task is None:
                raise errors.InvalidControl(
                    kind, "idempotency_key needs task (keys are unique per task and tenant)"
                )
            if not isinstance(idempotency_key, str) or not 0 < len(idempotency_key) <= _MAX_KEY_LENGTH:
                raise errors.InvalidControl(kind, f"idempotency_key must be 1..{_MAX_KEY_LENGTH} characters")
        if not run_ids and task is None and tenant_id is None:
            raise errors.InvalidControl(
                kind, "name the runs: run_id, idempotency_key (with task), task or tenant_id"
            )
        chosen = tuple(UNFINISHED_STATUSES if statuses is None else statuses)
        unknown = [s for s in chosen if s not in UNFINISHED_STATUSES]
        if not chosen or unknown:
            raise errors.InvalidControl(
                kind, f"statuses must be among {', '.join(UNFINISHED_STATUSES)}, got {list(chosen)!r}"
            )
        if not isinstance(by, str) or not by.strip():
            raise errors.InvalidControl(kind, "by must be a non-empty string")
        self.selection = Selection(
            run_ids=run_ids,
            task=task,
            tenant_id=tenant_id,
            idempotency_key=idempotency_key,
            statuses=chosen,
        )
        self.by = charsets.for_postgres(by)[:_MAX_TEXT]
        if reason is not None and not isinstance(reason, str):
            raise errors.InvalidControl(kind, f"reason must be text, got {type(reason).__name__}")
        self.reason = None if reason is None else charsets.for_postgres(reason)[:_MAX_TEXT]
        self.results: list[RunControlResult] = []
        self.applied = False

    def check(self, catalog: Catalog) -> None:
        """At ``session.add``: a task filter must name a catalog task.

        Raises:
            UnknownTask: The catalog has no such task.
        """
        if self.selection.task is not None:
            catalog.task(self.selection.task)

    @property
    def outcome(self) -> ControlOutcome | None:
        """For a control naming one run (a run id or an idempotency key): what happened to
        it after flush; None before the flush or for filters."""
        if not self.applied or not self.selection.single:
            return None
        return self.results[0].outcome if self.results else ControlOutcome.NOT_FOUND

    def record(self, results: list[RunControlResult]) -> None:
        """Called by the write with the statement's outcome (NOT_FOUND rows added here)."""
        found = {r.run_id for r in results}
        missing = [r for r in self.selection.run_ids if r not in found]
        self.results = results + [
            RunControlResult(run_id=r, task=None, tenant_id=None, outcome=ControlOutcome.NOT_FOUND)
            for r in missing
        ]
        self.applied = True

    def forget(self) -> None:
        """Undo :meth:`record` when the flush that applied it failed (its statement's effect
        went with the failed transaction)."""
        self.results = []
        self.applied = False


class Cancel(Control):
    """Cancel runs when the current transaction commits: ``session.add(Cancel(run_id))``.

    Select runs by ``run_id`` (one UUID or a list), or by ``task`` +
    ``idempotency_key`` (+ ``tenant_id``; None means the platform run), or by filters
    (``task`` and/or ``tenant_id``, optionally narrowed by ``statuses``: every unfinished
    run matching them). See the module docstring for what happens to each run.

    Args:
        run_id: The run, or runs, to cancel.
        task: Task name (with a key, or as a filter). Checked against the catalog at add.
        tenant_id: With a key: the key's tenant (None: platform). As a filter: only this
            tenant's runs (None: any tenant).
        idempotency_key: The key the run was dispatched with; the unfinished run with it
            (or the newest finished one, reported FINISHED).
        statuses: Filters only: unfinished statuses to cancel (default all three:
            queued, running, retrying).
        by: Who or what cancels, recorded in the trail (``detail.cancelled_by``); at most
            200 characters. Default ``"application"``.
        reason: Free text recorded in the trail, at most 200 characters.

    Attributes:
        results / outcome / applied: See :class:`Control`.

    Raises:
        InvalidControl: No selector, conflicting selectors, a key without task, a bad
            status. UnknownTask (at ``session.add``): ``task`` is not in the catalog.
    """

    kind = "Cancel"

    def __init__(
        self,
        run_id: uuid.UUID | Sequence[uuid.UUID] | None = None,
        *,
        task: str | None = None,
        tenant_id: int | None = None,
        idempotency_key: str | None = None,
        statuses: Sequence[str] | None = None,
        by: str = DEFAULT_BY,
        reason: str | None = None,
    ) -> None:
        self._init_selection(run_id, task, tenant_id, idempotency_key, statuses, by, reason)

    def __repr__(self) -> str:
        return f"Cancel({self.selection}, by={self.by!r})"


class Reschedule(Control):
    """Move an unsent run's due time when the current transaction commits.

    ``session.add(Reschedule(run_id, available_at=...))`` (or ``delay=``, measured from
    the database clock at flush). Only a run whose outbox row is still pending (not yet
    sent, not parked) moves, earlier or later; the rest is reported ALREADY_SENT or
    FINISHED and left alone. Runs are selected as for :class:`Cancel`.

    Args:
        run_id / task / tenant_id / idempotency_key: As for :class:`Cancel`.
        available_at: The new due time, timezone-aware.
        delay: Instead of ``available_at``: a ``timedelta`` or seconds (>= 0) after the
            database's ``clock_timestamp()`` at flush.
        by: Who or what reschedules, recorded in the trail.

    Raises:
        InvalidControl: As for Cancel; neither or both of ``available_at``/``delay``, a
            naive datetime, a negative or non-finite delay.
    """

    kind = "Reschedule"

    def __init__(
        self,
        run_id: uuid.UUID | Sequence[uuid.UUID] | None = None,
        *,
        available_at: dt.datetime | None = None,
        delay: dt.timedelta | float | int | None = None,
        task: str | None = None,
        tenant_id: int | None = None,
        idempotency_key: str | None = None,
        by: str = DEFAULT_BY,
    ) -> None:
        self._init_selection(run_id, task, tenant_id, idempotency_key, ("queued", "retrying"), by, None)
        if (available_at is None) == (delay is None):
            raise errors.InvalidControl("Reschedule", "pass available_at or delay (one of them)")
        if available_at is not None and (
            not isinstance(available_at, dt.datetime) or available_at.utcoffset() is None
        ):
            raise errors.InvalidControl("Reschedule", "available_at must be a timezone-aware datetime")
        if delay is not None:
            if isinstance(delay, bool) or not isinstance(delay, (dt.timedelta, int, float)):
                raise errors.InvalidControl(
                    "Reschedule", f"delay must be a timedelta or seconds, got {delay!r}"
                )
            if not isinstance(delay, dt.timedelta):
                if delay != delay or delay in (float("inf"), float("-inf")):
                    raise errors.InvalidControl("Reschedule", f"delay must be finite, got {delay!r}")
                delay = dt.timedelta(seconds=delay)
            if delay < dt.timedelta(0):
                raise errors.InvalidControl(
                    "Reschedule", f"delay must not be negative, got {delay.total_seconds():g} s"
                )
        self.available_at = available_at
        self.delay = delay

    def __repr__(self) -> str:
        return f"Reschedule({self.selection}, available_at={self.available_at}, delay={self.delay})"


# --------------------------------------------------------------------------------------
# mapping: Session.add accepts mapped instances only


def _refuse_insert(*_args: Any, **_kwargs: Any) -> Any:
    raise errors.NotInstalled(
        "a Cancel or Reschedule reached the database without sqla_outbox listeners "
        "(a session without sqla_outbox.install(), or bulk_save_objects); nothing was changed"
    )


for _cls in (Cancel, Reschedule):
    map_never_inserted(_cls, _refuse_insert)
