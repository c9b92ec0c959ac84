"""Create the queues and their dead-letter queues, idempotently, and report drift.

For each logical queue ``q`` (critical, default, bulk, maintenance, then the queues the
task catalog declares, :class:`sqla_outbox.catalog.QueueSpec`):

* ``<prefix>q-dlq`` — the dead-letter queue; messages kept 14 days (the SQS maximum),
  because a message keeps its original enqueue time when SQS moves it there (SQS
  Developer Guide, "Using dead-letter queues").
* ``<prefix>q`` — the source queue; visibility timeout from the settings
  (``visibility_timeout_<q>_seconds``; defaults critical 60 s, default 120 s, bulk
  15 min, maintenance 5 min; a declared queue's ``visibility_timeout_seconds``;
  ``queue_visibility_timeouts`` overrides either), messages kept
  ``sqs_message_retention_seconds`` or a declared queue's own (default
  14 days, the SQS maximum: a message SQS drops unreceived is lost silently), long polling
  20 s, redrive policy ``maxReceiveCount`` 7 (5 receives for the runtime plus 2 of margin;
  a declared queue's ``max_receive_count``) into its DLQ.
* ``MaximumMessageSize`` follows ``max_message_bytes``; optional SSE-SQS or SSE-KMS.

A second run changes nothing. When an existing queue's attributes differ from these,
the report lists each difference (``drift``); ``fix=True`` applies the desired values
with SetQueueAttributes.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from sqla_outbox import errors, queues
from sqla_outbox.catalog import Catalog, QueueSpec
from sqla_outbox.config import OutboxSettings
from sqla_outbox.sqs.client import is_missing_queue

SQS_QUEUE_NAME_MAX = 80
"""SQS queue names are at most 80 characters (SQS CreateQueue, QueueName)."""

DLQ_RETENTION_SECONDS = 14 * 24 * 3600
LONG_POLL_SECONDS = 20


@dataclasses.dataclass
class QueueReport:
    """What provisioning found or did for one SQS queue.

    Attributes:
        name: SQS queue name. queue: Logical queue. dead_letter: True for a DLQ.
        action: ``created``, ``unchanged``, ``drift`` (differences left alone) or
            ``updated`` (differences fixed).
        differences: Attribute → ``{"expected": ..., "actual": ...}``.
        url: Queue URL.
    """

    name: str
    queue: str
    dead_letter: bool
    action: str
    url: str
    differences: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)


def desired_attributes(
    settings: OutboxSettings,
    queue: str,
    *,
    dead_letter: bool,
    dlq_arn: str | None = None,
    spec: QueueSpec | None = None,
) -> dict[str, str]:
    """SQS attributes a queue should have (strings, as the SQS API takes them).

    Args:
        spec: The catalog's declaration of ``queue`` (None for the four defaults, or a
            queue the catalog does not declare).
    """
    known = spec or queues.BUILTIN_BY_NAME.get(queue) or queues.Queue(queue)
    deployed = queues.QueueRegistry([] if known.builtin else [known]).deployed(queue, settings)
    attributes = {
        "MaximumMessageSize": str(settings.max_message_bytes),
        "ReceiveMessageWaitTimeSeconds": str(LONG_POLL_SECONDS),
        "VisibilityTimeout": str(deployed.visibility_timeout_seconds),
    }
    if dead_letter:
        attributes["MessageRetentionPeriod"] = str(DLQ_RETENTION_SECONDS)
    else:
        attributes["MessageRetentionPeriod"] = str(deployed.message_retention_seconds)
        assert dlq_arn is not None
        attributes["RedrivePolicy"] = json.dumps(
            {"deadLetterTargetArn": dlq_arn, "maxReceiveCount": deployed.max_receive_count},
            separators=(",", ":"),
        )
    if settings.sqs_kms_key_id:
        attributes["KmsMasterKeyId"] = settings.sqs_kms_key_id
    elif settings.sqs_managed_sse:
        attributes["SqsManagedSseEnabled"] = "true"
    return attributes


def provision(
    client: Any, settings: OutboxSettings, *, fix: bool = False, catalog: Catalog | None = None
) -> list[QueueReport]:
    """Create missing queues and DLQs; report (and with ``fix``, correct) drift.

    Args:
        client: boto3 SQS client.
        settings: Uses ``queue_prefix``, ``max_receive_count``, ``max_message_bytes``, the
            visibility timeouts and the SSE settings.
        fix: Apply the desired attributes to queues that drifted.
        catalog: Its declared queues are provisioned after the four defaults.

    Returns:
        One :class:`QueueReport` per SQS queue, DLQ first for each logical queue.

    Raises:
        ConfigurationError: A declared queue's SQS name (``<prefix><name>-dlq``) would be
            longer than 80 characters (SQS limit); checked before any call.
        botocore.exceptions.ClientError: SQS refused a call (permissions, quotas).
    """
    registry = catalog.queue_registry if catalog is not None else queues.BUILTIN_REGISTRY
    for queue in (q.name for q in registry.declared):
        if len(settings.dlq_url_name(queue)) > SQS_QUEUE_NAME_MAX:
            raise errors.ConfigurationError(
                f"queue {queue!r}: SQS name {settings.dlq_url_name(queue)!r} is longer than "
                f"{SQS_QUEUE_NAME_MAX} characters (SQS QueueName limit); shorten the name or the prefix",
                option="queue_prefix",
            )
    reports: list[QueueReport] = []
    for queue in registry.names:
        spec = None if registry.get(queue).builtin else registry.get(queue)
        dlq = _ensure(
            client,
            settings.dlq_url_name(queue),
            queue,
            True,
            desired_attributes(settings, queue, dead_letter=True, spec=spec),
            fix,
        )
        reports.append(dlq)
        dlq_arn = client.get_queue_attributes(QueueUrl=dlq.url, AttributeNames=["QueueArn"])["Attributes"][
            "QueueArn"
        ]
        reports.append(
            _ensure(
                client,
                settings.queue_url_name(queue),
                queue,
                False,
                desired_attributes(settings, queue, dead_letter=False, dlq_arn=dlq_arn, spec=spec),
                fix,
            )
        )
    return reports


def _ensure(
    client: Any, name: str, queue: str, dead_letter: bool, desired: dict[str, str], fix: bool
) -> QueueReport:
    try:
        url = client.get_queue_url(QueueName=name)["QueueUrl"]
    except Exception as exc:
        if not is_missing_queue(exc):
            raise
        url = client.create_queue(QueueName=name, Attributes=desired)["QueueUrl"]
        return QueueReport(name, queue, dead_letter, "created", url)
    actual = client.get_queue_attributes(QueueUrl=url, AttributeNames=["All"])["Attributes"]
    differences = {
        key: {"expected": _normal(key, value), "actual": _normal(key, actual.get(key))}
        for key, value in desired.items()
        if _normal(key, value) != _normal(key, actual.get(key))
    }
    if not differences:
        return QueueReport(name, queue, dead_letter, "unchanged", url)
    if fix:
        client.set_queue_attributes(QueueUrl=url, Attributes=desired)
        return QueueReport(name, queue, dead_letter, "updated", url, differences)
    return QueueReport(name, queue, dead_letter, "drift", url, differences)


def _normal(key: str, value: str | None) -> Any:
    if value is None:
        return None
    if key == "RedrivePolicy":
        policy = json.loads(value)
        return {
            "deadLetterTargetArn": policy.get("deadLetterTargetArn"),
            "maxReceiveCount": int(policy.get("maxReceiveCount", 0)),
        }
    if key == "SqsManagedSseEnabled":
        return str(value).lower() == "true"
    return str(value)
