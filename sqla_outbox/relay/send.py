"""Sending claimed rows to SQS with SendMessageBatch.

Rows are grouped by queue and packed in claim order into calls of at most 10 entries and
at most ``max_message_bytes`` of messages (SQS SendMessageBatch quotas: 10 entries; the
sum of the message sizes within the maximum message size). The calls run concurrently on
a small thread pool (``relay_send_concurrency``), so different queues and consecutive
batches of one queue are in flight at once.

Two kinds of failure, both reported per row and never raised:

* an entry in the response's ``Failed`` list (SQS refused that message);
* a whole-call failure (endpoint down, throttling, credentials, missing queue), which
  fails every row of that call.

The relay then counts an attempt and backs the row off; rows in other calls are not
affected.
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
from sqla_outbox.sqs.client import SQS_MAX_BATCH_ENTRIES, QueueDirectory, error_code, is_missing_queue

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class SendResult:
    """Outcome of sending a set of rows.

    Attributes:
        sent: Rows SQS accepted.
        failed: ``(row, error_code)`` for rows SQS did not accept.
    """

    sent: list[ClaimedRow] = dataclasses.field(default_factory=list)
    failed: list[tuple[ClaimedRow, str]] = dataclasses.field(default_factory=list)

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
    entry larger than ``max_bytes`` travels alone (SQS then refuses it, and only it).
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
        settings: Uses ``max_message_bytes`` and ``relay_send_concurrency``.
    """

    def __init__(self, client: Any, directory: QueueDirectory, settings: OutboxSettings) -> None:
        self.client = client
        self.directory = directory
        self.max_bytes = settings.max_message_bytes
        self.signing_key = settings.signing_keys[0] if settings.signing_keys else None
        self._pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=settings.relay_send_concurrency, thread_name_prefix="sqla-outbox-send"
        )

    def send(self, rows: Sequence[ClaimedRow]) -> SendResult:
        """Send ``rows``; every row ends up in ``sent`` or ``failed``."""
        by_queue: dict[str, list[Entry]] = {}
        for row in rows:
            by_queue.setdefault(row.queue, []).append(build_entry(row, self.signing_key))
        calls = [
            (queue, batch)
            for queue, entries in by_queue.items()
            for batch in pack(entries, max_bytes=self.max_bytes)
        ]
        result = SendResult()
        if len(calls) == 1:
            result.merge(self._send_batch(*calls[0]))
            return result
        for outcome in self._pool.map(lambda call: self._send_batch(*call), calls):
            result.merge(outcome)
        return result

    def _send_batch(self, queue: str, batch: list[Entry]) -> SendResult:
        result = SendResult()
        metrics.RELAY_BATCH_SIZE.observe(len(batch))
        try:
            response = self.client.send_message_batch(
                QueueUrl=self.directory.url(queue),
                Entries=[
                    {"Id": str(i), "MessageBody": e.body, "MessageAttributes": e.attributes}
                    for i, e in enumerate(batch)
                ],
            )
        except Exception as exc:
            code = error_code(exc)
            if is_missing_queue(exc):
                self.directory.forget(queue)
            logger.warning(
                "send failed",
                extra=log_extra(action="relay.send_failed", queue=queue, error_code=code, rows=len(batch)),
            )
            result.failed.extend((e.row, code) for e in batch)
            metrics.RELAY_FAILED.labels(queue, code).inc(len(batch))
            return result
        accepted = {s["Id"] for s in response.get("Successful", [])}
        refused = {f["Id"]: f.get("Code", "Failed") for f in response.get("Failed", [])}
        for i, entry in enumerate(batch):
            if str(i) in accepted:  # only what SQS says it accepted counts as sent
                result.sent.append(entry.row)
            else:
                code = refused.get(str(i), "NotAcknowledged")
                result.failed.append((entry.row, code))
                logger.warning(
                    "entry refused",
                    extra=log_extra(
                        action="relay.entry_failed",
                        queue=queue,
                        run_id=str(entry.row.run_id),
                        error_code=code,
                    ),
                )
                metrics.RELAY_FAILED.labels(queue, code).inc()
        metrics.RELAY_SENT.labels(queue).inc(len(accepted))
        return result

    def close(self) -> None:
        self._pool.shutdown(wait=True)
