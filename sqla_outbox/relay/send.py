"""Sending claimed rows to SQS with SendMessageBatch.

Rows are grouped by queue and packed in claim order into calls of at most 10 entries and
at most ``max_message_bytes`` of messages (SQS SendMessageBatch quotas: 10 entries; the
sum of the message sizes within the maximum message size). The calls run concurrently on
a small thread pool (``relay_send_concurrency``), so different queues and consecutive
batches of one queue are in flight at once.

Every row ends up sent or failed; failures are reported per row, never raised, and each
carries the SQS error code and message and one of three kinds (:class:`SendFailure`):

* ``refused`` — SQS refused *this message* and would refuse it again: an entry in the
  response's ``Failed`` list with ``SenderFault`` true, or a call of this entry alone
  failing with a message-level code (:data:`MESSAGE_REFUSALS`: ``InvalidMessageContents``,
  ``BatchRequestTooLong``, ``InvalidParameterValue``, ...). The relay parks it at once.
* ``entry`` — SQS did not take this message but did not blame the sender (an entry
  failed with ``SenderFault`` false, or not acknowledged at all). The relay retries it
  with backoff and parks it after ``relay_max_send_attempts``.
* ``call`` — the whole call failed for a reason no message causes (endpoint down,
  throttling, credentials, a missing queue, an SQS server error). The relay retries with
  backoff and never parks for it: the rows resume by themselves when the outage ends.

A call of several entries failing with a message-level code (say ``BatchRequestTooLong``
because the queue's ``MaximumMessageSize`` is below ``max_message_bytes``) is retried at
once entry by entry, so one message SQS refuses never holds back the others.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
from collections.abc import Iterator, Sequence
from typing import Any, Protocol

from sqla_outbox import envelope, metrics
from sqla_outbox.config import OutboxSettings
from sqla_outbox.logging import log_extra
from sqla_outbox.relay.claim import ClaimedRow
from sqla_outbox.sqs.client import (
    SQS_MAX_BATCH_ENTRIES,
    QueueDirectory,
    error_code,
    error_message,
    is_missing_queue,
)

logger = logging.getLogger(__name__)


MESSAGE_REFUSALS = frozenset(
    {
        "InvalidMessageContents",
        "BatchRequestTooLong",
        "InvalidParameterValue",
        "InvalidParameterCombination",
        "InvalidAttributeName",
        "InvalidAttributeValue",
        "MessageTooLong",
        "UnsupportedOperation",
    }
)
"""Error codes that, on a call carrying one message, mean SQS refuses that message (SQS
API Reference, SendMessageBatch "Errors" and SendMessage "Errors")."""

TOO_LARGE = "MessageTooLargeForRelay"
"""Our own code for a message above the relay's ``max_message_bytes`` (never sent)."""

REFUSED = "refused"
ENTRY = "entry"
CALL = "call"


@dataclasses.dataclass(frozen=True)
class SendFailure:
    """Why a row was not sent.

    Attributes:
        code: SQS error code (``InvalidMessageContents``, ...), or the transport
            exception's name (``EndpointConnectionError``).
        message: SQS's error message (or the exception's first line).
        kind: ``refused`` (SQS will never take this message: park it), ``entry`` (this
            message was not taken; retry) or ``call`` (the call failed for everyone; retry).
    """

    code: str
    message: str
    kind: str

    @property
    def text(self) -> str:
        """``<code>: <message>``, as stored in the outbox row's ``last_error``."""
        return f"{self.code}: {self.message}" if self.message else self.code


@dataclasses.dataclass
class SendResult:
    """Outcome of sending a set of rows.

    Attributes:
        sent: Rows SQS accepted.
        failed: ``(row, failure)`` for rows SQS did not accept.
    """

    sent: list[ClaimedRow] = dataclasses.field(default_factory=list)
    failed: list[tuple[ClaimedRow, SendFailure]] = dataclasses.field(default_factory=list)

    def merge(self, other: SendResult) -> None:
        self.sent.extend(other.sent)
        self.failed.extend(other.failed)


class Sender(Protocol):
    """What the relay sends rows with (SQS in production; benchmarks inject their own)."""

    def send(self, rows: Sequence[ClaimedRow]) -> SendResult: ...

    def close(self) -> None: ...


@dataclasses.dataclass
class Entry:
    """One SendMessageBatch entry built from a row."""

    row: ClaimedRow
    body: str
    attributes: dict[str, dict[str, str]]
    size_bytes: int


def build_entry(row: ClaimedRow, signing_key: str | None = None) -> Entry:
    """The SQS message for ``row``: compact JSON body plus run_id/task/tenant attributes,
    and the body's HMAC signature when a signing key is configured."""
    body = envelope.encode_document(row.envelope)
    attributes = envelope.message_attributes(row.run_id, str(row.envelope.get("task", "")), row.tenant_id)
    if signing_key:
        attributes[envelope.SIGNATURE_ATTRIBUTE] = {
            "DataType": "String",
            "StringValue": envelope.sign(body, signing_key),
        }
    return Entry(row, body, attributes, envelope.message_size_bytes(body, attributes))


def pack(entries: Sequence[Entry], *, max_bytes: int) -> Iterator[list[Entry]]:
    """Split one queue's entries, in order, into SendMessageBatch-sized lists.

    Each list has at most 10 entries and at most ``max_bytes`` in total, except that an
    entry larger than ``max_bytes`` travels alone (:class:`SqsSender` refuses such an entry
    before packing; SQS would refuse it, and only it).
    """
    batch: list[Entry] = []
    size = 0
    for entry in entries:
        if batch and (len(batch) == SQS_MAX_BATCH_ENTRIES or size + entry.size_bytes > max_bytes):
            yield batch
            batch, size = [], 0
        batch.append(entry)
        size += entry.size_bytes
    if batch:
        yield batch


class SqsSender:
    """Sends rows with SendMessageBatch, several calls at once.

    Args:
        client: boto3 SQS client (thread-safe).
        directory: Resolves logical queue names to URLs.
        settings: Uses ``max_message_bytes``, ``relay_send_concurrency`` and
            ``relay_fairness`` (MessageGroupId = tenant on every message).
    """

    def __init__(self, client: Any, directory: QueueDirectory, settings: OutboxSettings) -> None:
        self.client = client
        self.directory = directory
        self.max_bytes = settings.max_message_bytes
        self.signing_key = settings.signing_keys[0] if settings.signing_keys else None
        self.message_groups = settings.relay_fairness
        self._pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=settings.relay_send_concurrency, thread_name_prefix="sqla-outbox-send"
        )

    def send(self, rows: Sequence[ClaimedRow]) -> SendResult:
        """Send ``rows``; every row ends up in ``sent`` or ``failed``."""
        by_queue: dict[str, list[Entry]] = {}
        result = SendResult()
        for row in rows:
            entry = build_entry(row, self.signing_key)
            if entry.size_bytes > self.max_bytes:
                result.failed.append((row, self._too_large(entry)))
                continue
            by_queue.setdefault(row.queue, []).append(entry)
        calls = [
            (queue, batch)
            for queue, entries in by_queue.items()
            for batch in pack(entries, max_bytes=self.max_bytes)
        ]
        if len(calls) == 1:
            result.merge(self._send_batch(*calls[0]))
            return result
        for outcome in self._pool.map(lambda call: self._send_batch(*call), calls):
            result.merge(outcome)
        return result

    def _too_large(self, entry: Entry) -> SendFailure:
        """A message above this relay's ``max_message_bytes``: refused here, never sent.

        The dispatching process allowed it, so its ``max_message_bytes`` is larger than
        this relay's; a worker with the relay's setting would refuse the message unexecuted
        (as ``malformed-envelope:too-large``) and the run would stay ``queued``. Parking it
        makes the mismatch visible at once, as a ``failed`` run with this error.
        """
        logger.warning(
            "entry refused",
            extra=log_extra(
                action="relay.entry_failed",
                queue=entry.row.queue,
                run_id=str(entry.row.run_id),
                error_code=TOO_LARGE,
                size_bytes=entry.size_bytes,
            ),
        )
        metrics.RELAY_FAILED.labels(entry.row.queue, TOO_LARGE).inc()
        return SendFailure(
            TOO_LARGE,
            f"the message is {entry.size_bytes} bytes, above this relay's max_message_bytes "
            f"({self.max_bytes}); the application, the relay and the workers must share one "
            "max_message_bytes (and provision the queues with it); fix the setting, then "
            "`outbox unpark`",
            REFUSED,
        )

    def _send_batch(self, queue: str, batch: list[Entry]) -> SendResult:
        result = SendResult()
        metrics.RELAY_BATCH_SIZE.observe(len(batch))
        try:
            response = self.client.send_message_batch(
                QueueUrl=self.directory.url(queue),
                Entries=[self._entry(i, e) for i, e in enumerate(batch)],
            )
        except Exception as exc:
            code = error_code(exc)
            if code in MESSAGE_REFUSALS and len(batch) > 1:
                # one message spoils the call for all: send each alone, so only it fails
                for entry in batch:
                    result.merge(self._send_batch(queue, [entry]))
                return result
            if is_missing_queue(exc):
                self.directory.forget(queue)
            kind = REFUSED if code in MESSAGE_REFUSALS else CALL
            failure = SendFailure(code, error_message(exc), kind)
            fields: dict[str, Any] = {"queue": queue, "error_code": code, "rows": len(batch)}
            if kind == REFUSED:
                fields["run_id"] = str(batch[0].row.run_id)
            logger.warning(
                "entry refused" if kind == REFUSED else "send failed",
                extra=log_extra(
                    action="relay.entry_failed" if kind == REFUSED else "relay.send_failed", **fields
                ),
            )
            result.failed.extend((e.row, failure) for e in batch)
            metrics.RELAY_FAILED.labels(queue, code).inc(len(batch))
            return result
        accepted = {s["Id"] for s in response.get("Successful", [])}
        refused = {f["Id"]: f for f in response.get("Failed", [])}
        for i, entry in enumerate(batch):
            if str(i) in accepted:  # only what SQS says it accepted counts as sent
                result.sent.append(entry.row)
                continue
            answer = refused.get(str(i))
            if answer is None:
                failure = SendFailure("NotAcknowledged", "neither accepted nor refused by SQS", ENTRY)
            else:
                failure = SendFailure(
                    str(answer.get("Code", "Failed")),
                    str(answer.get("Message", "")),
                    REFUSED if answer.get("SenderFault") else ENTRY,
                )
            result.failed.append((entry.row, failure))
            logger.warning(
                "entry refused",
                extra=log_extra(
                    action="relay.entry_failed",
                    queue=queue,
                    run_id=str(entry.row.run_id),
                    error_code=failure.code,
                    sender_fault=failure.kind == REFUSED,
                ),
            )
            metrics.RELAY_FAILED.labels(queue, failure.code).inc()
        metrics.RELAY_SENT.labels(queue).inc(len(accepted))
        return result

    def _entry(self, index: int, entry: Entry) -> dict[str, Any]:
        out: dict[str, Any] = {
            "Id": str(index),
            "MessageBody": entry.body,
            "MessageAttributes": entry.attributes,
        }
        if self.message_groups:
            out["MessageGroupId"] = message_group(entry.row)
        return out

    def close(self) -> None:
        self._pool.shutdown(wait=True)


def message_group(row: ClaimedRow) -> str:
    """The ``MessageGroupId`` of a row's message on a standard queue: the tenant id, or
    ``platform``. SQS fair queues use it to keep one tenant's backlog from raising the
    others' dwell time; queues without fairness ignore it."""
    return "platform" if row.tenant_id is None else str(row.tenant_id)
