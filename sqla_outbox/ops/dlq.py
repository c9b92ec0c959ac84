"""Reading the dead-letter queues: ``python -m sqla_outbox dlq list`` (and the scan ``dlq requeue`` uses).

SQS has no "peek": the only way to read a queue is ReceiveMessage, which hides each
message for a visibility timeout. :class:`DeadLetterScan` therefore receives every
visible message of one DLQ with a short visibility (``list``: 30 s), never deletes
anything itself, and at the end makes every message it did not delete visible again at
once (ChangeMessageVisibilityBatch 0), so a ``dlq list`` followed by ``dlq requeue``
sees the same messages. Receiving increments a DLQ message's ``ApproximateReceiveCount``;
DLQs have no redrive policy, so that has no effect.

What is shown of a message comes from its message attributes, which the worker sets
when it dead-letters a run (:mod:`sqla_outbox.worker.outcome`): ``run_id``, ``task``,
``tenant_id``, ``reason``, ``error_type``, ``failed_at``, ``receive_count``. A message
without a ``reason`` carries no worker verdict: either the SQS redrive policy moved it
(``maxReceiveCount`` receives without a verdict, e.g. workers killed mid-task) or someone
sent it straight to the DLQ; the two cannot be told apart, so it is shown as
``no-reason`` and its age counts from when it was first sent. The body is read only to
find a missing ``run_id``/``task``; payloads are never returned, printed or logged.

Attributes are whatever the sender wrote (anyone with ``sqs:SendMessage`` on a DLQ can
write any), so nothing is decided on them. :func:`resolve` checks each message against
the database, and what is shown and filtered on is then the run's own row in
``task_runs`` (its task, tenant, status and when it failed), never the attributes. Each
message's ``origin`` says how far its body can be trusted:

* ``verified``: signing keys are set and the relay's ``signature`` attribute, which the
  worker keeps when it dead-letters, is the body's HMAC under one of ``signing_keys``;
* ``ledger``: the body is the envelope the run's outbox row holds (compared field by
  field), so the database vouches for it;
* ``unverified``: neither (no keys and the run's outbox row purged, or a body that is not
  the run's). ``dlq requeue`` and the dashboard act on such a copy only when asked to.

The scan stops when it has seen as many messages as the queue's
``ApproximateNumberOfMessages`` said at the start, when a 1-second long poll comes back
empty, or at ``max_messages``. The counts are approximate (SQS), so a message that
arrived during the scan may be missed: run the command again.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import hashlib
import json
import logging
import uuid
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from sqlalchemy import bindparam, text
from sqlalchemy.dialects.postgresql import ARRAY, UUID
from sqlalchemy.engine import Connection

from sqla_outbox import envelope
from sqla_outbox.config import SQS_MAX_MESSAGE_BYTES, OutboxSettings
from sqla_outbox.logging import log_extra
from sqla_outbox.sqs.client import SQS_MAX_BATCH_ENTRIES, QueueDirectory, error_code, is_missing_queue
from sqla_outbox.types import QUEUE_NAMES

logger = logging.getLogger(__name__)

LIST_VISIBILITY_SECONDS = 30
"""How long ``dlq list`` hides each message while it scans (released at the end)."""

DEFAULT_MAX_MESSAGES = 1000
"""Most messages one scan receives per DLQ."""

NO_REASON = "no-reason"
"""Reason shown for messages without a worker verdict (moved by the SQS redrive policy, or
sent straight to the DLQ by anyone allowed to)."""

ORIGIN_VERIFIED = "verified"
"""Signing keys are set and the body's ``signature`` attribute is its HMAC under one of them."""
ORIGIN_LEDGER = "ledger"
"""Not signed (or no keys), but the body is the envelope the run's outbox row holds."""
ORIGIN_UNVERIFIED = "unverified"
"""Neither signed nor matching the run's outbox row: nothing vouches for the body."""
ORIGIN_UNCHECKED = "unchecked"
"""A body used although nothing could verify it (``--trust-dlq-body``, no signing keys);
said of a rebuilt outbox row, never of a message in a listing."""

_RESOLVE_CHUNK = 50
"""Runs read per statement by :func:`resolve` (their outbox envelopes are compared)."""

_BODY_PEEK_BYTES = 1_048_576
_NAME_CHARS = 200


@dataclasses.dataclass(frozen=True)
class DeadLetter:
    """One message in a DLQ, as the operator sees it (never the payload).

    Attributes:
        queue: Logical source queue (the DLQ belongs to it).
        dlq: SQS name of the DLQ.
        message_id: SQS message id (stable across receives).
        run_id: The run, from the ``run_id`` attribute or the body; None for a foreign
            or malformed message.
        task: Task name, when known. tenant_id: Tenant, None for platform work or unknown.
        reason: Why it was dead-lettered (``permanent-error``, ``retries-exhausted``,
            ``receive-limit``, ``unknown-run``, ``malformed-envelope:...``, ...; or
            ``no-reason``). Written by the sender: never proof of anything.
        error_type: Exception type of the last failure, when there was one.
        receive_count: Receives of the source message when it failed.
        failed_at: When it was dead-lettered (``failed_at`` attribute; else when it was
            first sent), UTC.
        age_seconds: Now minus ``failed_at``.
        run_status: The run's status in ``task_runs`` when the database was asked
            (``failed`` = can be requeued); None when unknown or not asked.
        origin: ``verified``, ``ledger`` or ``unverified`` (see the module docstring);
            ``ledger`` only once :func:`resolve` compared the body with the database.
        resolved: :func:`resolve` read the run's row: ``task``, ``tenant_id`` and
            ``run_status`` are the row's (when it exists), not the message's claims.
        claims: What the message claimed that its run's row contradicts, as
            ``(field, claimed value)`` pairs (``task``, ``tenant_id``, ``queue``).
        run_queue: The run's queue (from its row), when resolved.
        run_failed_age_seconds: Now minus the run's ``finished_at`` (database clock), when
            resolved and finished.
        digest: Identity of the envelope the body carries (canonical form), or None when
            the body is not an envelope; never shown.
    """

    queue: str
    dlq: str
    message_id: str
    run_id: uuid.UUID | None
    task: str | None
    tenant_id: int | None
    reason: str
    error_type: str | None
    receive_count: int | None
    failed_at: dt.datetime | None
    age_seconds: float | None
    run_status: str | None = None
    origin: str = ORIGIN_UNVERIFIED
    resolved: bool = False
    claims: tuple[tuple[str, str], ...] = ()
    run_queue: str | None = None
    run_failed_age_seconds: float | None = None
    digest: str | None = dataclasses.field(default=None, repr=False, compare=False)


@dataclasses.dataclass
class Received:
    """A received DLQ message: what is shown, plus what a requeue needs (never printed).

    Attributes:
        letter: The :class:`DeadLetter`. receipt_handle: Current receipt handle.
        body: The raw body (the envelope), used only to recreate a purged outbox row.
    """

    letter: DeadLetter
    receipt_handle: str
    body: str = dataclasses.field(repr=False)


@dataclasses.dataclass(frozen=True)
class DeadLetterFilter:
    """Which DLQ messages a command acts on; every given filter must match (AND).

    Attributes:
        tasks: Task names (any of). queues: Logical queues whose DLQs are scanned
            (default all ``known``). older_than: Only messages dead-lettered longer ago.
        run_ids: Only these runs.
        tenant_ids: When not None, only runs of these tenants (never platform runs; a
            dashboard operator restricted to tenants), matched on the run's row.
        known: Every logical queue: the four, plus the catalog's declared queues
            (:meth:`~sqla_outbox.catalog.Catalog.queue_names`).
    """

    tasks: tuple[str, ...] = ()
    queues: tuple[str, ...] = ()
    older_than: dt.timedelta | None = None
    run_ids: frozenset[uuid.UUID] = frozenset()
    known: tuple[str, ...] = QUEUE_NAMES
    tenant_ids: frozenset[int] | None = None

    def scanned_queues(self) -> tuple[str, ...]:
        return tuple(q for q in self.known if not self.queues or q in self.queues)

    def matches(self, letter: DeadLetter) -> bool:
        """True when ``letter`` passes the task, age and run filters (not the queue one).

        On a :func:`resolve`-d letter, the task and the age are the run's own (its row's
        task, and how long ago it failed): a message whose run has no row matches no task
        or age filter. An unresolved letter (no database at hand) is matched on what the
        message claims.
        """
        if self.run_ids and letter.run_id not in self.run_ids:
            return False
        known = not letter.resolved or letter.run_status is not None
        if self.tasks and (not known or letter.task not in self.tasks):
            return False
        if self.tenant_ids is not None and (
            not letter.resolved or letter.run_status is None or letter.tenant_id not in self.tenant_ids
        ):
            return False
        if self.older_than is not None:
            age = letter.run_failed_age_seconds if letter.resolved else letter.age_seconds
            return known and age is not None and age >= self.older_than.total_seconds()
        return True


@dataclasses.dataclass
class DeadLetterListing:
    """Result of :func:`list_dead_letters`.

    Attributes:
        letters: Matching messages, by queue then oldest first.
        scanned: Messages received per logical queue (matching or not).
        missing_queues: DLQs that do not exist (not provisioned).
        truncated: ``max_messages`` stopped a scan, or ``limit`` cut the list.
    """

    letters: list[DeadLetter]
    scanned: dict[str, int]
    missing_queues: list[str]
    truncated: bool = False


def _string_attributes(message: Mapping[str, Any]) -> dict[str, str]:
    out: dict[str, str] = {}
    for name, value in (message.get("MessageAttributes") or {}).items():
        if isinstance(value, Mapping) and isinstance(value.get("StringValue"), str):
            out[name] = value["StringValue"]
    return out


def _int_or_none(value: Any) -> int | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    try:
        return int(str(value))
    except (TypeError, ValueError):
        return None


def _uuid_or_none(value: Any) -> uuid.UUID | None:
    try:
        return uuid.UUID(str(value)) if value is not None else None
    except ValueError:
        return None


def _body_fields(body: str) -> dict[str, Any]:
    """``run_id``/``task``/``tenant_id`` from a body that may be anything (untrusted)."""
    if len(body) > _BODY_PEEK_BYTES:
        return {}
    try:
        document = json.loads(body)
    except (ValueError, RecursionError):
        return {}
    if not isinstance(document, dict):
        return {}
    return {k: document.get(k) for k in ("run_id", "task", "tenant_id")}


def _failed_at(attributes: Mapping[str, str], system: Mapping[str, Any]) -> dt.datetime | None:
    raw = attributes.get("failed_at")
    if raw:
        try:
            parsed = dt.datetime.fromisoformat(raw)
            return parsed if parsed.tzinfo else parsed.replace(tzinfo=dt.UTC)
        except ValueError:
            pass
    sent = _int_or_none(system.get("SentTimestamp"))
    return None if sent is None else dt.datetime.fromtimestamp(sent / 1000, dt.UTC)


def origin_of(body: str, attributes: Mapping[str, str], keys: Sequence[str]) -> str:
    """``verified`` or ``unverified``: whether ``body`` carries the relay's signature (the
    ``signature`` attribute, HMAC-SHA256 under one of ``keys``; never without keys).
    :func:`resolve` may then find it is the run's envelope (``ledger``)."""
    signature = attributes.get(envelope.SIGNATURE_ATTRIBUTE)
    if keys and envelope.signature_valid(body, signature, keys):
        return ORIGIN_VERIFIED
    return ORIGIN_UNVERIFIED


def envelope_digest(body: str, *, max_bytes: int = SQS_MAX_MESSAGE_BYTES) -> str | None:
    """Identity of the envelope ``body`` carries: SHA-256 of its canonical form (SQS or the
    database may hand the same envelope back with another key order or spacing), or None
    when ``body`` is not an envelope."""
    try:
        document = envelope.encode_document(envelope.decode(body, max_bytes=max_bytes).to_document())
    except envelope.MalformedEnvelope:
        return None
    return hashlib.sha256(document.encode("utf-8", "surrogatepass")).hexdigest()


def parse_message(
    queue: str,
    dlq: str,
    message: Mapping[str, Any],
    *,
    now: dt.datetime,
    keys: Sequence[str] = (),
    max_bytes: int = SQS_MAX_MESSAGE_BYTES,
) -> Received:
    """Turn a ReceiveMessage entry of ``queue``'s DLQ into a :class:`Received`.

    Args:
        keys: Signing keys (``signing_keys``); with them, a body whose signature verifies
            is the authority for run, task and tenant (attributes are unsigned).
        max_bytes: Largest body decoded as an envelope (``max_message_bytes``).
    """
    attributes = _string_attributes(message)
    body = str(message.get("Body", ""))
    origin = origin_of(body, attributes, keys)
    if origin == ORIGIN_VERIFIED:
        from_body = _body_fields(body)
        attributes = {k: v for k, v in attributes.items() if k not in ("run_id", "task", "tenant_id")}
    else:
        from_body = _body_fields(body) if "run_id" not in attributes or "task" not in attributes else {}
    task = attributes.get("task") or from_body.get("task")
    failed_at = _failed_at(attributes, message.get("Attributes") or {})
    letter = DeadLetter(
        queue=queue,
        dlq=dlq,
        message_id=str(message["MessageId"]),
        run_id=_uuid_or_none(attributes.get("run_id") or from_body.get("run_id")),
        task=task[:_NAME_CHARS] if isinstance(task, str) else None,
        tenant_id=_int_or_none(attributes.get("tenant_id", from_body.get("tenant_id"))),
        reason=attributes.get("reason") or NO_REASON,
        error_type=attributes.get("error_type"),
        receive_count=_int_or_none(attributes.get("receive_count")),
        failed_at=failed_at,
        age_seconds=None if failed_at is None else max(0.0, (now - failed_at).total_seconds()),
        origin=origin,
        digest=envelope_digest(body, max_bytes=max_bytes),
    )
    return Received(letter=letter, receipt_handle=str(message["ReceiptHandle"]), body=body)


class DeadLetterScan:
    """Receives the visible messages of one DLQ, hidden for ``visibility_seconds`` each.

    Use as a context manager: on exit, every message received and not deleted through
    :meth:`delete` is made visible again.

    Args:
        client: boto3 SQS client.
        directory: Queue URLs.
        queue: Logical source queue whose DLQ is scanned.
        visibility_seconds: How long each received message stays hidden; must cover
            the scan and the work done on each batch.
        max_messages: Most messages received.

    Raises:
        botocore.exceptions.ClientError: From the SQS calls (a missing DLQ raises at
            the first call; see :func:`sqla_outbox.sqs.client.is_missing_queue`).
    """

    def __init__(
        self,
        client: Any,
        directory: QueueDirectory,
        queue: str,
        *,
        visibility_seconds: int,
        max_messages: int = DEFAULT_MAX_MESSAGES,
    ) -> None:
        self.client = client
        self.queue = queue
        self.dlq_name = directory.settings.dlq_url_name(queue)
        self.url = directory.dlq_url(queue)
        self.keys = directory.settings.signing_keys
        self.max_body_bytes = directory.settings.max_message_bytes
        self.visibility_seconds = visibility_seconds
        self.max_messages = max_messages
        self.truncated = False
        self._held: dict[str, str] = {}
        """message id → newest receipt handle of what was received and not deleted (no bodies:
        a scan may hold thousands of messages)."""
        self._seen: set[str] = set()

    def __enter__(self) -> DeadLetterScan:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    @property
    def received(self) -> int:
        return len(self._seen)

    def batches(self) -> Iterator[list[Received]]:
        """Yield received messages, up to 10 at a time, each message once."""
        attributes = self.client.get_queue_attributes(
            QueueUrl=self.url, AttributeNames=["ApproximateNumberOfMessages"]
        )["Attributes"]
        expected = int(attributes.get("ApproximateNumberOfMessages", 0))
        while expected > 0 and len(self._seen) < expected:
            if len(self._seen) >= self.max_messages:
                self.truncated = True
                return
            response = self.client.receive_message(
                QueueUrl=self.url,
                MaxNumberOfMessages=min(SQS_MAX_BATCH_ENTRIES, self.max_messages - len(self._seen)),
                VisibilityTimeout=self.visibility_seconds,
                WaitTimeSeconds=1,
                MessageAttributeNames=["All"],
                AttributeNames=["SentTimestamp"],
            )
            messages = response.get("Messages", [])
            if not messages:
                return
            now = dt.datetime.now(dt.UTC)
            batch: list[Received] = []
            for message in messages:
                received = parse_message(
                    self.queue, self.dlq_name, message, now=now, keys=self.keys, max_bytes=self.max_body_bytes
                )
                message_id = received.letter.message_id
                self._held[message_id] = received.receipt_handle  # newest receipt handle wins
                if message_id not in self._seen:
                    self._seen.add(message_id)
                    batch.append(received)
            if not batch:  # everything came back again: the scan outlived its visibility
                return
            yield batch

    def delete(self, messages: Sequence[Received]) -> set[str]:
        """Delete ``messages`` (DeleteMessageBatch); return the message ids deleted."""
        deleted: set[str] = set()
        for start in range(0, len(messages), SQS_MAX_BATCH_ENTRIES):
            chunk = messages[start : start + SQS_MAX_BATCH_ENTRIES]
            response = self.client.delete_message_batch(
                QueueUrl=self.url,
                Entries=[{"Id": str(i), "ReceiptHandle": self._handle(m)} for i, m in enumerate(chunk)],
            )
            for entry in response.get("Successful", []):
                message_id = chunk[int(entry["Id"])].letter.message_id
                deleted.add(message_id)
                self._held.pop(message_id, None)
            for entry in response.get("Failed", []):
                logger.warning(
                    "DLQ message not deleted",
                    extra=log_extra(
                        action="ops.dlq_delete_failed",
                        queue=self.queue,
                        message_id=chunk[int(entry["Id"])].letter.message_id,
                        error_code=entry.get("Code"),
                    ),
                )
        return deleted

    def release(self) -> None:
        """Make every held (received, not deleted) message visible again at once."""
        held = list(self._held.values())
        self._held.clear()  # receipt handles
        for start in range(0, len(held), SQS_MAX_BATCH_ENTRIES):
            chunk = held[start : start + SQS_MAX_BATCH_ENTRIES]
            try:
                self.client.change_message_visibility_batch(
                    QueueUrl=self.url,
                    Entries=[
                        {"Id": str(i), "ReceiptHandle": handle, "VisibilityTimeout": 0}
                        for i, handle in enumerate(chunk)
                    ],
                )
            except Exception as exc:  # they become visible anyway when the visibility ends
                logger.warning(
                    "could not release DLQ messages; they reappear after the visibility timeout",
                    extra=log_extra(
                        action="ops.dlq_release_failed", queue=self.queue, error_code=error_code(exc)
                    ),
                )

    def _handle(self, message: Received) -> str:
        return self._held.get(message.letter.message_id, message.receipt_handle)


_RUNS_OF = text(
    """
SELECT r.run_id, r.task, r.queue, r.tenant_id, r.status,
       EXTRACT(EPOCH FROM clock_timestamp() - r.finished_at)::float8 AS failed_age,
       COALESCE(o.envelope, p.envelope) AS envelope
FROM task_runs AS r
LEFT JOIN outbox_messages AS o ON o.run_id = r.run_id
LEFT JOIN platform_outbox_messages AS p ON p.run_id = r.run_id
WHERE r.run_id = ANY(:run_ids)
"""
).bindparams(bindparam("run_ids", type_=ARRAY(UUID(as_uuid=True))))


def resolve(
    connection: Connection, letters: Sequence[DeadLetter], *, max_bytes: int = SQS_MAX_MESSAGE_BYTES
) -> list[DeadLetter]:
    """``letters`` checked against the database: each one's run row, and its origin.

    For a letter whose run exists, ``task``, ``tenant_id``, ``run_status``, ``run_queue``
    and ``run_failed_age_seconds`` become the row's, and ``claims`` keeps what the message
    claimed otherwise; ``origin`` becomes ``ledger`` when the body is the envelope of the
    run's outbox row (canonical forms compared: :func:`envelope_digest`) and it was not
    ``verified`` already. A letter whose run has no row keeps its claims, with
    ``run_status`` None. Every letter comes back ``resolved``, in the same order.

    Args:
        connection: Any connection (reads only); runs are read 50 at a time.
        letters: From a DLQ scan.
        max_bytes: Largest envelope decoded (``max_message_bytes``).
    """
    wanted = sorted({x.run_id for x in letters if x.run_id is not None})
    rows: dict[uuid.UUID, tuple[Any, str | None]] = {}
    for start in range(0, len(wanted), _RESOLVE_CHUNK):
        chunk = wanted[start : start + _RESOLVE_CHUNK]
        for row in connection.execute(_RUNS_OF, {"run_ids": chunk}):
            held = (
                None
                if row.envelope is None
                else envelope_digest(json.dumps(row.envelope), max_bytes=max_bytes)
            )
            rows[row.run_id] = (row, held)
    out = []
    for letter in letters:
        found = rows.get(letter.run_id) if letter.run_id is not None else None
        if found is None:
            out.append(dataclasses.replace(letter, resolved=True, run_status=None))
            continue
        row, held = found
        claims = tuple(
            (name, str(claimed))
            for name, claimed, actual in (
                ("task", letter.task, row.task),
                ("tenant_id", letter.tenant_id, row.tenant_id),
                ("queue", letter.queue, row.queue),
            )
            if claimed is not None and claimed != actual
        )
        origin = letter.origin
        if origin != ORIGIN_VERIFIED:
            origin = ORIGIN_LEDGER if held is not None and letter.digest == held else ORIGIN_UNVERIFIED
        out.append(
            dataclasses.replace(
                letter,
                task=str(row.task),
                tenant_id=row.tenant_id,
                run_status=str(row.status),
                run_queue=str(row.queue),
                run_failed_age_seconds=None if row.failed_age is None else max(0.0, float(row.failed_age)),
                claims=claims,
                origin=origin,
                resolved=True,
            )
        )
    return out


def finish(
    listing: DeadLetterListing,
    filters: DeadLetterFilter,
    *,
    connection: Connection | None,
    limit: int | None,
    max_bytes: int = SQS_MAX_MESSAGE_BYTES,
) -> DeadLetterListing:
    """Resolve (with ``connection``), filter, order (by queue, oldest first) and cut a
    listing whose letters were gathered unfiltered; see :func:`list_dead_letters`."""
    letters = listing.letters
    if connection is not None:
        letters = resolve(connection, letters, max_bytes=max_bytes)
    letters = [x for x in letters if filters.matches(x)]
    order = {queue: n for n, queue in enumerate(filters.known)}
    letters.sort(key=lambda x: (order.get(x.queue, len(order)), -(x.age_seconds or 0.0)))
    if limit is not None and len(letters) > limit:
        letters, listing.truncated = letters[:limit], True
    listing.letters = letters
    return listing


def list_dead_letters(
    client: Any,
    settings: OutboxSettings,
    filters: DeadLetterFilter,
    *,
    connection: Connection | None = None,
    limit: int | None = None,
    visibility_seconds: int = LIST_VISIBILITY_SECONDS,
    max_messages: int = DEFAULT_MAX_MESSAGES,
) -> DeadLetterListing:
    """The DLQ messages matching ``filters``; nothing is deleted.

    Args:
        client: boto3 SQS client.
        settings: Queue names (``queue_prefix``), ``signing_keys``, ``max_message_bytes``.
        filters: See :class:`DeadLetterFilter`.
        connection: When given, every message is :func:`resolve`-d against the database
            (its run's row and its origin) before the filters apply, so they match the
            run's own task and failure time; without one, only the messages' claims can be
            matched and no origin is ``ledger``.
        limit: Most messages returned (after filtering; oldest kept first per queue).
        visibility_seconds: How long messages stay hidden during the scan.
        max_messages: Most messages received per DLQ.

    Raises:
        botocore.exceptions.ClientError: SQS failed (a missing DLQ is reported in
            :attr:`DeadLetterListing.missing_queues` instead).
    """
    directory = QueueDirectory(client, settings)
    listing = DeadLetterListing(letters=[], scanned={}, missing_queues=[])
    for queue in filters.scanned_queues():
        try:
            with DeadLetterScan(
                client, directory, queue, visibility_seconds=visibility_seconds, max_messages=max_messages
            ) as scan:
                letters = [r.letter for batch in scan.batches() for r in batch]
                listing.scanned[queue] = scan.received
                listing.truncated = listing.truncated or scan.truncated
        except Exception as exc:
            if not is_missing_queue(exc):
                raise
            listing.missing_queues.append(settings.dlq_url_name(queue))
            continue
        listing.letters.extend(letters)
    return finish(listing, filters, connection=connection, limit=limit, max_bytes=settings.max_message_bytes)


# --- the ledger's view: dead-lettered runs, read without receiving anything ----------------
@dataclasses.dataclass(frozen=True)
class LedgerLetter:
    """A run the ledger says a worker dead-lettered: its ``task_runs`` row is ``failed``
    with ``dead_lettered_at`` set. Read from the database only, so two operators reading
    at once see the same list (receiving from a DLQ hides each message from every other
    reader for its visibility timeout: SQS ReceiveMessage).

    Attributes:
        run_id, task, queue, tenant_id, attempts: The run's row.
        reason: The worker's verdict (``permanent-error``, ``retries-exhausted``,
            ``receive-limit``, ...), from the run's last ``failed`` trail row; None if it
            has none.
        error_type / error: The run's last error (``last_error_type``, ``last_error``).
        dead_lettered_at: When the worker dead-lettered it (UTC).
        age_seconds: Now minus ``dead_lettered_at`` (database clock), seconds.
    """

    run_id: uuid.UUID
    task: str
    queue: str
    tenant_id: int | None
    attempts: int
    reason: str | None
    error_type: str | None
    error: str | None
    dead_lettered_at: dt.datetime
    age_seconds: float


@dataclasses.dataclass(frozen=True)
class LedgerGroup:
    """Dead-lettered runs of one queue, task, reason (the worker's verdict) and error type:
    how many, and the oldest's age (seconds)."""

    queue: str
    task: str
    reason: str | None
    error_type: str | None
    runs: int
    oldest_age_seconds: float


_REASON = (
    "(SELECT t.detail ->> 'reason' FROM task_run_trail AS t WHERE t.run_id = r.run_id "
    "AND t.status = 'failed' AND t.detail ? 'reason' ORDER BY t.id DESC LIMIT 1)"
)
"""The worker's verdict of a failed run: ``detail.reason`` of its last ``failed`` trail row
that has one (the dead-lettering row after it carries ``dead_lettered`` and ``dlq``); a
backward walk of the ``(run_id, id)`` index over the run's few rows."""


def _ledger_where(filters: DeadLetterFilter) -> tuple[str, dict[str, Any]]:
    """The WHERE clause selecting the dead-lettered runs ``filters`` match (the run's own
    task, queue, tenant and failure time, as a requeue matches them)."""
    clauses = ["r.status = 'failed'", "r.dead_lettered_at IS NOT NULL", "r.queue = ANY(:queues)"]
    params: dict[str, Any] = {"queues": list(filters.scanned_queues())}
    if filters.tasks:
        clauses.append("r.task = ANY(:tasks)")
        params["tasks"] = list(filters.tasks)
    if filters.run_ids:
        clauses.append("r.run_id = ANY(CAST(:run_ids AS uuid[]))")
        params["run_ids"] = [str(r) for r in sorted(filters.run_ids)]
    if filters.tenant_ids is not None:
        clauses.append("r.tenant_id = ANY(:tenant_ids)")
        params["tenant_ids"] = sorted(filters.tenant_ids)
    if filters.older_than is not None:
        clauses.append("r.finished_at <= clock_timestamp() - make_interval(secs => :older_than)")
        params["older_than"] = filters.older_than.total_seconds()
    return " AND ".join(clauses), params


def dead_lettered_runs(
    connection: Connection, filters: DeadLetterFilter, *, limit: int | None = None
) -> list[LedgerLetter]:
    """The dead-lettered runs ``filters`` match, oldest first, from ``task_runs`` alone.

    A DLQ message that no worker verdict put there (moved by the SQS redrive policy after
    ``maxReceiveCount`` receives, or sent by hand) has no such row: compare the DLQ's
    depth (:func:`dlq_depths`) to see how many there are.

    Args:
        connection: Any connection (reads only).
        filters: ``queues``, ``tasks``, ``run_ids``, ``tenant_ids``, ``older_than`` (how
            long ago the run failed).
        limit: Most runs returned; None for all.
    """
    where, params = _ledger_where(filters)
    statement = (
        f"SELECT r.run_id, r.task, r.queue, r.tenant_id, r.attempts, {_REASON} AS reason, "
        "r.last_error_type, r.last_error, "
        "r.dead_lettered_at, EXTRACT(EPOCH FROM clock_timestamp() - r.dead_lettered_at)::float8 AS age "
        f"FROM task_runs AS r WHERE {where} ORDER BY r.dead_lettered_at, r.run_id"
        + (" LIMIT :limit" if limit is not None else "")
    )
    if limit is not None:
        params["limit"] = limit
    return [
        LedgerLetter(
            run_id=row.run_id,
            task=str(row.task),
            queue=str(row.queue),
            tenant_id=row.tenant_id,
            attempts=int(row.attempts),
            reason=row.reason,
            error_type=row.last_error_type,
            error=row.last_error,
            dead_lettered_at=row.dead_lettered_at,
            age_seconds=max(0.0, float(row.age)),
        )
        for row in connection.execute(text(statement), params)
    ]


def dead_lettered_groups(connection: Connection, filters: DeadLetterFilter) -> list[LedgerGroup]:
    """The dead-lettered runs ``filters`` match, counted by queue, task, reason and error
    type (largest groups first)."""
    where, params = _ledger_where(filters)
    statement = (
        f"SELECT r.queue, r.task, {_REASON} AS reason, r.last_error_type, count(*) AS runs, "
        "EXTRACT(EPOCH FROM clock_timestamp() - min(r.dead_lettered_at))::float8 AS oldest "
        f"FROM task_runs AS r WHERE {where} GROUP BY 1, 2, 3, 4 "
        "ORDER BY runs DESC, 1, 2, 3 NULLS FIRST, 4 NULLS FIRST"
    )
    return [
        LedgerGroup(
            str(row.queue),
            str(row.task),
            row.reason,
            row.last_error_type,
            int(row.runs),
            max(0.0, float(row.oldest)),
        )
        for row in connection.execute(text(statement), params)
    ]


def dlq_depths(client: Any, settings: OutboxSettings, queues: Sequence[str]) -> dict[str, int | None]:
    """Each DLQ's message count as SQS reports it (``ApproximateNumberOfMessages`` plus
    ``ApproximateNumberOfMessagesNotVisible``, from GetQueueAttributes: nothing is
    received, so no reader's view changes). Approximate (SQS). None for a DLQ that does not
    exist.

    Raises:
        botocore.exceptions.ClientError: SQS failed otherwise.
    """
    directory = QueueDirectory(client, settings)
    depths: dict[str, int | None] = {}
    for queue in queues:
        try:
            attributes = client.get_queue_attributes(
                QueueUrl=directory.dlq_url(queue),
                AttributeNames=["ApproximateNumberOfMessages", "ApproximateNumberOfMessagesNotVisible"],
            )["Attributes"]
        except Exception as exc:
            if not is_missing_queue(exc):
                raise
            depths[queue] = None
            continue
        depths[queue] = int(attributes.get("ApproximateNumberOfMessages", 0)) + int(
            attributes.get("ApproximateNumberOfMessagesNotVisible", 0)
        )
    return depths
