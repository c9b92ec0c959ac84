"""``Dispatch`` and ``Publish``: work scheduled with ``session.add`` in your own transaction.

Both are mapped classes (``Session.add`` accepts mapped instances only), mapped to a
table that never exists. The listeners that :func:`sqla_outbox.install` attaches take
them out of the session during flush and write the real rows instead: one outbox row
(``outbox_messages`` with a tenant, ``platform_outbox_messages`` without) and one
``task_runs`` row per run, in one statement, in the flushing transaction. A session
without the listeners refuses them with :class:`~sqla_outbox.errors.NotInstalled`, and
paths that bypass flush events (``bulk_save_objects``) refuse them too, so work is never
silently dropped or half-written.

Checks happen as early as possible: the constructor checks everything that needs no
catalog (names, payload, delay, tenant); ``session.add`` checks the rest against the
installed catalog (task or event known, queue, tenant scope, message size).
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import uuid
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from sqlalchemy import Column, Integer, MetaData, Table, event
from sqlalchemy.orm import registry

from sqla_outbox import envelope as envelope_mod
from sqla_outbox import errors, tracing, webhook_fanout
from sqla_outbox.types import (
    DEFAULT_PRIORITY,
    PRIORITY_MAX,
    PRIORITY_MIN,
    JSONPayload,
    is_name,
    is_priority,
    is_queue_name,
)
from sqla_outbox.webhook_fanout import PreparedFanout

if TYPE_CHECKING:
    from sqla_outbox.catalog import Catalog, TaskSpec

_MAX_KEY_LENGTH = 512
_BIGINT = 2**63
_MISSING: Any = object()
_NO_DELAY = dt.timedelta(0)


@dataclasses.dataclass
class PreparedRun:
    """One run ready to be written: the row values computed at ``session.add``.

    Attributes:
        run_id: The run's UUID (generated, or given by the caller).
        task / queue / tenant_id / event / idempotency_key: Row values.
        delay: Seconds after ``clock_timestamp()`` when ``available_at`` is None.
        available_at: Absolute due time given by the caller, or None.
        envelope: The envelope document stored in the outbox ``envelope`` column.
        envelope_json: The same, encoded once (compact JSON, the SQS body's form).
        resolved_run_id: Set by the write: the run that will execute.
        deduplicated: Set by the write: True when an existing run was reused.
        priority: The outbox row's priority (1..10, lower first): the dispatch's, else
            the catalog's, else the trigger default (3 for an application dispatch).
    """

    run_id: uuid.UUID
    task: str
    queue: str
    tenant_id: int | None
    event: str | None
    idempotency_key: str | None
    delay: dt.timedelta
    available_at: dt.datetime | None
    envelope: dict[str, Any]
    envelope_json: str
    resolved_run_id: uuid.UUID | None = None
    deduplicated: bool = False
    priority: int = DEFAULT_PRIORITY


@dataclasses.dataclass
class PreparedGroup:
    """A group's row, ready to be written before its members (see :class:`Group`).

    Attributes:
        group_id: The group's UUID.
        member_run_ids: The members' run ids (their runs are prepared separately).
        completion: The completion run, prepared but written only by the database
            trigger when the last member finishes.
    """

    group_id: uuid.UUID
    member_run_ids: list[uuid.UUID]
    completion: PreparedRun


Prepared = PreparedRun | PreparedFanout | PreparedGroup
"""What ``session.add`` prepares and the flush writes: a run, a webhook event's fan-out, or
a group's row."""


class _Scheduled:
    """Shared validation and state of Dispatch and Publish."""

    _sqla_outbox_slot: Any
    _prepared: Sequence[Prepared] | None

    def _init_common(
        self,
        payload: Any,
        name_for_errors: str,
        tenant_id: int | None,
        delay: dt.timedelta | float | int | None,
        available_at: dt.datetime | None,
        idempotency_key: str | None,
        priority: int | None = None,
    ) -> None:
        if priority is not None and not is_priority(priority):
            raise errors.InvalidDispatch(
                name_for_errors,
                f"priority must be an integer within {PRIORITY_MIN}..{PRIORITY_MAX} (lower runs first), "
                f"got {priority!r}",
            )
        self.priority = priority
        self.payload_json = envelope_mod.encode_payload(name_for_errors, payload)
        self.payload: JSONPayload = payload
        if type(tenant_id) is not int and isinstance(tenant_id, int) and not isinstance(tenant_id, bool):
            tenant_id = int.__int__(tenant_id)  # an IntEnum's integer (orjson would write .value)
        if tenant_id is not None and (type(tenant_id) is not int or not -_BIGINT <= tenant_id < _BIGINT):
            raise errors.InvalidDispatch(
                name_for_errors, f"tenant_id must be an integer (bigint), got {tenant_id!r}"
            )
        self.tenant_id = tenant_id
        self.delay = _coerce_delay(name_for_errors, delay, available_at)
        self.available_at = _coerce_available_at(name_for_errors, available_at)
        if isinstance(idempotency_key, str):
            idempotency_key = _exact_str(idempotency_key)  # checked as stored, not by its own __len__
        if idempotency_key is not None and (
            not isinstance(idempotency_key, str) or not 0 < len(idempotency_key) <= _MAX_KEY_LENGTH
        ):
            raise errors.InvalidDispatch(
                name_for_errors,
                f"idempotency_key must be a non-empty string of at most {_MAX_KEY_LENGTH} characters",
            )
        if idempotency_key is not None and not envelope_mod.storable_text(idempotency_key):
            raise errors.InvalidDispatch(
                name_for_errors,
                "idempotency_key must not contain NUL characters or lone surrogates "
                "(PostgreSQL text cannot store them)",
            )
        self.idempotency_key = idempotency_key
        self.trace = tracing.current_carrier()
        self._prepared = None

    def _prepare_run(
        self,
        spec: TaskSpec,
        *,
        run_id: uuid.UUID,
        queue: str,
        event: str | None,
        max_message_bytes: int,
    ) -> PreparedRun:
        if spec.scope == "tenant" and self.tenant_id is None:
            raise errors.InvalidDispatch(
                spec.name, "the catalog gives this task scope 'tenant'; pass tenant_id"
            )
        if spec.scope == "platform" and self.tenant_id is not None:
            raise errors.InvalidDispatch(
                spec.name, "the catalog gives this task scope 'platform'; it takes no tenant_id"
            )
        document = envelope_mod.document(
            run_id=run_id,
            task=spec.name,
            queue=queue,
            tenant_id=self.tenant_id,
            payload_json=self.payload_json,
            event=event,
            idempotency_key=self.idempotency_key,
            trace=self.trace,
        )
        encoded = envelope_mod.encode_document(document)
        size = envelope_mod.run_message_size_bytes(encoded, spec.name, self.tenant_id)
        if size > max_message_bytes:
            raise errors.EnvelopeTooLarge(spec.name, size_bytes=size, limit_bytes=max_message_bytes)
        return PreparedRun(
            run_id=run_id,
            task=spec.name,
            queue=queue,
            tenant_id=self.tenant_id,
            event=event,
            idempotency_key=self.idempotency_key,
            delay=self.delay,
            available_at=self.available_at,
            envelope=document,
            envelope_json=encoded,
            priority=self.priority or spec.priority or DEFAULT_PRIORITY,
        )

    def prepare(self, catalog: Catalog, *, max_message_bytes: int) -> Sequence[Prepared]:
        raise NotImplementedError


class Dispatch(_Scheduled):
    """Schedule one run of ``task`` in the current transaction: ``session.add(Dispatch(...))``.

    Args:
        task: Task name from the catalog.
        payload: Plain JSON value (objects with string keys, arrays, strings, numbers,
            booleans, null); default ``{}``. See ``sqla_outbox.envelope`` for the rules.
        tenant_id: Tenant (bigint). Absent: the run goes to the platform outbox.
        queue: Override the catalog's queue for this run.
        delay: Run no earlier than this long after the row is written, measured on the
            database clock (``clock_timestamp()`` + delay); a ``timedelta`` or seconds.
            Any length; never SQS DelaySeconds.
        available_at: Absolute, timezone-aware due time (instead of ``delay``).
        idempotency_key: At most one unfinished run per task + tenant + key; a duplicate
            resolves quietly to the existing run (see :attr:`resolved_run_id`).
        run_id: Use this UUID instead of a random one (a duplicate run_id also resolves
            quietly to the existing run).
        priority: 1..10, lower first: when more rows are due than a relay pass sends,
            lower values of the same queue go first. Default: the catalog's ``priority``
            for the task, else 3 (docs/flow-control.md).

    Attributes:
        run_id: Assigned when the object is built.
        resolved_run_id: After flush, the run that will execute: ``run_id``, or the
            existing run an idempotency key or run_id resolved to. None before flush.
        deduplicated: After flush, True when this dispatch resolved to an existing run.

    Raises:
        InvalidDispatch: Bad name, tenant, delay, available_at, idempotency key or priority.
        PayloadNotSerializable: The payload is not plain JSON.
        UnknownQueue: ``queue`` is not a queue name (at construction), or neither one of
            critical, default, bulk, maintenance nor a queue the catalog declares (at
            ``session.add``).
    """

    _prepared: Sequence[PreparedRun] | None  # its one run, from ``session.add``

    def __init__(
        self,
        task: str,
        payload: JSONPayload = _MISSING,
        *,
        tenant_id: int | None = None,
        queue: str | None = None,
        delay: dt.timedelta | float | int | None = None,
        available_at: dt.datetime | None = None,
        idempotency_key: str | None = None,
        run_id: uuid.UUID | None = None,
        priority: int | None = None,
    ) -> None:
        if not isinstance(task, str):
            raise errors.InvalidDispatch(None, _not_a_name("Dispatch", "task", task))
        task = _exact_str(task)
        if not is_name(task):
            raise errors.InvalidDispatch(
                task, "task names are 1..200 characters of letters, digits and _ . : -"
            )
        self.task = task
        if isinstance(queue, str):
            queue = _exact_str(queue)
        if queue is not None and not is_queue_name(queue):
            raise errors.UnknownQueue(
                task, f"unknown queue {queue!r}: queue names are 1..40 letters, digits, '-' and '_'"
            )
        self.queue = queue
        if run_id is not None and not isinstance(run_id, uuid.UUID):
            raise errors.InvalidDispatch(task, f"run_id must be a uuid.UUID, got {run_id!r}")
        self.run_id: uuid.UUID = run_id or uuid.uuid4()
        self._explicit_run_id = run_id is not None
        self._init_common(
            {} if payload is _MISSING else payload,
            task,
            tenant_id,
            delay,
            available_at,
            idempotency_key,
            priority,
        )

    def prepare(self, catalog: Catalog, *, max_message_bytes: int) -> list[PreparedRun]:
        """Check against the catalog and compute the row values (called by ``session.add``).

        Raises:
            UnknownTask, UnknownQueue, InvalidDispatch, EnvelopeTooLarge.
        """
        spec = catalog.task(self.task)
        queue = self.queue or spec.queue
        catalog.check_queue(queue, task=self.task)
        return [
            self._prepare_run(
                spec,
                run_id=self.run_id,
                queue=queue,
                event=None,
                max_message_bytes=max_message_bytes,
            )
        ]

    @property
    def resolved_run_id(self) -> uuid.UUID | None:
        """After flush, the run that will execute (this dispatch's ``run_id``, or the existing
        run its idempotency key or run_id resolved to); None before."""
        prepared = self._prepared
        return prepared[0].resolved_run_id if prepared else None

    @property
    def deduplicated(self) -> bool:
        """After flush, True when this dispatch resolved to an existing run."""
        prepared = self._prepared
        return bool(prepared and prepared[0].deduplicated)

    def __repr__(self) -> str:
        return f"Dispatch({self.task!r}, run_id={self.run_id}, tenant_id={self.tenant_id})"


class Publish(_Scheduled):
    """Publish ``event``: one run per subscriber task, each with its own ``run_id``.

    Subscribers come from the catalog (``events.<name>.subscribers``). A known event with
    no subscribers writes nothing. Options mean what they mean for :class:`Dispatch` and
    apply to every subscriber's run (an idempotency key dedupes per subscriber task).

    A *webhook event* (the catalog lists ``webhooks.deliver`` among its subscribers) also
    schedules one delivery run per enabled endpoint of the tenant that subscribes to it,
    in the same statement (``docs/webhooks.md``); it needs a ``tenant_id``.

    Attributes:
        runs: After ``session.add``, ``{subscriber task: run_id}`` (webhook deliveries
            aside: their run ids exist only once the flush found the endpoints).
        resolved_run_ids: After flush, ``{subscriber task: run that will execute}``.
        webhook_deliveries: After flush, ``{endpoint id: delivery run id}`` for the
            deliveries the flush scheduled.

    Raises:
        InvalidDispatch, PayloadNotSerializable (at construction); UnknownEvent,
        InvalidDispatch, EnvelopeTooLarge (at ``session.add``).
    """

    def __init__(
        self,
        event: str,
        payload: JSONPayload = _MISSING,
        *,
        tenant_id: int | None = None,
        delay: dt.timedelta | float | int | None = None,
        available_at: dt.datetime | None = None,
        idempotency_key: str | None = None,
        priority: int | None = None,
    ) -> None:
        if not isinstance(event, str):
            raise errors.InvalidDispatch(None, _not_a_name("Publish", "event", event))
        event = _exact_str(event)
        if not is_name(event):
            raise errors.InvalidDispatch(
                event, "event names are 1..200 characters of letters, digits and _ . : -"
            )
        self.event = event
        self.runs: dict[str, uuid.UUID] = {}
        self._delivery_seed: uuid.UUID | None = None  # a webhook event's, from its first add
        self._init_common(
            {} if payload is _MISSING else payload,
            event,
            tenant_id,
            delay,
            available_at,
            idempotency_key,
            priority,
        )

    @property
    def resolved_run_ids(self) -> dict[str, uuid.UUID]:
        return {
            run.task: run.resolved_run_id
            for run in self._prepared or []
            if isinstance(run, PreparedRun) and run.resolved_run_id is not None
        }

    @property
    def webhook_deliveries(self) -> dict[int, uuid.UUID]:
        deliveries: dict[int, uuid.UUID] = {}
        for item in self._prepared or []:
            if isinstance(item, PreparedFanout):
                deliveries.update(item.run_ids)
        return deliveries

    def prepare(self, catalog: Catalog, *, max_message_bytes: int) -> list[Prepared]:
        """Check against the catalog and compute one run per subscriber (one fan-out for
        ``webhooks.deliver``).

        Raises:
            UnknownEvent, InvalidDispatch, EnvelopeTooLarge.
        """
        prepared: list[Prepared] = []
        for task in catalog.subscribers(self.event):
            spec = catalog.task(task)
            if task == webhook_fanout.WEBHOOK_TASK:
                if self._delivery_seed is None:
                    self._delivery_seed = uuid.uuid4()
                prepared.append(
                    webhook_fanout.prepare(
                        seed=self._delivery_seed,
                        event=self.event,
                        tenant_id=self.tenant_id,
                        queue=spec.queue,
                        payload_json=self.payload_json,
                        idempotency_key=self.idempotency_key,
                        delay=self.delay,
                        available_at=self.available_at,
                        trace=self.trace,
                        max_message_bytes=max_message_bytes,
                        priority=self.priority or spec.priority,
                    )
                )
                continue
            run_id = self.runs.get(task) or uuid.uuid4()
            prepared.append(
                self._prepare_run(
                    spec,
                    run_id=run_id,
                    queue=spec.queue,
                    event=self.event,
                    max_message_bytes=max_message_bytes,
                )
            )
        self.runs = {run.task: run.run_id for run in prepared if isinstance(run, PreparedRun)}
        return prepared

    def __repr__(self) -> str:
        return f"Publish({self.event!r}, tenant_id={self.tenant_id}, runs={len(self.runs)})"


class Group(_Scheduled):
    """Dispatch ``members`` together and run ``on_complete`` once, after the last one finished.

    ``session.add(Group([Dispatch("reserve_seat", ...), ...], on_complete=Dispatch(
    "confirm_booking", ...)))`` writes, in the current transaction, one ``task_groups`` row
    and one run per member (``task_runs.group_id`` set). The completion run is prepared now
    (checked against the catalog, its envelope built) but written only when the last
    member leaves the unfinished statuses (queued, running, retrying): succeeded, failed
    for good, or any other final status. A database trigger does it in the member's own
    finishing transaction, under a lock on the group row, so members finishing at the same
    moment on different workers write it exactly once, and a worker killed before its
    finishing transaction committed leaves it to the attempt that commits
    (``docs/groups.md``, ADR 0016).

    The completion handler reads the members' statuses (and results, where runs have
    them) with :func:`sqla_outbox.groups.outcome` (``ctx.group()`` in a handler).

    Args:
        members: One or more :class:`Dispatch` objects, without ``idempotency_key`` or
            ``run_id`` (a member must be a new run, counted once).
        on_complete: The completion :class:`Dispatch`; its ``tenant_id``, ``queue`` and
            ``delay`` apply (counted from the last member's finish); no
            ``available_at``, ``idempotency_key`` or ``run_id``.
        group_id: The group's UUID (default: random).

    Attributes:
        group_id: The group's UUID. completion_run_id: The completion run's id (the run
            exists once the group completed).

    Raises:
        InvalidDispatch: No members, a member or on_complete that is not a Dispatch, the
            same Dispatch twice, or one carrying a forbidden option (named in the message).
    """

    def __init__(
        self,
        members: Sequence[Dispatch],
        *,
        on_complete: Dispatch,
        group_id: uuid.UUID | None = None,
    ) -> None:
        members = list(members)
        name = on_complete.task if isinstance(on_complete, Dispatch) else "group"
        if not isinstance(on_complete, Dispatch):
            raise errors.InvalidDispatch(name, f"on_complete must be a Dispatch, got {on_complete!r}")
        if not members:
            raise errors.InvalidDispatch(name, "a group needs at least one member")
        for index, member in enumerate(members):
            if not isinstance(member, Dispatch):
                raise errors.InvalidDispatch(name, f"member {index} must be a Dispatch, got {member!r}")
            if member.idempotency_key is not None or member._explicit_run_id:
                raise errors.InvalidDispatch(
                    member.task,
                    f"group member {index} has an idempotency_key or run_id: a member must be a "
                    "new run (an existing run could already be finished and would be counted twice)",
                )
        run_ids = [member.run_id for member in members]
        if len(set(run_ids)) != len(run_ids) or on_complete.run_id in run_ids:
            raise errors.InvalidDispatch(
                name, "a Dispatch appears twice in the group (as two members, or as a member and on_complete)"
            )
        if on_complete.available_at is not None or on_complete.idempotency_key is not None:
            raise errors.InvalidDispatch(
                on_complete.task,
                "on_complete takes no available_at or idempotency_key (it runs once, when the "
                "last member finished; use delay to wait after that)",
            )
        if on_complete._explicit_run_id:
            raise errors.InvalidDispatch(on_complete.task, "on_complete takes no run_id")
        if group_id is not None and not isinstance(group_id, uuid.UUID):
            raise errors.InvalidDispatch(name, f"group_id must be a uuid.UUID, got {group_id!r}")
        self.group_id: uuid.UUID = group_id or uuid.uuid4()
        self.members = members
        self.on_complete = on_complete
        self.completion_run_id = on_complete.run_id
        self.trace = tracing.current_carrier()
        self._prepared = None

    def prepare(self, catalog: Catalog, *, max_message_bytes: int) -> list[Prepared]:
        """Check the members and the completion against the catalog; compute the rows.

        Raises:
            UnknownTask, InvalidDispatch, EnvelopeTooLarge.
        """
        (completion,) = self.on_complete.prepare(catalog, max_message_bytes=max_message_bytes)
        runs: list[Prepared] = []
        for member in self.members:
            member._prepared = member.prepare(catalog, max_message_bytes=max_message_bytes)
            runs.extend(member._prepared)
        group = PreparedGroup(
            group_id=self.group_id,
            member_run_ids=[member.run_id for member in self.members],
            completion=completion,
        )
        return [group, *runs]

    def __repr__(self) -> str:
        return f"Group({self.group_id}, members={len(self.members)}, on_complete={self.on_complete.task!r})"


# --------------------------------------------------------------------------------------
# mapping: Session.add accepts mapped instances only


def _refuse_insert(*_args: Any, **_kwargs: Any) -> Any:
    raise errors.NotInstalled(
        "a Dispatch or Publish reached the database without sqla_outbox listeners "
        "(a session without sqla_outbox.install(), or bulk_save_objects/bulk inserts, "
        "which bypass flush events); nothing was written"
    )


_pending_metadata = MetaData()
_registry = registry(metadata=_pending_metadata)


def map_never_inserted(cls: type, refuse: Any) -> None:
    """Map ``cls`` to a table that never exists, so ``Session.add`` accepts it; ``refuse``
    raises if an INSERT of it is ever attempted (a session without the listeners)."""
    table = Table(
        f"sqla_outbox_never_created_{cls.__name__.lower()}",
        _pending_metadata,
        Column("_sqla_outbox_slot", Integer, primary_key=True, default=refuse),
    )
    _registry.map_imperatively(cls, table)
    event.listen(cls, "before_insert", refuse)
    # SQLAlchemy's instrumented __init__ is named plain "__init__": a wrong keyword would
    # read "__init__() got an unexpected keyword argument" without saying whose.
    vars(cls)["__init__"].__qualname__ = f"{cls.__qualname__}.__init__"


for _cls in (Dispatch, Publish, Group):
    map_never_inserted(_cls, _refuse_insert)


def scheduled_types() -> tuple[type[_Scheduled], ...]:
    """The classes the listeners turn into rows."""
    return (Dispatch, Publish, Group)


# --------------------------------------------------------------------------------------


def _not_a_name(kind: str, what: str, value: object) -> str:
    """The message for a task or event name that is not a string at all."""
    shown = repr(value)
    if len(shown) > 80:
        shown = shown[:77] + "..."
    return f"{kind}() takes the {what} name (a str) first, got {type(value).__name__} {shown}"


def _exact_str(value: str) -> str:
    """``value`` as an exact ``str``: a subclass's or a ``str`` Enum member's characters (not
    its ``__str__``, and not the ``.value`` orjson would write), so the envelope, SQS and
    PostgreSQL all see the same text."""
    return value if type(value) is str else str.__str__(value)


def _coerce_delay(
    name: str,
    delay: dt.timedelta | float | int | None,
    available_at: dt.datetime | None,
) -> dt.timedelta:
    if delay is None:
        return _NO_DELAY
    if available_at is not None:
        raise errors.InvalidDispatch(name, "pass delay or available_at, not both")
    if isinstance(delay, bool) or not isinstance(delay, (dt.timedelta, int, float)):
        raise errors.InvalidDispatch(
            name, f"delay must be a timedelta or seconds, got {type(delay).__name__}"
        )
    if not isinstance(delay, dt.timedelta):
        if delay != delay or delay in (float("inf"), float("-inf")):
            raise errors.InvalidDispatch(name, f"delay must be finite, got {delay!r}")
        try:
            delay = dt.timedelta(seconds=delay)
        except OverflowError:
            raise errors.InvalidDispatch(name, f"delay {delay!r} s is too long") from None
    if delay < dt.timedelta(0):
        raise errors.InvalidDispatch(
            name, f"delay must not be negative, got {delay.total_seconds():g} s"
        )  # str() of a negative timedelta reads "-1 day, 23:59:55"
    try:
        dt.datetime.now(dt.UTC) + delay
    except OverflowError:
        raise errors.InvalidDispatch(name, f"delay {delay} puts available_at past year 9999") from None
    return delay


def _coerce_available_at(name: str, available_at: dt.datetime | None) -> dt.datetime | None:
    if available_at is None:
        return None
    if not isinstance(available_at, dt.datetime):
        raise errors.InvalidDispatch(
            name, f"available_at must be a datetime, got {type(available_at).__name__}"
        )
    if available_at.tzinfo is None or available_at.utcoffset() is None:
        raise errors.InvalidDispatch(name, "available_at is a naive datetime; pass a timezone-aware one")
    return available_at
