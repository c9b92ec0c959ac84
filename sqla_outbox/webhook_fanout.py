"""Webhook deliveries scheduled at publish: one run per subscribed, enabled endpoint.

An event is a *webhook event* when the catalog lists the built-in task
:data:`WEBHOOK_TASK` (``webhooks.deliver``) among its subscribers (the worker side
declares it with ``Registry.webhook_events(...)``; see ``docs/webhooks.md``). Publishing
it in a tenant's transaction schedules one ``webhooks.deliver`` run per endpoint of that
tenant that is enabled and subscribes to the event, in the same flush statement as every
other run (decision 0002: one statement per flush): the endpoint lookup is a join inside
that statement, and only flushes that hold a webhook event use the statement variant
that has it. Other publishes and dispatches never touch ``webhook_endpoints``.

Each delivery run carries the endpoint's id and the event, never the URL or a secret::

    {"endpoint_id": 17, "type": "order.paid", "timestamp": "2026-12-02T10:11:12.123456Z",
     "data": <the published payload>}

``timestamp`` is when the event was published (database clock, UTC, microseconds). The
worker reads the endpoint again at every attempt, so an endpoint edited or disabled after
the publish is delivered with its current settings, or not at all.

With an idempotency key, each delivery's key is ``<key>@<endpoint id>`` (one task serves
every endpoint, and a key allows one unfinished run per task + tenant + key).
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

from sqlalchemy import BigInteger, DateTime, Interval, SmallInteger, Text, bindparam
from sqlalchemy.dialects.postgresql import ARRAY, UUID
from sqlalchemy.sql.elements import BindParameter

from sqla_outbox import envelope, errors
from sqla_outbox.types import TRIGGER_PRIORITIES

WEBHOOK_TASK = "webhooks.deliver"
"""Name of the built-in task that delivers one webhook event to one endpoint."""

_TIMESTAMP_SAMPLE = "2026-01-01T00:00:00.000000Z"  # the SQL below always renders 27 characters
_LARGEST_ENDPOINT_ID = 2**63 - 1
_LONGEST_RUN_ID = uuid.UUID(int=2**128 - 1)


@dataclasses.dataclass
class PreparedFanout:
    """A published webhook event, ready to become one delivery run per matching endpoint.

    Attributes:
        event: The event name. tenant_id: The publishing tenant (endpoints are per tenant).
        queue: Queue of the deliveries (the catalog's queue of :data:`WEBHOOK_TASK`).
        payload_json: The event payload as the application encoded it.
        idempotency_key: The publish's key (each delivery gets ``<key>@<endpoint id>``).
        delay / available_at: As for any run (database clock).
        trace: W3C trace-context carrier of the publishing code, possibly empty.
        seed: The publish's own UUID, from which each delivery's run id is derived (the
            same publish added again makes the same run ids, so it resolves quietly to the
            deliveries it already scheduled, as a re-added ``Dispatch`` does to its run).
        run_ids: Set by the write: endpoint id → delivery run id, for the runs it inserted.
        priority: Priority of the delivery runs (default 1, the "webhook" trigger).
    """

    event: str
    tenant_id: int
    queue: str
    payload_json: str
    idempotency_key: str | None
    delay: dt.timedelta
    available_at: dt.datetime | None
    trace: Mapping[str, str]
    seed: uuid.UUID
    run_ids: dict[int, uuid.UUID] = dataclasses.field(default_factory=dict)
    priority: int = TRIGGER_PRIORITIES["webhook"]


def delivery_payload_json(endpoint_id: int, event: str, timestamp: str, payload_json: str) -> str:
    """The payload text of one delivery run, exactly as the write statement builds it.

    Args:
        endpoint_id: ``webhook_endpoints.id``.
        event: Event name (catalog name pattern: no character needs JSON escaping).
        timestamp: Publish time, ``YYYY-MM-DDTHH:MM:SS.ffffffZ``.
        payload_json: The published payload, JSON text.
    """
    return (
        f'{{"endpoint_id":{endpoint_id},"type":{json.dumps(event)},'
        f'"timestamp":"{timestamp}","data":{payload_json}}}'
    )


def delivery_key(idempotency_key: str | None, endpoint_id: int) -> str | None:
    """The idempotency key of one endpoint's delivery (None without a publish key)."""
    return None if idempotency_key is None else f"{idempotency_key}@{endpoint_id}"


def prepare(
    *,
    event: str,
    tenant_id: int | None,
    queue: str,
    payload_json: str,
    idempotency_key: str | None,
    delay: dt.timedelta,
    available_at: dt.datetime | None,
    trace: Mapping[str, str],
    seed: uuid.UUID,
    max_message_bytes: int,
    priority: int | None = None,
) -> PreparedFanout:
    """Check a webhook event's publish and prepare its fan-out (called by ``session.add``).

    The delivery envelope's size is checked against its largest possible form (the
    longest endpoint id), so no endpoint's delivery can exceed the SQS limit later.

    Raises:
        InvalidDispatch: No ``tenant_id`` (webhook endpoints belong to tenants).
        EnvelopeTooLarge: A delivery message would exceed ``max_message_bytes``.
    """
    if tenant_id is None:
        raise errors.InvalidDispatch(
            event,
            f"{event!r} is a webhook event (the catalog lists {WEBHOOK_TASK!r} as a subscriber); "
            "webhook endpoints belong to tenants: pass tenant_id",
        )
    largest = envelope.Envelope(
        run_id=_LONGEST_RUN_ID,
        task=WEBHOOK_TASK,
        queue=queue,
        tenant_id=tenant_id,
        payload_json=delivery_payload_json(_LARGEST_ENDPOINT_ID, event, _TIMESTAMP_SAMPLE, payload_json),
        event=event,
        idempotency_key=delivery_key(idempotency_key, _LARGEST_ENDPOINT_ID),
        trace=trace,
    )
    size = largest.size_bytes()
    if size > max_message_bytes:
        raise errors.EnvelopeTooLarge(WEBHOOK_TASK, size_bytes=size, limit_bytes=max_message_bytes)
    return PreparedFanout(
        event=event,
        tenant_id=tenant_id,
        queue=queue,
        payload_json=payload_json,
        idempotency_key=idempotency_key,
        delay=delay,
        available_at=available_at,
        trace=dict(trace),
        seed=seed,
        priority=priority or TRIGGER_PRIORITIES["webhook"],
    )


# --------------------------------------------------------------------------------------
# the part of the write statement that fans out (composed by sqla_outbox.write)

FANOUT_CTES = """
fan AS (
    SELECT f.*, clock_timestamp() AS published_at FROM unnest(
        CAST(:fan_events AS text[]), CAST(:fan_tenant_ids AS bigint[]), CAST(:fan_queues AS text[]),
        CAST(:fan_payloads AS text[]), CAST(:fan_keys AS text[]), CAST(:fan_delays AS interval[]),
        CAST(:fan_available_ats AS timestamptz[]), CAST(:fan_traces AS text[]),
        CAST(:fan_priorities AS smallint[]), CAST(:fan_seeds AS uuid[])
    ) WITH ORDINALITY AS f(event, tenant_id, queue, payload, key, delay, available_at, trace, priority,
                           seed, fan_ord)
),
hooks AS (
    SELECT CAST(md5(CAST(f.seed AS text) || '@' || e.id) AS uuid) AS run_id, e.id AS endpoint_id, f.*,
           CASE WHEN f.key IS NULL THEN NULL ELSE f.key || '@' || e.id END AS hook_key,
           to_char(f.published_at AT TIME ZONE 'UTC', 'YYYY-MM-DD"T"HH24:MI:SS.US"Z"') AS stamp
    FROM fan AS f
    JOIN webhook_endpoints AS e
      ON e.tenant_id = f.tenant_id AND e.enabled AND f.event = ANY(e.events)
),
"""
"""CTEs ``fan`` (one row per webhook publish) and ``hooks`` (one per matching endpoint).
A delivery's run id is the MD5 of its publish's seed and its endpoint id, read as a UUID:
the same publish added again makes the same run ids, which the runs' ``ON CONFLICT DO
NOTHING`` skips (distinct publishes have distinct random seeds). ``clock_timestamp()`` is
volatile, so PostgreSQL evaluates these CTEs once; every later reference sees the same
publish time."""

FANOUT_INPUT = """
    SELECT h.run_id, CAST(:fan_task AS text), h.event, h.queue, h.tenant_id, h.hook_key,
           h.delay, h.available_at,
           CAST(jsonb_build_object(
               'v', 1, 'run_id', CAST(h.run_id AS text), 'task', CAST(:fan_task AS text),
               'queue', h.queue, 'tenant_id', h.tenant_id, 'event', h.event,
               'idempotency_key', h.hook_key,
               'payload', '{"endpoint_id":' || h.endpoint_id || ',"type":' || to_json(h.event)
                          || ',"timestamp":"' || h.stamp || '","data":' || h.payload || '}'
           ) || CAST(h.trace AS jsonb) AS text),
           h.priority,
           :fan_first_ord + row_number() OVER (ORDER BY h.fan_ord, h.endpoint_id),
           h.endpoint_id, h.fan_ord
    FROM hooks AS h
"""
"""Rows of the ``input`` CTE for the deliveries, in its column order plus ``endpoint_id``
and ``fan_ord`` (the envelope is the one :class:`~sqla_outbox.envelope.Envelope` encodes,
built by ``jsonb_build_object``; the worker compares the two as ``jsonb``)."""

BINDPARAMS: tuple[BindParameter[Any], ...] = (
    bindparam("fan_events", type_=ARRAY(Text)),
    bindparam("fan_tenant_ids", type_=ARRAY(BigInteger)),
    bindparam("fan_queues", type_=ARRAY(Text)),
    bindparam("fan_payloads", type_=ARRAY(Text)),
    bindparam("fan_keys", type_=ARRAY(Text)),
    bindparam("fan_delays", type_=ARRAY(Interval)),
    bindparam("fan_available_ats", type_=ARRAY(DateTime(timezone=True))),
    bindparam("fan_traces", type_=ARRAY(Text)),
    bindparam("fan_priorities", type_=ARRAY(SmallInteger)),
    bindparam("fan_seeds", type_=ARRAY(UUID(as_uuid=True))),
    bindparam("fan_task", type_=Text),
    bindparam("fan_first_ord", type_=BigInteger),
)


def params(fanouts: Sequence[PreparedFanout], *, first_ord: int) -> dict[str, Any]:
    """Parameters of :data:`FANOUT_CTES` and :data:`FANOUT_INPUT`.

    Args:
        fanouts: The flush's webhook publishes, in order.
        first_ord: Ordinal after the flush's ordinary runs (deliveries are inserted after them).
    """
    return {
        "fan_events": [f.event for f in fanouts],
        "fan_tenant_ids": [f.tenant_id for f in fanouts],
        "fan_queues": [f.queue for f in fanouts],
        "fan_payloads": [f.payload_json for f in fanouts],
        "fan_keys": [f.idempotency_key for f in fanouts],
        "fan_delays": [f.delay for f in fanouts],
        "fan_available_ats": [f.available_at for f in fanouts],
        "fan_traces": [json.dumps({"trace": dict(f.trace)}) if f.trace else "{}" for f in fanouts],
        "fan_priorities": [f.priority for f in fanouts],
        "fan_seeds": [f.seed for f in fanouts],
        "fan_task": WEBHOOK_TASK,
        "fan_first_ord": first_ord,
    }
