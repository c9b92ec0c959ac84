"""``python -m sqla_outbox dlq requeue``: give failed runs another go, through the outbox.

A requeue never sends to SQS itself. For each selected run, in **one transaction**:

1. lock the ``task_runs`` row (``FOR UPDATE``) and check the guardrails:

   * the run exists and its status is ``failed`` (a ``queued``/``running``/``retrying``
     run is still being worked on, and a ``succeeded`` one is done: both are skipped);
   * no *other* unfinished run holds the same task + tenant + idempotency key (the
     partial unique indexes ``task_runs_idempotency_*_key`` allow one; SPEC "Application
     API"). A newer dispatch with that key won; the old run is skipped. The check is
     repeated by the index itself: a concurrent dispatch that slips in is caught as a
     unique violation and reported the same way;

2. set the run back to ``queued``: ``finished_at``, ``dead_lettered_at`` and the lease
   are cleared, ``available_at`` is now; ``attempts`` and ``last_error*`` are kept, so the
   history still counts the earlier attempts;
3. make its outbox row pending again (``sent_at`` NULL, ``attempts`` 0, ``available_at``
   now). If ``maintenance.purge`` already deleted the row (sent rows go after 7 days,
   failed runs stay 30), it is recreated from the DLQ message body, which is the
   envelope; the body is decoded as untrusted input and must name the same run, task,
   tenant and queue. ``run_id`` is UNIQUE in the outbox tables, so a run has one row;
4. add a trail row: status ``queued``, detail ``{"requeued_by": "operator", "from":
   "failed", "source": "dlq"|"database", "outbox": "reset"|"recreated", ...}``.

With the PostgreSQL wake (``settings.wake_notify``) the transaction also ``NOTIFY``s the
relay, which PostgreSQL delivers when it commits. Then, after the commits of a batch: one
Valkey wake (LPUSH, :class:`sqla_outbox.wakeup.Waker`, when that wake is in force), so the
relay sends the rows at once (its sweep would find them anyway), and only then the
DLQ messages of the requeued runs are deleted. If the process dies between the commit
and the delete, the DLQ message stays; requeueing it again is refused (the run is not
``failed`` any more), so nothing runs twice because of it.

Messages the worker refused without executing them (``bad-signature``,
``malformed-envelope:*``, ``unknown-run``, ``envelope-mismatch``) are never requeued: they
are not the run's own message and may be forged; the run they name, if it failed, has its
own DLQ message. Messages without a ``run_id`` are skipped too (``not-a-run``).

``--run-id`` also reaches failed runs whose DLQ message is gone (expired, deleted by
hand): when no DLQ message is found for a requested run, it is requeued from the
database alone, which needs its outbox row (there is no other copy of the payload).

``--dry-run`` runs exactly the same statements and rolls each transaction back, so it
reports what the guardrails would decide (including the unique index); it wakes nothing
and deletes nothing, and every DLQ message becomes visible again.
"""

from __future__ import annotations

import dataclasses
import getpass
import json
import logging
import socket
import uuid
from typing import Any

from sqlalchemy import Text, bindparam, text
from sqlalchemy.dialects.postgresql import ARRAY, UUID
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.exc import IntegrityError

from sqla_outbox import charsets, envelope
from sqla_outbox.config import OutboxSettings
from sqla_outbox.logging import log_extra
from sqla_outbox.ops.dlq import DeadLetter, DeadLetterFilter, DeadLetterScan, Received
from sqla_outbox.sqs.client import QueueDirectory, is_missing_queue
from sqla_outbox.types import UNFINISHED_STATUSES, WAKE_CHANNEL
from sqla_outbox.wakeup import Waker

logger = logging.getLogger(__name__)

REQUEUE_VISIBILITY_SECONDS = 120
"""How long the scan hides each DLQ message while its batch is requeued."""

REQUEUED = "requeued"
WOULD_REQUEUE = "would-requeue"
SKIPPED = "skipped"

# skip reasons
NOT_A_RUN = "not-a-run"
UNKNOWN_RUN = "unknown-run"
NOT_FAILED = "not-failed"
IDEMPOTENCY_CONFLICT = "idempotency-conflict"
NO_ENVELOPE = "no-envelope"
FILTERED_OUT = "filtered-out"
DATABASE_REFUSED = "database-refused"
FOREIGN_MESSAGE = "foreign-message"

FOREIGN_REASONS = frozenset({"bad-signature", "unknown-run", "envelope-mismatch"})
"""DLQ reasons of messages the worker refused without executing them
(:func:`sqla_outbox.worker.handle._dead_letter_foreign`), plus every
``malformed-envelope:*``. Such a message is not the run's own message (it may be forged),
so it is never requeued, even when it names a real failed run."""


def is_foreign(letter: DeadLetter) -> bool:
    """True for a DLQ message the worker refused unexecuted (see :data:`FOREIGN_REASONS`)."""
    return letter.reason in FOREIGN_REASONS or letter.reason.startswith("malformed-envelope")


_UNFINISHED = ", ".join(f"'{s}'" for s in UNFINISHED_STATUSES)
_RUN_ID = bindparam("run_id", type_=UUID(as_uuid=True))

_LOCK_RUN = text(
    """
SELECT run_id, task, queue, tenant_id, status, idempotency_key, attempts,
       EXTRACT(EPOCH FROM clock_timestamp() - finished_at)::float8 AS finished_age
FROM task_runs WHERE run_id = :run_id FOR UPDATE
"""
).bindparams(_RUN_ID)
_HOLDER = text(
    f"""
SELECT run_id FROM task_runs
WHERE task = :task AND idempotency_key = :key AND tenant_id IS NOT DISTINCT FROM :tenant_id
  AND status IN ({_UNFINISHED}) AND run_id <> :run_id
LIMIT 1
"""
).bindparams(_RUN_ID)
_RUN_TO_QUEUED = text(
    """
UPDATE task_runs
SET status = 'queued', finished_at = NULL, dead_lettered_at = NULL, lease_owner = NULL,
    lease_expires_at = NULL, available_at = clock_timestamp(), updated_at = clock_timestamp()
WHERE run_id = :run_id AND status = 'failed'
"""
).bindparams(_RUN_ID)
_RESET_OUTBOX = {
    table: text(
        f"""
UPDATE {table} SET sent_at = NULL, parked_at = NULL, attempts = 0, available_at = clock_timestamp()
WHERE run_id = :run_id RETURNING id
"""
    ).bindparams(_RUN_ID)
    for table in ("outbox_messages", "platform_outbox_messages")
}
_RECREATE_OUTBOX = {
    "outbox_messages": text(
        """
INSERT INTO outbox_messages (tenant_id, run_id, queue, envelope, available_at)
VALUES (:tenant_id, :run_id, :queue, CAST(:envelope AS jsonb), clock_timestamp())
"""
    ).bindparams(_RUN_ID),
    "platform_outbox_messages": text(
        """
INSERT INTO platform_outbox_messages (run_id, queue, envelope, available_at)
VALUES (:run_id, :queue, CAST(:envelope AS jsonb), clock_timestamp())
"""
    ).bindparams(_RUN_ID),
}
_TRAIL = text(
    """
INSERT INTO task_run_trail (run_id, status, attempt, worker_id, detail)
VALUES (:run_id, 'queued', :attempt, :worker, CAST(:detail AS jsonb))
"""
).bindparams(_RUN_ID, bindparam("detail", type_=Text))
_NOTIFY = text(f"SELECT pg_notify('{WAKE_CHANNEL}', '')")
HOLDER_OF_KEY = _HOLDER
"""Another unfinished run holding a run's task + tenant + idempotency key (parameters
``task``, ``key``, ``tenant_id``, ``run_id``); also used by :mod:`sqla_outbox.ops.resend`."""
RUN_TO_QUEUED = _RUN_TO_QUEUED
"""``failed`` → ``queued`` for a run given back to the outbox (parameter ``run_id``)."""

_QUEUES_OF = text("SELECT run_id, queue FROM task_runs WHERE run_id = ANY(:run_ids)").bindparams(
    bindparam("run_ids", type_=ARRAY(UUID(as_uuid=True)))
)


@dataclasses.dataclass
class RequeueItem:
    """What happened to one run (or one foreign DLQ message).

    Attributes:
        run_id / task / tenant_id / queue: The run, as far as known.
        action: ``requeued``, ``would-requeue`` (dry run) or ``skipped``.
        reason: Why it was skipped (``not-a-run``, ``foreign-message``, ``unknown-run``,
            ``not-failed``, ``idempotency-conflict``, ``no-envelope``, ``filtered-out``,
            ``database-refused``); None otherwise.
        detail: A sentence for humans (the status found, the run holding the key, ...).
        source: ``dlq`` (found through a DLQ message) or ``database`` (``--run-id``
            whose DLQ message was not found).
        outbox: ``reset`` (the row was made pending again) or ``recreated`` (from the
            DLQ body after a purge); None when skipped.
        dlq_message_ids: The run's DLQ messages seen (copies included).
        dlq_deleted: How many of them were deleted.
    """

    run_id: uuid.UUID | None
    task: str | None
    tenant_id: int | None
    queue: str | None
    action: str
    reason: str | None = None
    detail: str | None = None
    source: str = "dlq"
    outbox: str | None = None
    dlq_message_ids: list[str] = dataclasses.field(default_factory=list)
    dlq_deleted: int = 0

    @property
    def selected(self) -> bool:
        return self.action in (REQUEUED, WOULD_REQUEUE)


@dataclasses.dataclass
class RequeueReport:
    """Result of :func:`requeue`.

    Attributes:
        dry_run: Nothing was changed. items: One per run (or foreign message), in the
            order found. woke: At least one wake LPUSH succeeded, or requeues NOTIFYed the relay.
        missing_queues: DLQs that do not exist.
    """

    dry_run: bool
    items: list[RequeueItem] = dataclasses.field(default_factory=list)
    woke: bool = False
    missing_queues: list[str] = dataclasses.field(default_factory=list)

    @property
    def requeued(self) -> int:
        """Runs requeued (or that would be, in a dry run)."""
        return sum(1 for item in self.items if item.selected)

    @property
    def skipped(self) -> int:
        return sum(1 for item in self.items if item.action == SKIPPED)


def operator_id() -> str:
    """``operator:<user>@<host>``, recorded as the trail row's ``worker_id``."""
    try:
        user = getpass.getuser()
    except Exception:  # no passwd entry in some containers
        user = "unknown"
    return f"operator:{user}@{socket.gethostname()}"


def _skip(item: RequeueItem, reason: str, detail: str) -> RequeueItem:
    item.action, item.reason, item.detail = SKIPPED, reason, detail
    return item


def _filters_exclude(filters: DeadLetterFilter, run: Any) -> str | None:
    """For database-only requeues: why the run does not match the other filters."""
    if filters.tasks and run.task not in filters.tasks:
        return f"task {run.task!r} is not among --task"
    if filters.queues and run.queue not in filters.queues:
        return f"queue {run.queue!r} is not among --queue"
    if filters.older_than is not None and (
        run.finished_age is None or run.finished_age < filters.older_than.total_seconds()
    ):
        return "finished more recently than --older-than"
    return None


def _envelope_for(body: str | None, run: Any, settings: OutboxSettings) -> tuple[str | None, str]:
    """The envelope JSON to recreate the outbox row from, or None and why not."""
    if body is None:
        return None, "its outbox row was purged and no DLQ message carries the envelope"
    try:
        decoded = envelope.decode(body, max_bytes=settings.max_message_bytes)
    except envelope.MalformedEnvelope as exc:
        return None, f"its outbox row was purged and the DLQ body is not an envelope ({exc.reason})"
    if (decoded.run_id, decoded.task, decoded.tenant_id, decoded.queue) != (
        run.run_id,
        run.task,
        run.tenant_id,
        run.queue,
    ):
        return None, "its outbox row was purged and the DLQ body names another run, task, tenant or queue"
    return envelope.encode_document(decoded.to_document()), ""


def requeue_run(
    connection: Connection,
    run_id: uuid.UUID,
    settings: OutboxSettings,
    *,
    body: str | None,
    source: str,
    trail_detail: dict[str, Any],
    filters: DeadLetterFilter | None = None,
) -> RequeueItem:
    """Apply the guardrails and the requeue statements for one run, in the caller's
    transaction (the caller commits, or rolls back for a dry run).

    Args:
        connection: Inside a transaction; the run row stays locked until it ends.
        run_id: The run.
        settings: ``max_message_bytes`` bounds the DLQ body decoded.
        body: The DLQ message body (the envelope), or None (database-only requeue).
        source: ``dlq`` or ``database`` (recorded in the item and the trail).
        trail_detail: Extra keys for the trail row's detail.
        filters: For database-only requeues, the task/queue/age filters to honour.

    Returns:
        The :class:`RequeueItem`, ``action`` ``requeued`` or ``skipped``.
    """
    item = RequeueItem(run_id=run_id, task=None, tenant_id=None, queue=None, action=REQUEUED, source=source)
    run = connection.execute(_LOCK_RUN, {"run_id": run_id}).one_or_none()
    if run is None:
        return _skip(item, UNKNOWN_RUN, "no task_runs row (never dispatched, or purged)")
    item.task, item.tenant_id, item.queue = run.task, run.tenant_id, run.queue
    if filters is not None:
        excluded = _filters_exclude(filters, run)
        if excluded:
            return _skip(item, FILTERED_OUT, excluded)
    if run.status != "failed":
        return _skip(item, NOT_FAILED, f"run is {run.status}; only failed runs are requeued")
    if run.idempotency_key is not None:
        holder = connection.execute(
            _HOLDER,
            {"task": run.task, "key": run.idempotency_key, "tenant_id": run.tenant_id, "run_id": run_id},
        ).scalar()
        if holder is not None:
            return _skip(
                item,
                IDEMPOTENCY_CONFLICT,
                f"unfinished run {holder} holds the same task + tenant + idempotency key",
            )
    table = "outbox_messages" if run.tenant_id is not None else "platform_outbox_messages"
    savepoint = connection.begin_nested()
    try:
        connection.execute(_RUN_TO_QUEUED, {"run_id": run_id})
        if connection.execute(_RESET_OUTBOX[table], {"run_id": run_id}).first() is not None:
            item.outbox = "reset"
        else:
            document, why_not = _envelope_for(body, run, settings)
            if document is None:
                savepoint.rollback()
                return _skip(item, NO_ENVELOPE, why_not)
            connection.execute(
                _RECREATE_OUTBOX[table],
                {"run_id": run_id, "tenant_id": run.tenant_id, "queue": run.queue, "envelope": document},
            )
            item.outbox = "recreated"
        detail = {
            "requeued_by": "operator",
            "from": "failed",
            "source": source,
            "outbox": item.outbox,
            **trail_detail,
        }
        connection.execute(
            _TRAIL,
            {
                "run_id": run_id,
                "attempt": run.attempts,
                "worker": operator_id(),
                "detail": json.dumps(charsets.jsonb_safe(detail)),  # DLQ attributes: untrusted text
            },
        )
        if settings.wake_notify:  # the PostgreSQL wake: delivered if the transaction commits
            connection.execute(_NOTIFY)
        savepoint.commit()
    except IntegrityError as exc:
        savepoint.rollback()
        constraint = getattr(getattr(exc.orig, "diag", None), "constraint_name", None) or ""
        if "idempotency" in constraint:
            return _skip(
                item,
                IDEMPOTENCY_CONFLICT,
                "another unfinished run holds the same task + tenant + idempotency key",
            )
        return _skip(
            item, DATABASE_REFUSED, f"the database refused it: {constraint or type(exc.orig).__name__}"
        )
    return item


def _requeue_one(
    engine: Engine,
    run_id: uuid.UUID,
    settings: OutboxSettings,
    *,
    dry_run: bool,
    body: str | None,
    source: str,
    trail_detail: dict[str, Any],
    filters: DeadLetterFilter | None = None,
) -> RequeueItem:
    with engine.connect() as connection:
        transaction = connection.begin()
        try:
            item = requeue_run(
                connection,
                run_id,
                settings,
                body=body,
                source=source,
                trail_detail=trail_detail,
                filters=filters,
            )
        except BaseException:
            transaction.rollback()
            raise
        if dry_run or not item.selected:
            transaction.rollback()
            if item.selected:
                item.action = WOULD_REQUEUE
        else:
            transaction.commit()
    logger.info(
        "run requeued" if item.action == REQUEUED else "requeue checked",
        extra=log_extra(
            action=f"ops.{item.action.replace('-', '_')}",
            run_id=str(run_id),
            task=item.task,
            tenant_id=item.tenant_id,
            reason=item.reason,
            source=source,
        ),
    )
    return item


def requeue(
    engine: Engine,
    client: Any,
    settings: OutboxSettings,
    filters: DeadLetterFilter,
    *,
    dry_run: bool = False,
    waker: Waker | None = None,
    visibility_seconds: int = REQUEUE_VISIBILITY_SECONDS,
    max_messages: int = 10_000,
) -> RequeueReport:
    """Requeue the failed runs whose DLQ messages match ``filters`` (see the module docstring).

    Args:
        engine: Engine of the outbox database.
        client: boto3 SQS client.
        settings: Queue names, ``max_message_bytes``.
        filters: Which DLQ messages (``queues``, ``tasks``, ``older_than``) or runs
            (``run_ids``) to act on.
        dry_run: Decide and report, change nothing.
        waker: Pushes the wake after each committed batch; None: rely on the sweep.
        visibility_seconds: How long scanned DLQ messages stay hidden.
        max_messages: Most DLQ messages received per queue.

    Returns:
        A :class:`RequeueReport`.

    Raises:
        botocore.exceptions.ClientError: SQS failed (a missing DLQ is reported in
            :attr:`RequeueReport.missing_queues` instead).
        sqlalchemy.exc.DBAPIError: The database failed; runs committed before stay requeued.
    """
    report = RequeueReport(dry_run=dry_run)
    by_run: dict[uuid.UUID, RequeueItem] = {}
    queues = filters.scanned_queues()
    if filters.run_ids:
        with engine.connect() as connection:
            rows = connection.execute(_QUEUES_OF, {"run_ids": sorted(filters.run_ids)})
            known_queues = {str(row.queue) for row in rows}
        queues = tuple(q for q in queues if q in known_queues)
    directory = QueueDirectory(client, settings)
    for queue in queues:
        try:
            with DeadLetterScan(
                client, directory, queue, visibility_seconds=visibility_seconds, max_messages=max_messages
            ) as scan:
                for batch in scan.batches():
                    _requeue_batch(engine, settings, scan, batch, filters, report, by_run, dry_run, waker)
        except Exception as exc:
            if not is_missing_queue(exc):
                raise
            report.missing_queues.append(settings.dlq_url_name(queue))
    woke_for_database = False
    for run_id in sorted(filters.run_ids - by_run.keys()):
        item = _requeue_one(
            engine,
            run_id,
            settings,
            dry_run=dry_run,
            body=None,
            source="database",
            trail_detail={},
            filters=filters,
        )
        by_run[run_id] = item
        report.items.append(item)
        woke_for_database = woke_for_database or item.action == REQUEUED
    if woke_for_database and waker is not None:
        report.woke = _wake_now(waker) or report.woke
    if settings.wake_notify and not dry_run and any(item.action == REQUEUED for item in report.items):
        report.woke = True  # each requeue's transaction NOTIFYed the relay as it committed
    return report


def _requeue_batch(
    engine: Engine,
    settings: OutboxSettings,
    scan: DeadLetterScan,
    batch: list[Received],
    filters: DeadLetterFilter,
    report: RequeueReport,
    by_run: dict[uuid.UUID, RequeueItem],
    dry_run: bool,
    waker: Waker | None,
) -> None:
    to_delete: list[tuple[Received, RequeueItem]] = []
    for received in batch:
        letter: DeadLetter = received.letter
        if not filters.matches(letter):
            continue  # released (made visible again) when the scan ends
        if letter.run_id is None:
            report.items.append(
                RequeueItem(
                    run_id=None,
                    task=letter.task,
                    tenant_id=letter.tenant_id,
                    queue=letter.queue,
                    action=SKIPPED,
                    reason=NOT_A_RUN,
                    detail=f"DLQ message {letter.message_id} carries no run_id ({letter.reason})",
                    dlq_message_ids=[letter.message_id],
                )
            )
            continue
        if is_foreign(letter):
            report.items.append(
                RequeueItem(
                    run_id=letter.run_id,
                    task=letter.task,
                    tenant_id=letter.tenant_id,
                    queue=letter.queue,
                    action=SKIPPED,
                    reason=FOREIGN_MESSAGE,
                    detail=f"the worker refused this message unexecuted ({letter.reason}); it is not the "
                    "run's own message and is never requeued",
                    dlq_message_ids=[letter.message_id],
                )
            )
            continue
        item = by_run.get(letter.run_id)
        if item is None:
            item = _requeue_one(
                engine,
                letter.run_id,
                settings,
                dry_run=dry_run,
                body=received.body,
                source="dlq",
                trail_detail={
                    "dlq": letter.dlq,
                    "dlq_message_id": letter.message_id,
                    "dlq_reason": letter.reason,
                },
            )
            by_run[letter.run_id] = item
            report.items.append(item)
        item.dlq_message_ids.append(letter.message_id)
        if item.action == REQUEUED:  # copies of a requeued run go too
            to_delete.append((received, item))
    if not to_delete:
        return
    if waker is not None:  # committed: wake the relay before the DLQ copies disappear
        report.woke = _wake_now(waker) or report.woke
    deleted = scan.delete([received for received, _ in to_delete])
    for received, item in to_delete:
        if received.letter.message_id in deleted:
            item.dlq_deleted += 1


def _wake_now(waker: Waker) -> bool:
    """Push one wake and wait for it (a CLI exits right after); True when it went out."""
    sent = waker.stats.sent
    waker.wake()
    waker.drain(2.0)
    return waker.stats.sent > sent
