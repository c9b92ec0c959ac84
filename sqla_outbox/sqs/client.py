"""boto3 SQS client creation and queue-URL lookup.

Credentials come from boto3's standard chain (environment, profile, instance role), the
region from ``AWS_REGION`` first, then boto3's chain (:func:`aws_region`);
``settings.sqs_endpoint_url`` points at LocalStack or a moto server. When no region is
configured but an endpoint URL is, ``us-east-1`` is assumed (local emulators ignore
it); against real AWS a missing region is an error.
"""

from __future__ import annotations

import os
import threading
from typing import Any

import boto3
import botocore.config
import botocore.exceptions

from sqla_outbox import errors, types
from sqla_outbox.config import OutboxSettings

SQS_MAX_BATCH_ENTRIES = 10
"""SendMessageBatch / DeleteMessageBatch / ChangeMessageVisibilityBatch entry limit (SQS quota)."""

SQS_MAX_VISIBILITY_SECONDS = types.SQS_MAX_VISIBILITY_SECONDS
"""Largest visibility timeout SQS accepts: 12 hours (SQS quota; :mod:`sqla_outbox.types`)."""


def aws_region(session: Any) -> str | None:
    """The AWS region to use: ``AWS_REGION`` when set, else what boto3 resolves
    (``AWS_DEFAULT_REGION``, then the profile's ``region`` in ``~/.aws/config``), else None.

    The AWS SDKs and the AWS CLI v2 read ``AWS_REGION`` first (the AWS SDKs and Tools
    reference guide, "AWS Region"); boto3 reads only ``AWS_DEFAULT_REGION`` and the profile,
    so without this an exported ``AWS_REGION`` was ignored and queues landed in the
    profile's region.

    Args:
        session: A ``boto3.session.Session``.
    """
    return os.environ.get("AWS_REGION", "").strip() or session.region_name


def make_client(
    settings: OutboxSettings,
    *,
    max_pool_connections: int = 20,
    read_timeout_seconds: float = 30.0,
    max_attempts: int = 3,
) -> Any:
    """Create a boto3 SQS client from the standard credential/region chain.

    Args:
        settings: Uses ``sqs_endpoint_url``.
        max_pool_connections: HTTP connection pool size (concurrent calls).
        read_timeout_seconds: Socket read timeout; must exceed the long-poll wait (20 s).
        max_attempts: botocore "standard" retry mode attempts (1 = no retries).

    Raises:
        ConfigurationError: No region is configured for real AWS.
    """
    session = boto3.session.Session()
    region = aws_region(session)
    if region is None:
        if settings.sqs_endpoint_url is None:
            raise errors.ConfigurationError(
                "no AWS region configured; set AWS_REGION (or AWS_DEFAULT_REGION, or a region "
                "in the AWS profile)",
                option="AWS_REGION",
            )
        region = "us-east-1"
    config = botocore.config.Config(
        connect_timeout=5,
        read_timeout=read_timeout_seconds,
        retries={"mode": "standard", "max_attempts": max_attempts},
        max_pool_connections=max_pool_connections,
    )
    return session.client("sqs", region_name=region, endpoint_url=settings.sqs_endpoint_url, config=config)


def error_code(exc: BaseException) -> str:
    """Short code for an SQS/transport failure (``AWS.SimpleQueueService.NonExistentQueue``,
    ``EndpointConnectionError``, ...)."""
    if isinstance(exc, botocore.exceptions.ClientError):
        return str(exc.response.get("Error", {}).get("Code", "ClientError"))
    return type(exc).__name__


def error_message(exc: BaseException) -> str:
    """SQS's error message for ``exc`` (``Error.Message`` of a ClientError), else the
    exception's first line; at most 1,000 characters."""
    if isinstance(exc, botocore.exceptions.ClientError):
        message = str(exc.response.get("Error", {}).get("Message", ""))
    else:
        lines = str(exc).strip().splitlines()
        message = lines[0] if lines else ""
    return message[:1000]


def is_unreachable(exc: BaseException) -> bool:
    """True when ``exc`` says SQS could not be reached or called at all: no connection to
    the endpoint, or no credentials in boto3's chain (the CLI reports these as exit 3)."""
    return isinstance(
        exc, (botocore.exceptions.EndpointConnectionError, botocore.exceptions.NoCredentialsError)
    )


STALE_HANDLE_CODES = frozenset(
    {
        "ReceiptHandleIsInvalid",
        "InvalidParameterValue",
        "MessageNotInflight",
        "AWS.SimpleQueueService.MessageNotInflight",
    }
)
"""What ChangeMessageVisibility answers for a receipt handle that can no longer change its
message: a later receive made it stale, the message was deleted, or the new visibility
would end past 12 hours after the first receive (SQS ChangeMessageVisibility)."""


def is_stale_handle(exc: BaseException) -> bool:
    """True when ``exc`` is SQS refusing a visibility change for a stale receipt handle
    (:data:`STALE_HANDLE_CODES`)."""
    return error_code(exc) in STALE_HANDLE_CODES


def is_missing_queue(exc: BaseException) -> bool:
    """True when ``exc`` says the queue does not exist."""
    return error_code(exc) in {
        "AWS.SimpleQueueService.NonExistentQueue",
        "QueueDoesNotExist",
        "NonExistentQueue",
    }


class QueueDirectory:
    """Logical queue name → SQS queue URL (and DLQ URL), looked up once and cached.

    Thread-safe. A lookup failure is not cached, so a queue provisioned later is found.
    """

    def __init__(self, client: Any, settings: OutboxSettings) -> None:
        self.client = client
        self.settings = settings
        self._urls: dict[str, str] = {}
        self._lock = threading.Lock()

    def url(self, queue: str) -> str:
        """URL of the source queue for ``queue`` (a default or declared logical queue).

        Raises:
            botocore.exceptions.ClientError: The queue does not exist (run provisioning).
        """
        return self._lookup(self.settings.queue_url_name(queue))

    def dlq_url(self, queue: str) -> str:
        """URL of the dead-letter queue for ``queue``."""
        return self._lookup(self.settings.dlq_url_name(queue))

    def forget(self, queue: str) -> None:
        """Drop cached URLs of ``queue`` (after a NonExistentQueue error)."""
        with self._lock:
            self._urls.pop(self.settings.queue_url_name(queue), None)
            self._urls.pop(self.settings.dlq_url_name(queue), None)

    def logical_name(self, url: str) -> str | None:
        """The logical queue whose source queue has ``url``, if known."""
        with self._lock:
            names = [name for name, known in self._urls.items() if known == url]
        for name in names:
            queue = name.removeprefix(self.settings.queue_prefix)
            if name.startswith(self.settings.queue_prefix) and not queue.endswith("-dlq"):
                return queue
        return None

    def _lookup(self, name: str) -> str:
        with self._lock:
            cached = self._urls.get(name)
        if cached is not None:
            return cached
        url = str(self.client.get_queue_url(QueueName=name)["QueueUrl"])
        with self._lock:
            self._urls[name] = url
        return url


def visible_messages(client: Any, directory: QueueDirectory, queue: str) -> int:
    """Messages of ``queue`` waiting to be received (``ApproximateNumberOfMessages``:
    visible, not in flight, not delayed), as the relay's depth bound reads it.

    Raises:
        botocore.exceptions.ClientError / BotoCoreError: The call failed.
    """
    answer = client.get_queue_attributes(
        QueueUrl=directory.url(queue), AttributeNames=["ApproximateNumberOfMessages"]
    )
    return int(answer.get("Attributes", {}).get("ApproximateNumberOfMessages", 0))
