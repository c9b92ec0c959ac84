"""What the worker tells SQS once it has decided: delete, retry later, dead-letter, return.

* **ack** — DeleteMessage: the run succeeded (or the copy is of a finished run).
* **retry** — ChangeMessageVisibility to the backoff: the message comes back by itself,
  and no worker slot is held meanwhile.
* **dead-letter** — SendMessage to the queue's DLQ with the original body, the original
  ``run_id``/``task``/``tenant_id`` attributes and the relay's ``signature`` (the body's
  proof of origin, which ``dlq requeue`` verifies), plus the error context as message
  attributes, then DeleteMessage from the source.
* **return** — ChangeMessageVisibility 0: visible again at once (shutdown).

How long a retry waits is not decided here: :mod:`sqla_outbox.lifecycle.verdict` and
:mod:`sqla_outbox.lifecycle.retry` decide, within what SQS still allows (a message stays
hidden at most 12 hours after its first receive:
:meth:`~sqla_outbox.worker.flight.InFlight.hideable_seconds`).
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping
from typing import Any

from sqla_outbox import charsets, envelope
from sqla_outbox.sqs.client import QueueDirectory, is_stale_handle

SQS_MAX_MESSAGE_ATTRIBUTES = 10
"""A message carries at most 10 message attributes (SQS quota)."""

ORIGIN_ATTRIBUTES = ("run_id", "task", "tenant_id", envelope.SIGNATURE_ATTRIBUTE)
"""Copied from the message the relay sent. ``signature`` (HMAC of the body, present when
signing keys are set) stays with the body, so a DLQ message keeps its proof of origin."""

CONTEXT_ATTRIBUTES = ("reason", "failed_at", "receive_count", "source_queue", "error_type", "error_message")
"""Added by the worker. The worker id is not among them (the run's trail and the worker's
log line name it): 4 origin + 6 context attributes is SQS's limit of 10."""


class Outcomes:
    """SQS side of the worker's decisions (blocking calls; run them off the event loop).

    Args:
        client: boto3 SQS client.
        directory: Queue URLs.
        max_message_bytes: DLQ messages are kept within this size.
    """

    def __init__(self, client: Any, directory: QueueDirectory, *, max_message_bytes: int) -> None:
        self.client = client
        self.directory = directory
        self.max_message_bytes = max_message_bytes

    def ack(self, queue: str, receipt_handle: str) -> None:
        """Delete the message (with a stale handle, SQS ignores it; the copy comes back
        and is acknowledged then)."""
        self.client.delete_message(QueueUrl=self.directory.url(queue), ReceiptHandle=receipt_handle)

    def retry_after(self, queue: str, receipt_handle: str, seconds: float) -> bool:
        """Make the message visible again in ``seconds`` (whole seconds, SQS API).

        Returns:
            False when SQS refused it because this receipt handle can no longer change the
            message (received again elsewhere since, deleted, or past its 12-hour ceiling:
            SQS ChangeMessageVisibility answers ``InvalidParameterValue`` /
            ``ReceiptHandleIsInvalid`` / ``MessageNotInflight``); the caller then must not
            count on the message coming back.

        Raises:
            botocore.exceptions.ClientError and transport errors: any other failure.
        """
        try:
            self.client.change_message_visibility(
                QueueUrl=self.directory.url(queue),
                ReceiptHandle=receipt_handle,
                VisibilityTimeout=round(seconds),
            )
        except Exception as exc:
            if is_stale_handle(exc):
                return False
            raise
        return True

    def give_back(self, queue: str, receipt_handle: str) -> None:
        """Make the message visible again at once."""
        self.retry_after(queue, receipt_handle, 0)

    def dead_letter(
        self,
        queue: str,
        receipt_handle: str,
        body: str,
        attributes: Mapping[str, Mapping[str, str]],
        context: Mapping[str, str],
    ) -> str:
        """Send ``body`` to ``queue``'s DLQ with ``context`` attributes, then delete it.

        The original attributes of :data:`ORIGIN_ATTRIBUTES` (run_id, task, tenant_id and
        the relay's signature) are kept; the context of :data:`CONTEXT_ATTRIBUTES`
        (reason, failed_at, receive_count, source_queue, error_type, error_message) is
        added, the error message truncated so the message stays within the size limit:
        at most 10 attributes (SQS quota), origin first. Every String value goes through
        :func:`sqla_outbox.charsets.for_sqs` (SQS refuses characters outside the XML set
        and empty values). A body too large for the DLQ is replaced by a short JSON summary
        (which then carries no signature: it is not an envelope).

        Returns:
            The DLQ's URL.

        Raises:
            botocore.exceptions.ClientError and transport errors: nothing was deleted;
            the message comes back and the permanent path is taken again.
        """
        dlq_url = self.directory.dlq_url(queue)
        message_attributes: dict[str, dict[str, str]] = {}
        for name in ORIGIN_ATTRIBUTES:
            value = attributes.get(name, {}).get("StringValue")
            kind = attributes.get(name, {}).get("DataType", "String")
            if isinstance(value, str) and value and kind in ("String", "Number"):
                message_attributes[name] = {"DataType": kind, "StringValue": charsets.for_sqs(value[:256])}
        for key in CONTEXT_ATTRIBUTES:
            # exception messages and type names come from handlers: SQS takes only the XML
            # character set in String attribute values (and no empty value)
            value = charsets.for_sqs(str(context.get(key) or ""))
            if value:
                message_attributes[key] = {"DataType": "String", "StringValue": value}
        size = envelope.message_size_bytes(body, message_attributes)
        if size > self.max_message_bytes and "error_message" in message_attributes:
            text = message_attributes["error_message"]["StringValue"]
            keep = max(0, len(text) - (size - self.max_message_bytes) - 16)
            message_attributes["error_message"]["StringValue"] = text[:keep] + "…"
            size = envelope.message_size_bytes(body, message_attributes)
        if size > self.max_message_bytes:
            message_attributes.pop(envelope.SIGNATURE_ATTRIBUTE, None)
            body = envelope.encode_document(
                {
                    "sqla_outbox_dlq_summary": True,
                    "reason": context.get("reason"),
                    "original_size_bytes": len(body),
                }
            )
        self.client.send_message(QueueUrl=dlq_url, MessageBody=body, MessageAttributes=message_attributes)
        self.ack(queue, receipt_handle)
        return dlq_url


def utc_now_text() -> str:
    return dt.datetime.now(dt.UTC).isoformat(timespec="milliseconds")
