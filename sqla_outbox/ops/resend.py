"""``python -m sqla_outbox outbox unpark|resend``: send runs' outbox rows again, through the relay.

Two ways a run's message never reaches a worker, each with its command. Neither sends to
SQS itself: both make the run's outbox row pending again, and the relay sends it.

* **Parked rows** (``outbox unpark``). The relay parks a row SQS refuses for good (a
  message too large, characters SQS does not take, ``relay_max_send_attempts`` refusals)
  and fails its run with the SQS error (``sqla_outbox.relay.claim.park``). After the cause
  is fixed (a bigger ``MaximumMessageSize``, a corrected row, a KMS grant), unpark puts
  them back. Guarded, per run, in one transaction with the run row locked
  (``FOR UPDATE``): the row must be parked, its run ``failed`` (nothing else moved it),
  and no other unfinished run may hold the run's task + tenant + idempotency key (the
  partial unique indexes allow one; ``docs/dispatch.md``, ``idempotency_key``). Then: the row's
  ``parked_at`` is cleared, ``attempts`` reset, ``available_at`` now; the run goes back to
  ``queued`` (``finished_at`` cleared; ``attempts`` and ``last_error*`` kept as history);
  a trail row records it (detail ``{"unparked_by": "operator", "from": "failed"}``).

* **Unreceived runs** (``outbox resend``). SQS deletes a message its queue kept longer
  than ``MessageRetentionPeriod`` (``sqs_message_retention_seconds``, default 14 days)
  without telling anyone: a run whose workers were down that long stays ``queued`` with
  its row sent. :func:`unreceived` finds runs ``queued`` whose message has waited in SQS
  longer than a threshold (since the relay sent it, or since a worker returned it:
  ``GREATEST(sent_at, task_runs.updated_at)``); ``python -m sqla_outbox status`` flags
  them. Resend, guarded the same way (run still ``queued``, row still sent, still older
  than the threshold), makes the row pending again (``sent_at`` NULL, ``attempts`` 0,
  ``available_at`` now) and adds a trail row (``{"resent_by": "operator", "reason":
  "unreceived", "sent_at": ...}``). If the old message was only late, not gone, the worker
  runs the run once anyway: the second copy finds it finished (or leased) and is
  acknowledged (the consumer is idempotent by ``run_id``).

``--dry-run`` runs the same statements and rolls each transaction back. After the
commits, one wake (LPUSH) tells the relay; its sweep would find the rows anyway.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import logging
import uuid
from typing import Any

from sqlalchemy import Float, Integer, Text, bindparam, text
from sqlalchemy.dialects.postgresql import ARRAY, UUID
from sqlalchemy.engine import Connection, Engine

from sqla_outbox.lifecycle import operator as operator_changes
from sqla_outbox.lifecycle import rescue
from sqla_outbox.logging import log_extra
from sqla_outbox.ops import requeue
from sqla_outbox.ops.requeue import operator_id
from sqla_outbox.types import UNFINISHED_STATUSES
from sqla_outbox.wakeup import Waker

logger = logging.getLogger(__name__)

DEFAULT_UNRECEIVED_AFTER = dt.timedelta(days=1)
"""How long a message may wait in SQS before ``status`` flags its run as unreceived."""

UNPARKED = "unparked"
RESENT = "resent"
WOULD_UNPARK = "would-unpark"
WOULD_RESEND = "would-resend"
SKIPPED = "skipped"

_RUN_ID = bindparam("run_id", type_=UUID(as_uuid=True))

_OUTBOX = """
    SELECT 'outbox_messages' AS tbl, id, run_id, queue, sent_at, parked_at, last_error FROM outbox_messages
    UNION ALL
    SELECT 'platform_outbox_messages', id, run_id, queue, sent_at, parked_at, last_error
    FROM platform_outbox_messages
"""
_SELECT_FILTERS = """
  AND (CAST(:run_ids AS uuid[]) IS NULL OR r.run_id = ANY(CAST(:run_ids AS uuid[])))
  AND (CAST(:tasks AS text[]) IS NULL OR r.task = ANY(CAST(:tasks AS text[])))
  AND (CAST(:queues AS text[]) IS NULL OR r.queue = ANY(CAST(:queues AS text[])))
"""
_PARKED = text(
    f"""
SELECT r.run_id, r.task, r.queue, r.tenant_id, r.status, o.tbl, o.parked_at, o.last_error,
       r.last_error_type
FROM ({_OUTBOX}) AS o JOIN task_runs AS r ON r.run_id = o.run_id
WHERE o.parked_at IS NOT NULL {_SELECT_FILTERS}
ORDER BY o.parked_at, r.run_id
LIMIT :limit
"""
).bindparams(
    bindparam("run_ids", type_=ARRAY(UUID(as_uuid=True))),
    bindparam("tasks", type_=ARRAY(Text)),
    bindparam("queues", type_=ARRAY(Text)),
    bindparam("limit", type_=Integer),
)
_UNRECEIVED_WHERE = """
    r.status = 'queued' AND o.sent_at IS NOT NULL
    AND GREATEST(o.sent_at, r.updated_at) < clock_timestamp() - make_interval(secs => :older_than)
"""
_UNRECEIVED = text(
    f"""
SELECT r.run_id, r.task, r.queue, r.tenant_id, r.status, o.tbl, o.sent_at,
       EXTRACT(EPOCH FROM clock_timestamp() - GREATEST(o.sent_at, r.updated_at))::float8 AS waiting
FROM ({_OUTBOX}) AS o JOIN task_runs AS r ON r.run_id = o.run_id
WHERE {_UNRECEIVED_WHERE} {_SELECT_FILTERS}
ORDER BY GREATEST(o.sent_at, r.updated_at), r.run_id
LIMIT :limit
"""
).bindparams(
    bindparam("older_than", type_=Float),
    bindparam("run_ids", type_=ARRAY(UUID(as_uuid=True))),
    bindparam("tasks", type_=ARRAY(Text)),
    bindparam("queues", type_=ARRAY(Text)),
    bindparam("limit", type_=Integer),
)
_PARKED_COUNT = text(
    "SELECT (SELECT count(*) FROM outbox_messages WHERE parked_at IS NOT NULL) "
    "+ (SELECT count(*) FROM platform_outbox_messages WHERE parked_at IS NOT NULL)"
)
_UNRECEIVED_COUNT = text(
    f"""
SELECT count(*) FROM ({_OUTBOX}) AS o JOIN task_runs AS r ON r.run_id = o.run_id
WHERE {_UNRECEIVED_WHERE}
"""
).bindparams(bindparam("older_than", type_=Float))
_LOCK = text(
    f"""
SELECT r.run_id, r.task, r.queue, r.tenant_id, r.status, r.idempotency_key, r.attempts,
       r.updated_at, o.tbl, o.id, o.sent_at, o.parked_at,
       COALESCE(r.lease_expires_at > clock_timestamp(), false) AS lease_live
FROM task_runs AS r JOIN ({_OUTBOX}) AS o ON o.run_id = r.run_id
WHERE r.run_id = :run_id
FOR UPDATE OF r
"""
).bindparams(_RUN_ID)
_STILL_UNRECEIVED = text(
    f"""
SELECT 1 FROM task_runs AS r JOIN ({_OUTBOX}) AS o ON o.run_id = r.run_id
WHERE r.run_id = :run_id AND {_UNRECEIVED_WHERE}
"""
).bindparams(_RUN_ID, bindparam("older_than", type_=Float))


@dataclasses.dataclass(frozen=True)
class Selection:
    """Which runs a command acts on; every given filter must match (AND).

    Attributes:
        run_ids: Only these runs. tasks: Only these tasks. queues: Only these queues.
        limit: Most runs considered.
    """

    run_ids: tuple[uuid.UUID, ...] = ()
    tasks: tuple[str, ...] = ()
    queues: tuple[str, ...] = ()
    limit: int = 10_000

    def params(self) -> dict[str, Any]:
        return {
            "run_ids": list(self.run_ids) or None,
            "tasks": list(self.tasks) or None,
            "queues": list(self.queues) or None,
            "limit": self.limit,
        }


@dataclasses.dataclass(frozen=True)
class ParkedRun:
    """A run whose outbox row the relay parked.

    Attributes:
        run_id / task / queue / tenant_id / status: The run.
        table: Its outbox table. parked_at: When the relay parked it.
        last_error: ``<SQS code>: <message>`` of the refusal.
    """

    run_id: uuid.UUID
    task: str
    queue: str
    tenant_id: int | None
    status: str
    table: str
    parked_at: dt.datetime
    last_error: str | None


@dataclasses.dataclass(frozen=True)
class UnreceivedRun:
    """A ``queued`` run whose message has waited in SQS longer than the threshold.

    Attributes:
        run_id / task / queue / tenant_id: The run. table: Its outbox table.
        sent_at: When the relay sent it. waiting_seconds: How long it has been waiting
            (since the send, or since a worker returned it).
    """

    run_id: uuid.UUID
    task: str
    queue: str
    tenant_id: int | None
    table: str
    sent_at: dt.datetime
    waiting_seconds: float


@dataclasses.dataclass
class ResendItem:
    """What happened to one run.

    Attributes:
        run_id / task / queue / tenant_id: The run (None when unknown).
        action: ``unparked`` / ``resent`` (or ``would-unpark`` / ``would-resend`` in a dry
            run), or ``skipped``.
        reason: Why it was skipped: ``unknown-run``, ``not-parked``, ``not-failed``,
            ``not-queued``, ``not-sent``, ``too-recent``, ``idempotency-conflict``, and for a
            run named with ``--run-id``: ``finished``, ``leased``, ``changed``.
        detail: A sentence for humans.
    """

    run_id: uuid.UUID
    task: str | None = None
    queue: str | None = None
    tenant_id: int | None = None
    action: str = SKIPPED
    reason: str | None = None
    detail: str | None = None

    @property
    def selected(self) -> bool:
        return self.action != SKIPPED


@dataclasses.dataclass
class ResendReport:
    """Result of :func:`unpark` or :func:`resend_unreceived`.

    Attributes:
        dry_run: Nothing was changed. items: One per run, in the order found.
        woke: The wake after the commits went out.
    """

    dry_run: bool
    items: list[ResendItem] = dataclasses.field(default_factory=list)
    woke: bool = False

    @property
    def done(self) -> int:
        """Runs put back (or that would be, in a dry run)."""
        return sum(1 for item in self.items if item.selected)

    @property
    def skipped(self) -> int:
        return sum(1 for item in self.items if not item.selected)


def parked_runs(connection: Connection, selection: Selection = Selection()) -> list[ParkedRun]:
    """Runs whose outbox row is parked, oldest parked first."""
    return [
        ParkedRun(
            run_id=r.run_id,
            task=r.task,
            queue=r.queue,
            tenant_id=r.tenant_id,
            status=r.status,
            table=r.tbl,
            parked_at=r.parked_at,
            last_error=r.last_error,
        )
        for r in connection.execute(_PARKED, selection.params())
    ]


def unreceived(
    connection: Connection, *, older_than: dt.timedelta, selection: Selection = Selection()
) -> list[UnreceivedRun]:
    """``queued`` runs whose message has waited in SQS longer than ``older_than``, longest first."""
    return [
        UnreceivedRun(
            run_id=r.run_id,
            task=r.task,
            queue=r.queue,
            tenant_id=r.tenant_id,
            table=r.tbl,
            sent_at=r.sent_at,
            waiting_seconds=float(r.waiting),
        )
        for r in connection.execute(
            _UNRECEIVED, {"older_than": older_than.total_seconds(), **selection.params()}
        )
    ]


def parked_count(connection: Connection) -> int:
    """How many outbox rows are parked (both tables)."""
    return int(connection.execute(_PARKED_COUNT).scalar_one())


def unreceived_count(connection: Connection, *, older_than: dt.timedelta) -> int:
    """How many ``queued`` runs' messages have waited in SQS longer than ``older_than``."""
    return int(connection.execute(_UNRECEIVED_COUNT, {"older_than": older_than.total_seconds()}).scalar_one())


def unpark(
    engine: Engine, selection: Selection, *, dry_run: bool = False, waker: Waker | None = None
) -> ResendReport:
    """Put parked rows back to pending and their failed runs back to ``queued``.

    Args:
        engine: Engine of the outbox database; one transaction per run.
        selection: Which parked runs (``run_ids`` named but not parked are reported as
            skipped with the reason).
        dry_run: Decide and report; roll every transaction back.
        waker: Pushes one wake after the commits; None: rely on the relay's sweep.

    Returns:
        A :class:`ResendReport`.

    Raises:
        sqlalchemy.exc.DBAPIError: The database failed; runs committed before stay done.
    """
    with engine.connect() as connection:
        found = [run.run_id for run in parked_runs(connection, selection)]
    return _apply(engine, _wanted(found, selection), dry_run, waker, _unpark_one, {})


def resend_unreceived(
    engine: Engine,
    selection: Selection,
    *,
    older_than: dt.timedelta = DEFAULT_UNRECEIVED_AFTER,
    dry_run: bool = False,
    waker: Waker | None = None,
) -> ResendReport:
    """Make the sent rows of unreceived ``queued`` runs pending again (see the module docstring).

    A run named in ``selection.run_ids`` is sent again whatever its unfinished status and
    however recent its message (an operator who knows its message is gone, in a DLQ or
    lost): ``queued``, ``retrying``, or ``running`` with an expired lease; its outbox row
    pending and due now, a ``running`` run back to ``queued``
    (:func:`sqla_outbox.lifecycle.rescue.rescue`, reason ``operator``). A finished run, a
    run whose lease a worker holds, or one whose row is already pending is skipped.

    Args:
        engine: Engine of the outbox database; one transaction per run.
        selection: Which runs (named runs that do not qualify are reported as skipped).
        older_than: The message must have waited in SQS at least this long.
        dry_run: Decide and report; roll every transaction back.
        waker: Pushes one wake after the commits; None: rely on the relay's sweep.

    Returns:
        A :class:`ResendReport`.

    Raises:
        sqlalchemy.exc.DBAPIError: The database failed; runs committed before stay done.
    """
    with engine.connect() as connection:
        found = [run.run_id for run in unreceived(connection, older_than=older_than, selection=selection)]
    unreceived_runs = set(found)

    def one(connection: Connection, run_id: uuid.UUID, *, older_than: float) -> ResendItem:
        if run_id in unreceived_runs:
            return _resend_one(connection, run_id, older_than=older_than)
        return _send_named_again(connection, run_id)  # named with --run-id

    return _apply(
        engine, _wanted(found, selection), dry_run, waker, one, {"older_than": older_than.total_seconds()}
    )


def _wanted(found: list[uuid.UUID], selection: Selection) -> list[uuid.UUID]:
    """The runs found, then the runs named that were not found (to report why)."""
    return found + [run_id for run_id in selection.run_ids if run_id not in set(found)]


def _apply(
    engine: Engine,
    run_ids: list[uuid.UUID],
    dry_run: bool,
    waker: Waker | None,
    one: Any,
    options: dict[str, Any],
) -> ResendReport:
    report = ResendReport(dry_run=dry_run)
    for run_id in run_ids:
        with engine.connect() as connection:
            transaction = connection.begin()
            try:
                item = one(connection, run_id, **options)
            except BaseException:
                transaction.rollback()
                raise
            if dry_run or not item.selected:
                transaction.rollback()
                if item.selected:
                    item.action = WOULD_UNPARK if item.action == UNPARKED else WOULD_RESEND
            else:
                transaction.commit()
        report.items.append(item)
        logger.info(
            "outbox row put back" if item.action in (UNPARKED, RESENT) else "outbox row checked",
            extra=log_extra(
                action=f"ops.{item.action.replace('-', '_')}",
                run_id=str(run_id),
                task=item.task,
                reason=item.reason,
            ),
        )
    if not dry_run and waker is not None and any(item.selected for item in report.items):
        sent = waker.stats.sent
        waker.wake()
        waker.drain(2.0)
        report.woke = waker.stats.sent > sent
    return report


def _lock(connection: Connection, run_id: uuid.UUID) -> tuple[ResendItem, Any]:
    item = ResendItem(run_id=run_id)
    row = connection.execute(_LOCK, {"run_id": run_id}).one_or_none()
    if row is None:
        item.reason, item.detail = "unknown-run", "no run with an outbox row (never dispatched, or purged)"
        return item, None
    item.task, item.queue, item.tenant_id = row.task, row.queue, row.tenant_id
    return item, row


def _holder_conflict(connection: Connection, row: Any, item: ResendItem) -> bool:
    if row.idempotency_key is None:
        return False
    holder = connection.execute(
        requeue.HOLDER_OF_KEY,
        {"task": row.task, "key": row.idempotency_key, "tenant_id": row.tenant_id, "run_id": row.run_id},
    ).scalar()
    if holder is None:
        return False
    item.reason = "idempotency-conflict"
    item.detail = f"unfinished run {holder} holds the same task + tenant + idempotency key"
    return True


def _trail(connection: Connection, row: Any, detail: dict[str, Any]) -> None:
    operator_changes.record(
        connection, row.run_id, attempt=row.attempts, operator=operator_id(), detail=detail
    )


def _unpark_one(connection: Connection, run_id: uuid.UUID) -> ResendItem:
    item, row = _lock(connection, run_id)
    if row is None:
        return item
    if row.parked_at is None:
        item.reason, item.detail = "not-parked", "its outbox row is not parked"
        return item
    if row.status != "failed":
        item.reason, item.detail = "not-failed", f"run is {row.status}; only failed runs are unparked"
        return item
    if _holder_conflict(connection, row, item):
        return item
    operator_changes.unpark_row(connection, row.tbl, run_id)
    operator_changes.run_to_queued(connection, run_id)
    _trail(connection, row, {"unparked_by": "operator", "from": "failed"})
    item.action = UNPARKED
    return item


def _send_named_again(connection: Connection, run_id: uuid.UUID) -> ResendItem:
    """An operator named the run: send it again if it is unfinished and nobody holds it."""
    item, row = _lock(connection, run_id)
    if row is None:
        return item
    if row.status not in UNFINISHED_STATUSES:
        item.reason, item.detail = "finished", f"run is {row.status}; only unfinished runs are sent again"
        return item
    if row.sent_at is None:
        item.reason, item.detail = "not-sent", "its outbox row is pending: the relay sends it"
        return item
    if row.status == "running" and row.lease_live:
        item.reason, item.detail = "leased", "a worker holds its lease: it is running now"
        return item
    if not rescue.rescue(connection, [(run_id, "operator")], by=operator_id()):
        item.reason, item.detail = "changed", "the run changed while it was being sent again"
        return item
    item.action = RESENT
    return item


def _resend_one(connection: Connection, run_id: uuid.UUID, *, older_than: float) -> ResendItem:
    item, row = _lock(connection, run_id)
    if row is None:
        return item
    if row.status != "queued":
        item.reason, item.detail = "not-queued", f"run is {row.status}; only queued runs are resent"
        return item
    if row.sent_at is None:
        item.reason, item.detail = "not-sent", "its outbox row is pending: the relay sends it"
        return item
    if connection.execute(_STILL_UNRECEIVED, {"run_id": run_id, "older_than": older_than}).first() is None:
        item.reason, item.detail = "too-recent", f"its message has waited in SQS less than {older_than:g} s"
        return item
    operator_changes.resend_row(connection, row.tbl, run_id)
    operator_changes.touch_queued(connection, run_id)
    _trail(
        connection,
        row,
        {"resent_by": "operator", "reason": "unreceived", "sent_at": row.sent_at.isoformat()},
    )
    item.action = RESENT
    return item
