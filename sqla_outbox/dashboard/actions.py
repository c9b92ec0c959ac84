"""The dashboard's action framework, and the actions that exist today (DLQ requeue, cancel,
pause and resume).

An **action** changes something: requeue dead-lettered runs and cancel runs today; pause
and resume a task or queue, reset a circuit breaker, release a throttled tenant when
those capabilities exist. Every action goes through the same steps, enforced by the
application (:mod:`sqla_outbox.dashboard.app`), never by the action itself:

1. actions are enabled (``SQLA_OUTBOX_DASHBOARD_ACTIONS``), else 403;
2. the operator is authenticated (an anonymous viewer never acts), else 401/403;
3. the form carries the session's CSRF token (:meth:`Auth.check_csrf`), else 403;
4. :meth:`Action.parse` turns the form into parameters, or refuses it
   (:class:`ActionInputError`, 400);
5. **confirmation**: ``POST /actions/<name>/preview`` runs :meth:`Action.preview` (a
   dry run that changes nothing) and shows what would happen with a Confirm button;
6. ``POST /actions/<name>`` with ``confirmed=yes`` runs :meth:`Action.perform` with the
   operator's identity, which the action records where the change is recorded (the run
   trail's ``worker_id`` is ``dashboard:<name>``); the application also logs one
   ``dashboard.action`` line (action, operator, summary).

Where actions appear: :attr:`Action.places` names the pages that offer it (``dlq``,
``run`` for a run page's buttons, ``runs`` for the filtered run list, ``controls`` for
the Controls page), and
:meth:`Action.applies_to_run` says whether a run page offers it for that run.
``docs/dashboard.md`` ("Adding a control") shows a new action end to end.
"""

from __future__ import annotations

import abc
import dataclasses
import re
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, ClassVar

from sqlalchemy.engine import Engine

from sqla_outbox import errors, flow
from sqla_outbox.config import OutboxSettings
from sqla_outbox.controls import ControlOutcome
from sqla_outbox.dashboard.auth import Identity
from sqla_outbox.ops import cancel, dlq, requeue, runs
from sqla_outbox.ops.durations import parse_duration
from sqla_outbox.ops.runs import RunRecord
from sqla_outbox.types import QUEUE_NAMES, UNFINISHED_STATUSES
from sqla_outbox.wakeup import Waker

PLACES = frozenset({"dlq", "run", "runs", "controls"})

Form = Mapping[str, Sequence[str]]
"""A submitted form: every field's values, in order (a field may repeat)."""


class ActionInputError(Exception):
    """The form does not describe a valid action (shown to the operator, 400).

    Attributes:
        field: The form field at fault, when one is.
    """

    def __init__(self, message: str, *, field: str | None = None) -> None:
        self.field = field
        super().__init__(message)


@dataclasses.dataclass(frozen=True)
class ActionContext:
    """What an action may use.

    Attributes:
        settings: The dashboard's settings. engine: Engine of the outbox database
            (read-write). identity: The authenticated operator (``identity.actor`` is
            what to record). sqs: Returns the shared boto3 SQS client (created on first
            use). waker: Returns the shared :class:`~sqla_outbox.wakeup.Waker`, or None
            without Valkey.
    """

    settings: OutboxSettings
    engine: Engine
    identity: Identity
    sqs: Callable[[], Any]
    waker: Callable[[], Waker | None]


@dataclasses.dataclass(frozen=True)
class Cell:
    """One table cell of a report: text, and optionally the run it links to."""

    text: str
    run_id: uuid.UUID | None = None


@dataclasses.dataclass
class ActionReport:
    """What a preview or a perform shows: a summary sentence and a table.

    Attributes:
        summary: One sentence (``would requeue 3, skip 1``).
        columns / rows: The table; untrusted text is escaped by the template.
        changed: How many things the action changed (0 for a preview).
        notes: Extra lines (missing queues, ...).
        pinned: A preview's selection, which its confirmation acts on instead of the
            submitted form (:class:`PinnedRuns`); None: the confirmation resubmits the form
            as it was.
    """

    summary: str
    columns: tuple[str, ...] = ()
    rows: Sequence[tuple[Cell, ...]] = dataclasses.field(default_factory=list)
    changed: int = 0
    notes: list[str] = dataclasses.field(default_factory=list)
    pinned: PinnedRuns | None = None


@dataclasses.dataclass(frozen=True)
class PinnedRuns:
    """The runs a preview selected, so that confirming acts on exactly those, never on what
    a filter matches by then.

    Attributes:
        run_ids: The runs, in the preview's order; empty: nothing to confirm.
        flags: Other form fields the action still needs (``include_unverified=yes``).
    """

    run_ids: tuple[uuid.UUID, ...]
    flags: Mapping[str, str] = dataclasses.field(default_factory=dict)

    @classmethod
    def of(cls, run_ids: Iterable[uuid.UUID | None], **flags: str) -> PinnedRuns:
        """The distinct non-None ``run_ids``; ``flags`` with an empty value are dropped."""
        ids = tuple(dict.fromkeys(r for r in run_ids if r is not None))
        return cls(ids, {k: v for k, v in flags.items() if v})

    def form_fields(self) -> dict[str, list[str]]:
        """The confirmation's fields: the ids in one comma-separated ``run_id`` field (a
        form's field count is capped by the parser, a field's length is not)."""
        return {"run_id": [",".join(str(r) for r in self.run_ids)], **{k: [v] for k, v in self.flags.items()}}


class Action(abc.ABC):
    """One thing an operator can do from the dashboard; subclass and register it.

    Class attributes:
        name: URL segment and registry key (``dlq-requeue``): lower-case words and dashes.
        title: Button and page title (``Requeue from the DLQ``).
        description: One sentence for the confirmation page and the Controls page.
        places: Pages that offer it: ``dlq``, ``run``, ``controls``.
        confirm_label: The confirmation button's text.
        form_template: A template (in ``sqla_outbox/dashboard/templates``) with the
            action's form for the Controls page; None for actions offered elsewhere.
        tenant_scoped: The action applies an operator's tenant restriction itself
            (``context.identity.tenants``: it changes nothing of another tenant); only
            such actions are offered to an operator restricted to tenants.
    """

    name: ClassVar[str]
    title: ClassVar[str]
    description: ClassVar[str] = ""
    places: ClassVar[frozenset[str]] = frozenset()
    confirm_label: ClassVar[str] = "Confirm"
    form_template: ClassVar[str | None] = None
    tenant_scoped: ClassVar[bool] = False

    def applies_to_run(self, run: RunRecord) -> bool:
        """Whether a run page offers this action for ``run`` (``run`` in :attr:`places`)."""
        return False

    def run_fields(self, run: RunRecord) -> dict[str, str]:
        """The form fields a run page's button submits for ``run``."""
        return {"run_id": str(run.run_id)}

    def moot_under(self, run: RunRecord, pauses: flow.Pauses) -> bool:
        """Whether the pauses in force already do what this action would for ``run`` (a
        run page then does not offer it)."""
        return False

    @abc.abstractmethod
    def parse(self, form: Form) -> Any:
        """The action's parameters from a submitted form.

        Raises:
            ActionInputError: The form is incomplete or invalid.
        """

    @abc.abstractmethod
    def preview(self, context: ActionContext, params: Any) -> ActionReport:
        """What :meth:`perform` would do, changing nothing (the confirmation step)."""

    @abc.abstractmethod
    def perform(self, context: ActionContext, params: Any) -> ActionReport:
        """Do it, recording ``context.identity.actor`` with the change."""


class ActionRegistry:
    """The actions an application offers, by name.

    Args:
        actions: Initial actions (:func:`default_actions` has today's).

    Raises:
        ValueError: Two actions share a name, or a name or place is invalid.
    """

    def __init__(self, actions: Iterable[Action] = ()) -> None:
        self._actions: dict[str, Action] = {}
        for action in actions:
            self.register(action)

    def register(self, action: Action) -> Action:
        if not re.fullmatch(r"[a-z][a-z0-9-]{0,62}", action.name):
            raise ValueError(f"action name {action.name!r}: use lower-case letters, digits and dashes")
        if action.name in self._actions:
            raise ValueError(f"an action named {action.name!r} is already registered")
        if not action.places <= PLACES:
            raise ValueError(f"action {action.name!r}: unknown places {sorted(action.places - PLACES)}")
        self._actions[action.name] = action
        return action

    def get(self, name: str) -> Action | None:
        return self._actions.get(name)

    def in_place(self, place: str) -> list[Action]:
        return [a for a in self._actions.values() if place in a.places]

    def for_run(self, run: RunRecord, pauses: flow.Pauses | None = None) -> list[Action]:
        """The actions a run page offers for ``run``: those that apply to it and that the
        pauses in force do not make moot (no "Pause…" for a task already paused)."""
        pauses = pauses or flow.Pauses()
        return [a for a in self.in_place("run") if a.applies_to_run(run) and not a.moot_under(run, pauses)]

    def __iter__(self) -> Any:
        return iter(self._actions.values())


# --- DLQ requeue -----------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class RequeueParams:
    """What to requeue: the CLI's ``dlq requeue`` filters (at least one, or ``everything``),
    matched on each run's own row; ``include_unverified``: also copies nothing vouches for
    (``--include-unverified``)."""

    filters: dlq.DeadLetterFilter
    everything: bool = False
    include_unverified: bool = False


def _values(form: Form, name: str) -> list[str]:
    return [part.strip() for value in form.get(name, ()) for part in str(value).split(",") if part.strip()]


class DlqRequeue(Action):
    """Requeue failed runs from the DLQs, through the outbox: :func:`sqla_outbox.ops.requeue.requeue`,
    the same code and guardrails as ``python -m sqla_outbox dlq requeue`` (only ``failed``
    runs; not while another unfinished run holds the idempotency key; never a message the
    worker refused unexecuted). The preview is its dry run."""

    name = "dlq-requeue"
    title = "Requeue from the DLQ"
    description = (
        "Put failed runs back to queued through the outbox, then delete their DLQ messages. "
        "Only failed runs are requeued; the rest are listed as skipped with the reason."
    )
    places = frozenset({"dlq", "run"})
    confirm_label = "Requeue"
    tenant_scoped = True  # the filters carry the operator's tenants (matched on each run's row)

    def __init__(self, queues: tuple[str, ...] = QUEUE_NAMES) -> None:
        self.queues = queues  # the four, plus the catalog's declared queues

    def applies_to_run(self, run: RunRecord) -> bool:
        return run.status == "failed"

    def parse(self, form: Form) -> RequeueParams:
        run_ids: set[uuid.UUID] = set()
        for value in _values(form, "run_id"):
            try:
                run_ids.add(uuid.UUID(value))
            except ValueError:
                raise ActionInputError(f"{value!r} is not a run id", field="run_id") from None
        queues = _values(form, "queue")
        for queue in queues:
            if queue not in self.queues:
                raise ActionInputError(
                    f"unknown queue {queue!r}; expected one of {', '.join(self.queues)}", field="queue"
                )
        tasks = _values(form, "task")
        if any(len(task) > 200 for task in tasks):
            raise ActionInputError("a task name is at most 200 characters", field="task")
        older = _values(form, "older_than")
        older_than = None
        if older:
            try:
                older_than = parse_duration(older[-1])
            except Exception:
                raise ActionInputError(
                    f"{older[-1]!r} is not a duration (examples: 90s, 10m, 2h, 7d)", field="older_than"
                ) from None
        everything = "yes" in _values(form, "all")
        include_unverified = "yes" in _values(form, "include_unverified")
        if not (run_ids or queues or tasks or older_than or everything):
            raise ActionInputError(
                "choose the runs: a run id, a queue, a task or an age, or tick 'every failed run'"
            )
        filters = dlq.DeadLetterFilter(
            tasks=tuple(tasks),
            queues=tuple(queues),
            older_than=older_than,
            run_ids=frozenset(run_ids),
            known=self.queues,
        )
        return RequeueParams(filters=filters, everything=everything, include_unverified=include_unverified)

    @staticmethod
    def _filters(context: ActionContext, params: RequeueParams) -> dlq.DeadLetterFilter:
        """The form's filters, narrowed to the operator's tenants when they are restricted."""
        if context.identity.tenants is None:
            return params.filters
        return dataclasses.replace(params.filters, tenant_ids=context.identity.tenants)

    def preview(self, context: ActionContext, params: RequeueParams) -> ActionReport:
        report = requeue.requeue(
            context.engine,
            context.sqs(),
            context.settings,
            self._filters(context, params),
            dry_run=True,
            include_unverified=params.include_unverified,
        )
        previewed = self._report(report)
        previewed.pinned = PinnedRuns.of(
            (x.run_id for x in report.items if x.action == "would-requeue"),
            include_unverified="yes" if params.include_unverified else "",
        )
        return previewed

    def perform(self, context: ActionContext, params: RequeueParams) -> ActionReport:
        report = requeue.requeue(
            context.engine,
            context.sqs(),
            context.settings,
            self._filters(context, params),
            dry_run=False,
            waker=context.waker(),
            operator=context.identity.actor,
            include_unverified=params.include_unverified,
        )
        return self._report(report)

    @staticmethod
    def _report(report: requeue.RequeueReport) -> ActionReport:
        verb = "would requeue" if report.dry_run else "requeued"
        summary = f"{verb} {report.requeued}, skipped {report.skipped}"
        if report.requeued and not report.dry_run:
            summary += " (relay woken)" if report.woke else " (the relay's sweep will send them)"
        if not report.items:
            summary = "no dead-lettered run matches"
        rows = []
        for item in report.items:
            copies = (
                f"{item.dlq_deleted}/{len(item.dlq_message_ids)} deleted" if item.dlq_message_ids else "-"
            )
            rows.append(
                (
                    Cell(str(item.run_id) if item.run_id else "-", item.run_id),
                    Cell(item.task or "-"),
                    Cell(item.queue or "-"),
                    Cell("-" if item.tenant_id is None else str(item.tenant_id)),
                    Cell(item.action),
                    Cell(item.outbox or "-"),
                    Cell(copies),
                    Cell(f"{item.reason}: {item.detail}" if item.reason else "-"),
                )
            )
        return ActionReport(
            summary=summary,
            columns=("run", "task", "queue", "tenant", "action", "outbox", "DLQ copies", "reason"),
            rows=rows,
            changed=0 if report.dry_run else report.requeued,
            notes=[
                f"missing DLQ {name} (run `python -m sqla_outbox provision`)"
                for name in report.missing_queues
            ]
            + ([report.not_received_note] if report.not_received_note else []),
        )


# --- cancel runs ------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class CancelParams:
    """Which runs to cancel: run ids, or a task and/or tenant filter narrowed by statuses."""

    run_ids: tuple[uuid.UUID, ...] = ()
    task: str | None = None
    tenant_id: int | None = None
    statuses: tuple[str, ...] = ()


class RunsCancel(Action):
    """Cancel runs: :func:`sqla_outbox.ops.cancel.cancel_runs`, the same statement as
    ``session.add(Cancel(...))`` and ``python -m sqla_outbox runs cancel``. The preview is
    its dry run (executed and rolled back); the trail records ``dashboard:<operator>``."""

    name = "runs-cancel"
    title = "Cancel"
    description = (
        "Queued and retrying runs never run (an unsent message is never sent); running runs are "
        "asked to stop and end cancelled; finished runs are left alone."
    )
    places = frozenset({"run", "runs"})
    confirm_label = "Cancel the runs"
    tenant_scoped = True  # a restricted operator cancels runs of their tenants only (_cancel)

    def __init__(self, tasks: frozenset[str] | None = None) -> None:
        self.tasks = tasks

    def applies_to_run(self, run: RunRecord) -> bool:
        return run.status in UNFINISHED_STATUSES

    def parse(self, form: Form) -> CancelParams:
        run_ids: list[uuid.UUID] = []
        for value in _values(form, "run_id"):
            try:
                run_ids.append(uuid.UUID(value))
            except ValueError:
                raise ActionInputError(f"{value!r} is not a run id", field="run_id") from None
        tasks = _values(form, "task")
        if len(tasks) > 1 or any(len(task) > 200 for task in tasks):
            raise ActionInputError("one task name of at most 200 characters", field="task")
        for task in tasks:
            _known_task(self.tasks, task, "task")
        tenant_id = None
        tenants = _values(form, "tenant")
        if tenants:
            try:
                tenant_id = int(tenants[-1], 10)
            except ValueError:
                raise ActionInputError(
                    f"tenant: {tenants[-1]!r} is not a tenant id (platform runs: filter by task)",
                    field="tenant",
                ) from None
        statuses = _values(form, "status")
        for status in statuses:
            if status not in UNFINISHED_STATUSES:
                raise ActionInputError(
                    f"status {status!r}: only unfinished runs "
                    f"({', '.join(UNFINISHED_STATUSES)}) can be cancelled",
                    field="status",
                )
        if run_ids and (tasks or tenant_id is not None):
            raise ActionInputError("choose runs by id, or by task and tenant, not both")
        if not (run_ids or tasks or tenant_id is not None):
            raise ActionInputError("choose the runs: a run id, a task or a tenant")
        return CancelParams(
            run_ids=tuple(run_ids),
            task=tasks[0] if tasks else None,
            tenant_id=tenant_id,
            statuses=tuple(statuses),
        )

    def preview(self, context: ActionContext, params: CancelParams) -> ActionReport:
        report = self._cancel(context, params, dry_run=True)
        previewed = self._report(report)
        acting = (ControlOutcome.CANCELLED, ControlOutcome.STOP_REQUESTED)
        previewed.pinned = PinnedRuns.of(r.run_id for r in report.results if r.outcome in acting)
        return previewed

    def perform(self, context: ActionContext, params: CancelParams) -> ActionReport:
        return self._report(self._cancel(context, params, dry_run=False))

    @staticmethod
    def _cancel(context: ActionContext, params: CancelParams, *, dry_run: bool) -> cancel.CancelReport:
        tenants = context.identity.tenants
        if tenants is not None:  # only their tenants' runs: by id (each checked) or by tenant
            if params.run_ids:
                with context.engine.connect() as connection:
                    found = runs.tenants_of(connection, params.run_ids)
                if any(found.get(r, None) not in tenants for r in params.run_ids):
                    raise ActionInputError("you may cancel runs of your tenants only")
            elif params.tenant_id not in tenants:
                raise ActionInputError(
                    f"choose one of your tenants ({', '.join(str(t) for t in sorted(tenants))})",
                    field="tenant",
                )
        try:
            return cancel.cancel_runs(
                context.engine,
                run_ids=params.run_ids,
                task=params.task,
                tenant_id=params.tenant_id,
                statuses=params.statuses or None,
                by=context.identity.actor,
                dry_run=dry_run,
            )
        except errors.InvalidControl as exc:
            raise ActionInputError(str(exc)) from None

    @staticmethod
    def _report(report: cancel.CancelReport) -> ActionReport:
        done, asked = report.count(ControlOutcome.CANCELLED), report.count(ControlOutcome.STOP_REQUESTED)
        verb = "would be" if report.dry_run else "were"
        summary = f"{done} run(s) {verb} cancelled, {asked} running run(s) {verb} asked to stop"
        left = len(report.results) - done - asked
        if left:
            summary += f"; {left} left alone (finished or not found)"
        if not report.results:
            summary = "no unfinished run matches"
        rows = [
            (
                Cell(str(r.run_id) if r.run_id else "-", r.run_id),
                Cell(r.task or "-"),
                Cell("-" if r.tenant_id is None else str(r.tenant_id)),
                Cell(r.previous_status or "-"),
                Cell(r.outcome.value),
                Cell(("yes" if r.was_sent else "no") if r.outcome is ControlOutcome.CANCELLED else "-"),
            )
            for r in report.results
        ]
        return ActionReport(
            summary=summary,
            columns=("run", "task", "tenant", "was", "outcome", "message sent"),
            rows=rows,
            changed=0 if report.dry_run else done + asked,
        )


# --- pause and resume ------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class FlowTarget:
    """What to pause or resume (one of task, tenant, queue), and why."""

    target: flow.Target
    reason: str | None = None

    def kwargs(self) -> dict[str, Any]:
        scope, value = self.target.scope, self.target.target
        if scope == "tenant":
            return {"tenant_id": int(value)}
        return {scope: value}


def _flow_target(form: Form) -> flow.Target:
    scope = (_values(form, "scope") or [""])[-1]
    value = (form.get("target") or [""])[-1].strip()
    if scope not in flow.SCOPES:
        raise ActionInputError("choose what to pause: a task, a tenant or a queue", field="scope")
    if not value:
        raise ActionInputError(f"name the {scope}", field="target")
    try:
        if scope == "tenant":
            try:
                return flow.target(tenant_id=int(value))
            except ValueError:
                raise ActionInputError(f"{value!r} is not a tenant id", field="target") from None
        if scope == "task":
            return flow.target(task=value)
        return flow.target(queue=value)
    except errors.InvalidFlowControl as exc:
        raise ActionInputError(str(exc), field="target") from None


_WAITING = {
    "task": "envelope->>'task' = :target",
    "tenant": "tenant_id = CAST(:target AS bigint)",
    "queue": "queue = :target",
}


def _pending(context: ActionContext, target: flow.Target) -> int:
    """Unsent outbox rows of the target (both tables; tenants have no platform rows)."""
    import sqlalchemy as sa

    where = f"sent_at IS NULL AND parked_at IS NULL AND {_WAITING[target.scope]}"
    with context.engine.connect() as conn:
        total = conn.execute(
            sa.text(f"SELECT count(*) FROM outbox_messages WHERE {where}"), {"target": target.target}
        )
        count = int(total.scalar_one())
        if target.scope != "tenant":
            platform = conn.execute(
                sa.text(f"SELECT count(*) FROM platform_outbox_messages WHERE {where}"),
                {"target": target.target},
            )
            count += int(platform.scalar_one())
    return count


class FlowPause(Action):
    """Pause a task, a tenant or a queue (:func:`sqla_outbox.flow.pause`, as ``python -m
    sqla_outbox pause``); the operator is recorded as ``paused_by``."""

    name = "flow-pause"
    title = "Pause"
    description = (
        "Keep a task's, a tenant's or a queue's runs pending in the outbox: no attempt is spent, "
        "messages already in SQS come back without running. Resume releases them at once."
    )
    places = frozenset({"controls", "run"})
    confirm_label = "Pause"
    form_template = "control_pause.html"

    def __init__(self, tasks: frozenset[str] | None = None, queues: tuple[str, ...] | None = None) -> None:
        self.tasks = tasks
        self.queues = queues

    def applies_to_run(self, run: RunRecord) -> bool:
        return run.status in ("queued", "retrying")

    def run_fields(self, run: RunRecord) -> dict[str, str]:
        return {"scope": "task", "target": run.task}

    def moot_under(self, run: RunRecord, pauses: flow.Pauses) -> bool:
        return run.task in pauses.tasks

    def parse(self, form: Form) -> FlowTarget:
        reason = (form.get("reason") or [""])[-1].strip()[:500] or None
        target = _flow_target(form)
        if target.scope == "task":
            _known_task(self.tasks, target.target, "target")
        if target.scope == "queue" and self.queues is not None and target.target not in self.queues:
            raise ActionInputError(f"no queue {target.target!r} (check the name)", field="target")
        return FlowTarget(target, reason)

    def preview(self, context: ActionContext, params: FlowTarget) -> ActionReport:
        return ActionReport(
            summary=f"would pause {params.target}; "
            f"{_pending(context, params.target)} pending run(s) would wait",
            columns=("scope", "target", "reason"),
            rows=[(Cell(params.target.scope), Cell(params.target.target), Cell(params.reason or "-"))],
        )

    def perform(self, context: ActionContext, params: FlowTarget) -> ActionReport:
        with context.engine.begin() as conn:
            new = flow.pause(conn, **params.kwargs(), by=context.identity.actor, reason=params.reason)
        return ActionReport(
            summary=f"paused {params.target}" if new else f"{params.target} was paused already",
            changed=1 if new else 0,
        )


class FlowResume(Action):
    """Resume a paused task, tenant or queue (:func:`sqla_outbox.flow.resume`): its held
    runs become due now and the relay is woken."""

    name = "flow-resume"
    title = "Resume"
    description = "Release a paused task's, tenant's or queue's runs at once."
    places = frozenset({"controls"})
    confirm_label = "Resume"
    form_template = "control_resume.html"

    def parse(self, form: Form) -> FlowTarget:
        return FlowTarget(_flow_target(form))

    def preview(self, context: ActionContext, params: FlowTarget) -> ActionReport:
        with context.engine.connect() as conn:
            paused = any(
                (p.scope, p.target) == (params.target.scope, params.target.target)
                for p in flow.list_pauses(conn)
            )
        state = "" if paused else " (it is not paused)"
        return ActionReport(
            summary=f"would resume {params.target}{state}; {_pending(context, params.target)} pending run(s)"
        )

    def perform(self, context: ActionContext, params: FlowTarget) -> ActionReport:
        with context.engine.begin() as conn:
            was_paused, released = flow.resume(conn, **params.kwargs())
        waker = context.waker()
        if waker is not None:
            waker.wake()
        verb = "resumed" if was_paused else "was not paused:"
        return ActionReport(
            summary=f"{verb} {params.target}; {released} held run(s) released (relay woken)",
            changed=1 if was_paused else 0,
        )


def default_actions(
    queues: tuple[str, ...] = QUEUE_NAMES, tasks: frozenset[str] | None = None
) -> ActionRegistry:
    """The actions that exist today: :class:`DlqRequeue` (on ``queues``), :class:`RunsCancel`,
    :class:`FlowPause`, :class:`FlowResume`. ``tasks``: the catalog's task names, so that a
    cancel or a pause naming another task is refused (None: no catalog, nothing checked)."""
    return ActionRegistry([DlqRequeue(queues), RunsCancel(tasks), FlowPause(tasks, queues), FlowResume()])


def _known_task(tasks: frozenset[str] | None, task: str, field: str) -> None:
    """Refuse a task the catalog does not know: it would match nothing, silently."""
    if tasks is not None and task not in tasks:
        raise ActionInputError(f"no task {task!r} in the catalog (check the name)", field=field)
