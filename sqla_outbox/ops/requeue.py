"""``python -m sqla_outbox dlq requeue``: give failed runs another go, through the outbox.

A requeue never sends to SQS itself. For each selected run, in **one transaction**:

1. lock the ``task_runs`` row (``FOR UPDATE``) and check the guardrails:

   * the run exists and its status is ``failed`` (a ``queued``/``running``/``retrying``
     run is still being worked on, and a ``succeeded`` one is done: both are skipped);
   * no *other* unfinished run holds the same task + tenant + idempotency key (the
     partial unique indexes ``task_runs_idempotency_*_key`` allow one; ``docs/dispatch.md``,
     ``idempotency_key``). A newer dispatch with that key won; the old run is skipped. The check is
     repeated by the index itself: a concurrent dispatch that slips in is caught as a
     unique violation and reported the same way;

2. set the run back to ``queued``: ``finished_at``, ``dead_lettered_at`` and the lease
   are cleared, ``available_at`` is now; ``attempts`` and ``last_error*`` are kept, so the
   history still counts the earlier attempts;
3. make its outbox row pending again (``sent_at`` NULL, ``attempts`` 0, ``available_at``
   now). If ``maintenance.purge`` already deleted the row (sent rows go after 7 days,
   failed runs stay 30), it is rebuilt from the DLQ message body, which is the envelope,
   only when that body can be trusted (below). ``run_id`` is UNIQUE in the outbox
   tables, so a run has one row;
4. add a trail row: status ``queued``, detail ``{"requeued_by": "operator", "from":
   "failed", "source": "dlq"|"database", "outbox": "reset"|"recreated", ...}`` (and
   ``"body": "verified"|"unchecked"`` when rebuilt).

With the PostgreSQL wake (``settings.wake_notify``) the transaction also ``NOTIFY``s the
relay, which PostgreSQL delivers when it commits. Then, after the commits of a DLQ: one
Valkey wake (LPUSH, :class:`sqla_outbox.wakeup.Waker`, when that wake is in force), so the
relay sends the rows at once (its sweep would find them anyway), and only then the
DLQ messages of the requeued runs are deleted. If the process dies between the commit
and the delete, the DLQ message stays; requeueing it again is refused (the run is not
``failed`` any more), so nothing runs twice because of it.

**What a DLQ message is trusted for.** Anyone with ``sqs:SendMessage`` on a queue or a
DLQ can write any body and any attributes (``docs/security.md``). So:

* the filters (``tasks``, ``older_than``, ``queues``) match the run's own row in
  ``task_runs`` (its task, when it failed, its queue), read when the message is
  resolved (:func:`sqla_outbox.ops.dlq.resolve`) and again on the locked row, never the
  DLQ message's attributes: a forged message claiming ``task=record`` does not put a
  failed ``charge`` run among ``--task record``;
* without signing keys, a copy whose origin is ``unverified`` (not the envelope of the
  run's outbox row, or the row was purged: :mod:`sqla_outbox.ops.dlq`) is not acted on
  unless ``include_unverified`` (``--include-unverified``, implied by
  ``--trust-dlq-body``) says so (``unverified``); a message naming no run in
  ``task_runs`` is ``unknown-run``;

* a message is never acted on when the worker refused it unexecuted (``bad-signature``,
  ``malformed-envelope:*``, ``unknown-run``, ``envelope-mismatch``, ``wrong-queue``: it
  is not the run's own message), when it names no run (``not-a-run``), when it was found
  in another queue's DLQ than its run's, or, by default, when it carries no worker
  verdict at all (``no-reason``: moved by the SQS redrive policy or sent straight to the
  DLQ; ``include_no_reason`` / ``--include-no-reason`` acts on it);
* with ``signing_keys`` set, only messages whose body carries the relay's signature
  (kept by the worker when it dead-letters) are acted on; the run is the signed body's.
  Others (``ledger`` copies included) are reported as ``unverified`` and left in the DLQ;
* the database stays the truth: a run is requeued only if ``task_runs`` says ``failed``,
  and while its outbox row exists the row is what is sent again, never the DLQ body;
* a purged row is rebuilt from a signed body; without signing keys, only with
  ``trust_dlq_body`` (``--trust-dlq-body``), which the report and the trail record;
* copies of one run are decided together, after the whole DLQ was read (SQS returns
  messages in no guaranteed order): a row is rebuilt only when every usable copy carries
  the same envelope (``conflicting-copies`` otherwise).

Messages that are not acted on stay in the DLQ, visible again when the command ends.

``--run-id`` also reaches failed runs whose DLQ message is gone (expired, deleted by
hand) or not usable: when no usable DLQ message is found for a requested run, it is
requeued from the database alone, which needs its outbox row (there is no other copy of
the payload).

A requeue **by filters** selects what the ledger says: the dead-lettered runs
(``failed`` with ``dead_lettered_at``) that match, not only the messages this scan
happened to receive. Receiving a message hides it from every other reader for its
visibility timeout (SQS ReceiveMessage), so while a colleague's ``dlq list`` or DLQ page
holds some, a scan sees only the rest. Each matching run whose message was not received
(:attr:`RequeueReport.not_received`) is requeued from the database alone, as with
``--run-id`` (trail ``detail.dlq_message = "not-received"``); the ones that cannot be
(their outbox row was purged) are counted as :attr:`RequeueReport.unreachable`. Their
DLQ copies stay; a later requeue finds their runs no longer ``failed`` and leaves them.

``--dry-run`` runs exactly the same statements and rolls each transaction back, so it
reports what the guardrails would decide (including the unique index); it wakes nothing
and deletes nothing, and every DLQ message becomes visible again.
"""

from __future__ import annotations

import dataclasses
import getpass
import hashlib
import logging
import socket
import uuid
from collections.abc import Iterable
from typing import Any

from sqlalchemy import bindparam, text
from sqlalchemy.dialects.postgresql import ARRAY, UUID
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.exc import IntegrityError

from sqla_outbox import envelope
from sqla_outbox.config import OutboxSettings
from sqla_outbox.lifecycle import operator as operator_changes
from sqla_outbox.lifecycle import rescue
from sqla_outbox.logging import log_extra
from sqla_outbox.ops.dlq import (
    NO_REASON,
    ORIGIN_LEDGER,
    ORIGIN_UNCHECKED,
    ORIGIN_VERIFIED,
    DeadLetter,
    DeadLetterFilter,
    DeadLetterScan,
    Received,
    dead_lettered_runs,
    resolve,
)
from sqla_outbox.sqs.client import QueueDirectory, is_missing_queue
from sqla_outbox.types import UNFINISHED_STATUSES, WAKE_CHANNEL
from sqla_outbox.wakeup import Waker

logger = logging.getLogger(__name__)

REQUEUE_VISIBILITY_SECONDS = 600
"""How long the scan hides each DLQ message: a whole DLQ is read before its runs are
decided (copies of one run are decided together), then requeued and deleted."""

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
NO_VERDICT = NO_REASON
UNVERIFIED = "unverified"
UNVERIFIABLE_BODY = "unverifiable-body"
CONFLICTING_COPIES = "conflicting-copies"

FOREIGN_REASONS = frozenset({"bad-signature", "unknown-run", "envelope-mismatch", "wrong-queue"})
"""DLQ reasons of messages the worker refused without executing them
(:func:`sqla_outbox.worker.handle._dead_letter_foreign`), plus every
``malformed-envelope:*``. Such a message is not the run's own message (it may be forged),
so it is never requeued, even when it names a real failed run."""


def vouched_for(letter: DeadLetter, settings: OutboxSettings) -> bool:
    """Whether something vouches for this DLQ copy: its signature (with signing keys), or,
    without keys, the database (``ledger``: it is the envelope of the run's outbox row).
    Requeues act on other copies only when asked to (``include_unverified``)."""
    if settings.signing_keys:
        return letter.origin == ORIGIN_VERIFIED
    return letter.origin in (ORIGIN_VERIFIED, ORIGIN_LEDGER)


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
_NOTIFY = text(f"SELECT pg_notify('{WAKE_CHANNEL}', '')")
HOLDER_OF_KEY = _HOLDER
"""Another unfinished run holding a run's task + tenant + idempotency key (parameters
``task``, ``key``, ``tenant_id``, ``run_id``); also used by :mod:`sqla_outbox.ops.resend`."""

_QUEUES_OF = text("SELECT run_id, queue FROM task_runs WHERE run_id = ANY(:run_ids)").bindparams(
    bindparam("run_ids", type_=ARRAY(UUID(as_uuid=True)))
)
_FAILED_AND_PURGED = text(
    """
SELECT r.run_id FROM task_runs AS r
WHERE r.run_id = ANY(:run_ids) AND r.status = 'failed'
  AND NOT EXISTS (SELECT 1 FROM outbox_messages AS o WHERE o.run_id = r.run_id)
  AND NOT EXISTS (SELECT 1 FROM platform_outbox_messages AS p WHERE p.run_id = r.run_id)
"""
).bindparams(bindparam("run_ids", type_=ARRAY(UUID(as_uuid=True))))


@dataclasses.dataclass
class RequeueItem:
    """What happened to one run (or one foreign DLQ message).

    Attributes:
        run_id / task / tenant_id / queue: The run, as far as known.
        action: ``requeued``, ``would-requeue`` (dry run) or ``skipped``.
        reason: Why it was skipped (``not-a-run``, ``foreign-message``, ``no-reason``,
            ``unverified``, ``unknown-run``, ``not-failed``, ``idempotency-conflict``,
            ``no-envelope``, ``unverifiable-body``, ``conflicting-copies``,
            ``filtered-out``, ``database-refused``); None otherwise.
        detail: A sentence for humans (the status found, the run holding the key, ...).
        source: ``dlq`` (found through a DLQ message) or ``database`` (``--run-id``
            whose DLQ message was not found).
        outbox: ``reset`` (the row was made pending again), ``recreated`` (from the
            DLQ body after a purge), or ``rescued`` (the run was not failed but had no live
            copy: sent again as the rescuer does, :mod:`sqla_outbox.lifecycle.rescue`);
            None when skipped.
        body_origin: For ``recreated``: ``verified`` (the body's signature checked out) or
            ``unchecked`` (no signing keys; trusted because ``trust_dlq_body`` was given).
        dlq_message_ids: The run's DLQ messages used (copies included).
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
    body_origin: str | None = None
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
        not_received: A requeue by filters selects the ledger's dead-lettered runs
            (:func:`sqla_outbox.ops.dlq.dead_lettered_runs`): this many of them had no DLQ
            message among those received (another reader held them, or they are gone), and
            were requeued from the database alone, as ``--run-id`` does (``source``
            ``database``; :attr:`unreachable` counts those that could not be).
    """

    dry_run: bool
    items: list[RequeueItem] = dataclasses.field(default_factory=list)
    woke: bool = False
    missing_queues: list[str] = dataclasses.field(default_factory=list)
    not_received: int = 0

    @property
    def unreachable(self) -> int:
        """Runs selected from the database (``--run-id``, or the ledger's dead-lettered
        runs whose DLQ message was not received) that could not be requeued."""
        return sum(1 for item in self.items if item.source == "database" and item.action == SKIPPED)

    @property
    def not_received_note(self) -> str | None:
        """The sentence the CLI and the dashboard print about :attr:`not_received`; None
        when every matching run's message was received."""
        if not self.not_received:
            return None
        return (
            f"{self.not_received} of the matching dead-lettered runs had no DLQ message among those "
            "received (another reader holds them for up to their visibility timeout, or they are gone): "
            f"taken from the database; {self.unreachable} could not be (no outbox row to send again)"
        )

    @property
    def requeued(self) -> int:
        """Runs requeued (or that would be, in a dry run)."""
        return sum(1 for item in self.items if item.selected)

    @property
    def skipped(self) -> int:
        return sum(1 for item in self.items if item.action == SKIPPED)

    @property
    def rebuilt_unchecked(self) -> int:
        """Outbox rows rebuilt from DLQ bodies nothing could verify (``trust_dlq_body``)."""
        return sum(1 for item in self.items if item.selected and item.body_origin == ORIGIN_UNCHECKED)


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
    """Why the locked run row does not match the task, queue or age filters (the run's own
    values: a DLQ message's attributes are never consulted)."""
    if filters.tasks and run.task not in filters.tasks:
        return f"task {run.task!r} is not among --task"
    if filters.tenant_ids is not None and run.tenant_id not in filters.tenant_ids:
        return "not a run of the tenants this operator may act on"
    if filters.queues and run.queue not in filters.queues:
        return f"queue {run.queue!r} is not among --queue"
    if filters.older_than is not None and (
        run.finished_age is None or run.finished_age < filters.older_than.total_seconds()
    ):
        return "finished more recently than --older-than"
    return None


@dataclasses.dataclass(frozen=True)
class Rebuild:
    """What a purged outbox row may be rebuilt from, decided over every usable DLQ copy.

    Attributes:
        body: The DLQ body to rebuild from (every usable copy carries the same envelope),
            or None when there is none.
        origin: ``verified`` or ``unchecked`` (see :mod:`sqla_outbox.ops.dlq`).
        refusal: ``(reason, detail)`` when the copies may not be used at all
            (``unverifiable-body``, ``conflicting-copies``); then ``body`` is None.
    """

    body: str | None = None
    origin: str | None = None
    refusal: tuple[str, str] | None = None


def _envelope_for(body: str | None, run: Any, settings: OutboxSettings) -> tuple[str | None, str]:
    """The envelope JSON to recreate the outbox row from, or None and why not."""
    if body is None:
        return None, "its outbox row was purged and no usable DLQ message carries the envelope"
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
    rebuild: Rebuild | None,
    source: str,
    trail_detail: dict[str, Any],
    filters: DeadLetterFilter | None = None,
    dlq_queue: str | None = None,
    operator: str | None = None,
) -> RequeueItem:
    """Apply the guardrails and the requeue statements for one run, in the caller's
    transaction (the caller commits, or rolls back for a dry run).

    Args:
        connection: Inside a transaction; the run row stays locked until it ends.
        run_id: The run.
        settings: ``max_message_bytes`` bounds the DLQ body decoded.
        rebuild: What a purged outbox row may be rebuilt from (:class:`Rebuild`); None
            for a database-only requeue (a purged row is then not rebuilt).
        source: ``dlq`` or ``database`` (recorded in the item and the trail).
        trail_detail: Extra keys for the trail row's detail.
        filters: The task/queue/age filters to honour, checked on the locked row (the
            run's own task, queue and failure time).
        dlq_queue: The logical queue whose DLQ held the message; a run of another queue
            is refused (its own messages are in its own queue's DLQ).
        operator: Who asked, recorded as the trail row's ``worker_id`` (default
            :func:`operator_id`: ``operator:<user>@<host>``; the dashboard passes
            ``dashboard:<name>``).

    Returns:
        The :class:`RequeueItem`, ``action`` ``requeued`` or ``skipped``.
    """
    item = RequeueItem(run_id=run_id, task=None, tenant_id=None, queue=None, action=REQUEUED, source=source)
    run = connection.execute(_LOCK_RUN, {"run_id": run_id}).one_or_none()
    if run is None:
        return _skip(item, UNKNOWN_RUN, "no task_runs row (never dispatched, or purged)")
    item.task, item.tenant_id, item.queue = run.task, run.tenant_id, run.queue
    if dlq_queue is not None and dlq_queue != run.queue:
        return _skip(
            item,
            FOREIGN_MESSAGE,
            f"found in the {dlq_queue} DLQ, but the run belongs to the {run.queue} queue: "
            "not its own message",
        )
    if filters is not None:
        excluded = _filters_exclude(filters, run)
        if excluded:
            return _skip(item, FILTERED_OUT, excluded)
    if run.status in UNFINISHED_STATUSES:
        # not failed, yet its message is in the DLQ (SQS redrove it, or it was lost to the
        # 12-hour ceiling) or an operator names it: reconcile by sending it again through the
        # outbox, unless a worker holds its lease or its row is pending (it has a live copy)
        why = "in-dlq" if source == "dlq" else "operator"
        if rescue.rescue(connection, [(run_id, why)], by=operator or operator_id()):
            item.outbox = "rescued"
            return item
        return _skip(
            item,
            NOT_FAILED,
            f"run is {run.status} with a live copy (a worker holds its lease, or its outbox row is pending)",
        )
    if run.status != "failed":
        return _skip(item, NOT_FAILED, f"run is {run.status}; only failed and unfinished runs are requeued")
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
        operator_changes.run_to_queued(connection, run_id)
        if operator_changes.reset_row(connection, table, run_id):
            item.outbox = "reset"
        else:
            rebuild = rebuild or Rebuild()
            if rebuild.refusal is not None:
                savepoint.rollback()
                return _skip(item, *rebuild.refusal)
            document, why_not = _envelope_for(rebuild.body, run, settings)
            if document is None:
                savepoint.rollback()
                return _skip(item, NO_ENVELOPE, why_not)
            operator_changes.recreate_row(connection, table, run_id, envelope=document)
            item.outbox, item.body_origin = "recreated", rebuild.origin
        detail = {
            "requeued_by": "operator",
            "from": "failed",
            "source": source,
            "outbox": item.outbox,
            **({"body": item.body_origin} if item.body_origin else {}),
            **trail_detail,
        }
        # DLQ attributes in the detail are untrusted text: record() makes them jsonb-safe
        operator_changes.record(
            connection, run_id, attempt=run.attempts, operator=operator or operator_id(), detail=detail
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
    rebuild: Rebuild | None,
    source: str,
    trail_detail: dict[str, Any],
    filters: DeadLetterFilter | None = None,
    dlq_queue: str | None = None,
    operator: str | None = None,
) -> RequeueItem:
    with engine.connect() as connection:
        transaction = connection.begin()
        try:
            item = requeue_run(
                connection,
                run_id,
                settings,
                rebuild=rebuild,
                source=source,
                trail_detail=trail_detail,
                filters=filters,
                dlq_queue=dlq_queue,
                operator=operator,
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
    trust_dlq_body: bool = False,
    include_no_reason: bool = False,
    include_unverified: bool = False,
    visibility_seconds: int = REQUEUE_VISIBILITY_SECONDS,
    max_messages: int = 10_000,
    operator: str | None = None,
) -> RequeueReport:
    """Requeue the failed runs whose DLQ messages match ``filters`` (see the module docstring).

    Args:
        engine: Engine of the outbox database.
        client: boto3 SQS client.
        settings: Queue names, ``max_message_bytes``, ``signing_keys`` (DLQ bodies are
            verified against them).
        filters: Which DLQ messages (``queues``, ``tasks``, ``older_than``) or runs
            (``run_ids``) to act on.
        dry_run: Decide and report, change nothing.
        waker: Pushes the wake after each DLQ's commits; None: rely on the sweep.
        trust_dlq_body: Without signing keys, rebuild a purged outbox row from a DLQ body
            nothing can verify (when every copy agrees). No effect with signing keys:
            only signed bodies are used then.
        include_no_reason: Also act on DLQ messages without a worker verdict (``no-reason``).
        include_unverified: Without signing keys, also act on copies whose origin is
            ``unverified`` (the run is still requeued from its own row; the body is used
            only as ``trust_dlq_body`` allows, which implies this). No effect with signing
            keys: only signed copies are acted on then (``run_ids`` reach the others' runs
            from the database).
        visibility_seconds: How long scanned DLQ messages stay hidden.
        max_messages: Most DLQ messages received per queue.
        operator: Who asked, recorded in each requeued run's trail row (``worker_id``);
            default :func:`operator_id`.

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
    policy = _Policy(
        settings,
        trust_dlq_body=trust_dlq_body,
        include_no_reason=include_no_reason,
        include_unverified=(include_unverified or trust_dlq_body) and not settings.signing_keys,
    )
    for queue in queues:
        try:
            with DeadLetterScan(
                client, directory, queue, visibility_seconds=visibility_seconds, max_messages=max_messages
            ) as scan:
                copies: dict[uuid.UUID, _Copies] = {}
                for batch in scan.batches():
                    _collect(engine, policy, batch, filters, report, copies)
                _decide(
                    engine,
                    settings,
                    policy,
                    scan,
                    queue,
                    filters,
                    copies,
                    report,
                    by_run,
                    dry_run,
                    waker,
                    operator,
                )
        except Exception as exc:
            if not is_missing_queue(exc):
                raise
            report.missing_queues.append(settings.dlq_url_name(queue))
    wanted = set(filters.run_ids)
    if not filters.run_ids and queues:
        # the ledger's dead-lettered runs this scan did not reach: another reader holds their
        # messages (receiving hides a message from every other reader), or they are gone
        with engine.connect() as connection:
            ledger = dead_lettered_runs(connection, dataclasses.replace(filters, queues=queues))
        seen = {item.run_id for item in report.items}  # a run whose copy was received is decided by it
        wanted = {x.run_id for x in ledger} - seen
        report.not_received = len(wanted)
    woke_for_database = False
    for run_id in sorted(wanted - by_run.keys()):
        item = _requeue_one(
            engine,
            run_id,
            settings,
            dry_run=dry_run,
            rebuild=None,
            source="database",
            trail_detail={} if filters.run_ids else {"dlq_message": "not-received"},
            filters=filters,
            operator=operator,
        )
        by_run[run_id] = item
        report.items.append(item)
        woke_for_database = woke_for_database or item.action == REQUEUED
    if woke_for_database and waker is not None:
        report.woke = _wake_now(waker) or report.woke
    if settings.wake_notify and not dry_run and any(item.action == REQUEUED for item in report.items):
        report.woke = True  # each requeue's transaction NOTIFYed the relay as it committed
    return report


@dataclasses.dataclass(frozen=True)
class _Policy:
    settings: OutboxSettings
    trust_dlq_body: bool
    include_no_reason: bool
    include_unverified: bool = False

    @property
    def keys(self) -> tuple[str, ...]:
        return self.settings.signing_keys

    @property
    def keeps_bodies(self) -> bool:
        """Whether a DLQ body can ever be used: signed ones, or unsigned ones on request."""
        return bool(self.keys) or self.trust_dlq_body

    def refusal(self, letter: DeadLetter) -> tuple[str, str] | None:
        """Why this DLQ message is not acted on at all, whatever its run; None: usable."""
        if letter.run_id is None:
            return NOT_A_RUN, f"DLQ message {letter.message_id} carries no run_id ({letter.reason})"
        if is_foreign(letter):
            return (
                FOREIGN_MESSAGE,
                f"the worker refused this message unexecuted ({letter.reason}); it is not the run's own "
                "message and is never requeued",
            )
        if letter.reason == NO_REASON and not self.include_no_reason:
            return (
                NO_VERDICT,
                "no worker verdict: moved by the SQS redrive policy, or sent straight to the DLQ by "
                "anyone allowed to; --include-no-reason acts on it",
            )
        if letter.resolved and letter.run_status is None:
            return (
                UNKNOWN_RUN,
                "no task_runs row for the run this message names (never dispatched, or purged)",
            )
        if self.keys and letter.origin != ORIGIN_VERIFIED:
            return (
                UNVERIFIED,
                "its body does not carry a valid signature under the signing keys: not a message our "
                "relay sent (or signed with a key no longer configured); never requeued",
            )
        if not self.keys and not self.include_unverified and letter.origin != ORIGIN_LEDGER:
            return (
                UNVERIFIED,
                "nothing vouches for this copy: it is not the envelope the run's outbox row holds "
                "(or the row was purged) and no signing keys are set; --include-unverified acts on it",
            )
        return None

    def rebuild(self, copies: _Copies) -> Rebuild:
        if not self.keys and not self.trust_dlq_body:
            return Rebuild(
                refusal=(
                    UNVERIFIABLE_BODY,
                    "its outbox row was purged, and without signing keys a DLQ body cannot be "
                    "verified (anyone allowed to send to the queue or its DLQ could have written "
                    "it); --trust-dlq-body rebuilds the row from it anyway",
                )
            )
        if len(copies.digests) > 1:
            return Rebuild(
                refusal=(
                    CONFLICTING_COPIES,
                    f"its outbox row was purged and its {len(copies.received)} DLQ copies carry "
                    f"{len(copies.digests)} different envelopes: none is used",
                )
            )
        origin = ORIGIN_VERIFIED if self.keys else ORIGIN_UNCHECKED
        return Rebuild(body=copies.body, origin=origin)


@dataclasses.dataclass
class _Copies:
    """The usable DLQ messages naming one run, in its queue's DLQ (bodies not kept)."""

    received: list[Received] = dataclasses.field(default_factory=list)
    digests: set[str] = dataclasses.field(default_factory=set)
    body: str | None = None

    def add(self, received: Received, *, keep_body: bool) -> None:
        self.digests.add(received.letter.digest or _raw_digest(received.body))
        if keep_body and self.body is None:
            self.body = received.body
        self.received.append(dataclasses.replace(received, body=""))


def _raw_digest(body: str) -> str:
    """Identity of a body that is not an envelope (it then differs from every envelope)."""
    return "raw:" + hashlib.sha256(body.encode("utf-8", "surrogatepass")).hexdigest()


def _collect(
    engine: Engine,
    policy: _Policy,
    batch: list[Received],
    filters: DeadLetterFilter,
    report: RequeueReport,
    copies: dict[uuid.UUID, _Copies],
) -> None:
    """Sort one received batch: messages never acted on become skipped items at once; the
    usable ones join their run's copies (decided when the whole DLQ was read)."""
    usable: list[Received] = []
    with engine.connect() as connection:  # the runs' own rows: what filters and origins read
        letters = resolve(connection, [r.letter for r in batch], max_bytes=policy.settings.max_message_bytes)
    for received, letter in zip(batch, letters, strict=True):
        received.letter = letter
        if not filters.matches(letter):
            continue  # released (made visible again) when the scan ends
        refusal = policy.refusal(letter)
        if refusal is None:
            usable.append(received)
            continue
        report.items.append(
            RequeueItem(
                run_id=letter.run_id,
                task=letter.task,
                tenant_id=letter.tenant_id,
                queue=letter.queue,
                action=SKIPPED,
                reason=refusal[0],
                detail=refusal[1],
                dlq_message_ids=[letter.message_id],
            )
        )
    needing_a_body = (
        _failed_and_purged(engine, (r.letter.run_id for r in usable)) if policy.keeps_bodies else set()
    )
    for received in usable:
        run_id = received.letter.run_id
        assert run_id is not None
        copies.setdefault(run_id, _Copies()).add(received, keep_body=run_id in needing_a_body)


def _failed_and_purged(engine: Engine, run_ids: Iterable[uuid.UUID | None]) -> set[uuid.UUID]:
    """The runs among ``run_ids`` that are failed and whose outbox row is gone: the only
    ones whose DLQ body may be needed (so memory holds at most one body per such run)."""
    wanted = sorted({r for r in run_ids if r is not None})
    if not wanted:
        return set()
    with engine.connect() as connection:
        return {row.run_id for row in connection.execute(_FAILED_AND_PURGED, {"run_ids": wanted})}


def _decide(
    engine: Engine,
    settings: OutboxSettings,
    policy: _Policy,
    scan: DeadLetterScan,
    queue: str,
    filters: DeadLetterFilter,
    copies: dict[uuid.UUID, _Copies],
    report: RequeueReport,
    by_run: dict[uuid.UUID, RequeueItem],
    dry_run: bool,
    waker: Waker | None,
    operator: str | None,
) -> None:
    """Requeue each run of one DLQ over all of its usable copies, then wake the relay and
    delete the copies of the runs requeued."""
    to_delete: list[tuple[Received, RequeueItem]] = []
    for run_id, found in copies.items():
        first = found.received[0].letter
        item = _requeue_one(
            engine,
            run_id,
            settings,
            dry_run=dry_run,
            rebuild=policy.rebuild(found),
            source="dlq",
            trail_detail={
                "dlq": first.dlq,
                "dlq_message_id": first.message_id,
                "dlq_reason": first.reason,
                **({"dlq_copies": len(found.received)} if len(found.received) > 1 else {}),
            },
            filters=filters,
            dlq_queue=queue,
            operator=operator,
        )
        item.dlq_message_ids = [r.letter.message_id for r in found.received]
        by_run[run_id] = item
        report.items.append(item)
        if item.action == REQUEUED:  # every copy of a requeued run goes
            to_delete.extend((received, item) for received in found.received)
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
