"""The ``webhooks.deliver`` handler: one attempt to POST one event to one endpoint.

Each attempt:

1. **Reads the endpoint** (URL, events, secrets, enabled) in a short transaction of its
   own, with the database clock. A deleted or disabled endpoint, one of another tenant,
   or one no longer subscribed to the event gets nothing: the run succeeds with
   ``skipped`` in the trail (an edited endpoint is delivered with its current settings).
2. **Checks the destination** (:mod:`sqla_outbox.worker.destination_guard`): the host is
   resolved once and the connection goes to that checked address, on a port
   ``webhook_public_ports`` lists or that an allow-list entry names for this tenant. A
   refused destination fails permanently at this first attempt
   (:class:`~sqla_outbox.errors.WebhookRefused`, reason in the trail and the DLQ context).
3. **Signs** the body with the Standard Webhooks scheme (the ``standardwebhooks``
   package): ``webhook-id`` is the run id (the same on every attempt of this delivery),
   ``webhook-timestamp`` this attempt's time, ``webhook-signature`` one ``v1,`` signature
   per active secret (the newest, plus rotated-out ones in their grace period);
   ``webhook-attempt`` is the attempt number.
4. **Sends** with httpcore under one total deadline, ``webhook_timeout_seconds`` from the
   destination check on (:mod:`sqla_outbox.worker.deadline_http`: connect, TLS, send and
   read together; no redirects followed, no proxies from the environment, the
   ``webhook_proxy_url`` proxy when set, one fresh connection per attempt) and
   **classifies** the answer: 2xx succeeded; 3xx and
   4xx other than 429 → permanent (``redirect`` / ``client-error``); ``410 Gone`` →
   permanent (``gone``) and the endpoint is **disabled** with ``disabled_reason`` ``gone``
   (Standard Webhooks: a receiver answers 410 to unsubscribe), so its other scheduled
   deliveries are skipped and nothing more is scheduled for it; 429, 5xx, timeouts
   and connection errors → transient (:class:`~sqla_outbox.errors.WebhookFailed`), with
   a ``Retry-After`` that lengthens the next attempt's delay beyond the task's backoff
   (never shortens it), capped below SQS's 12-hour visibility limit.

Whatever the outcome, ``ctx.trail_detail["webhook"]`` records the endpoint, the origin
and address connected to (never the URL's path or query, which may hold a token), and
the response's status and latency. Its content type and first :data:`EXCERPT_BYTES`
bytes are kept only for a destination reached as a public address
(``webhook_response_excerpt``, :func:`keeps_excerpt`): by default, the answer of an
internal service let through by ``webhook_allowed_hosts`` never reaches the tenant's trail.

The body is ``{"type": <event>, "timestamp": <published at>, "data": <payload>}``
(Standard Webhooks, "Payload structure"), compact JSON, ASCII only.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import email.utils
import json
import math
import ssl
import time
from collections.abc import Mapping
from typing import Any

import httpcore
import httpx
import standardwebhooks
from sqlalchemy import BigInteger, bindparam, text
from sqlalchemy.engine import Connection, Engine

from sqla_outbox import errors, webhooks
from sqla_outbox.config import OutboxSettings
from sqla_outbox.worker import deadline_http
from sqla_outbox.worker.context import TaskContext
from sqla_outbox.worker.destination_guard import Destination, resolve_destination

EXCERPT_BYTES = 512
"""Most bytes of a response body kept in the trail."""

MAX_RETRY_AFTER_SECONDS = 43_200 - 900
"""Longest ``Retry-After`` honoured: SQS refuses a visibility that ends more than 12 hours
after the receive (ChangeMessageVisibility), and the attempt itself took up to its timeout;
15 minutes of margin."""

USER_AGENT = "sqla-outbox-webhooks/1"

_DISABLE_GONE = text(
    """
UPDATE webhook_endpoints
SET enabled = false, disabled_at = clock_timestamp(), disabled_reason = :reason,
    updated_at = clock_timestamp()
WHERE id = :id AND tenant_id = :tenant_id AND enabled
"""
).bindparams(bindparam("id", type_=BigInteger), bindparam("tenant_id", type_=BigInteger))

_ENDPOINT = text(
    """
SELECT tenant_id, url, events, enabled, secrets, clock_timestamp() AS now
FROM webhook_endpoints WHERE id = :id
"""
).bindparams(bindparam("id", type_=BigInteger))


@dataclasses.dataclass(frozen=True)
class Delivery:
    """A delivery run's payload, validated (it came from a queue: untrusted)."""

    endpoint_id: int
    event: str
    timestamp: str
    data: Any

    @classmethod
    def from_payload(cls, payload: Any) -> Delivery:
        """Raises:
        ValidationFailed: Not the payload the publish wrote."""
        if not isinstance(payload, Mapping):
            raise errors.ValidationFailed("webhook delivery payload is not an object")
        endpoint_id, event, timestamp = (
            payload.get("endpoint_id"),
            payload.get("type"),
            payload.get("timestamp"),
        )
        if isinstance(endpoint_id, bool) or not isinstance(endpoint_id, int) or not 0 < endpoint_id < 2**63:
            raise errors.ValidationFailed("webhook delivery payload: endpoint_id is not a positive bigint")
        if not isinstance(event, str) or not isinstance(timestamp, str) or "data" not in payload:
            raise errors.ValidationFailed("webhook delivery payload: type, timestamp or data missing")
        return cls(endpoint_id, event, timestamp, payload["data"])

    def body(self) -> bytes:
        """The request body, compact ASCII JSON (what is signed is what is sent)."""
        document = {"type": self.event, "timestamp": self.timestamp, "data": self.data}
        return json.dumps(document, separators=(",", ":"), ensure_ascii=True).encode("ascii")


def deliver(payload: Any, ctx: TaskContext) -> None:
    """Deliver one webhook event to one endpoint (the ``webhooks.deliver`` handler).

    Raises:
        WebhookRefused: Permanent: destination refused, redirect, 410 (the endpoint is
            disabled first, reason ``gone``), or another 4xx other than 429.
        WebhookFailed: Transient: 429/5xx (with ``retry_after_seconds`` when the receiver
            sent ``Retry-After``: the next attempt waits at least that long, capped), timeout,
            connection error, a name that does not resolve.
        ValidationFailed: The run's payload is not a delivery payload.
    """
    settings = ctx.settings or OutboxSettings.from_env()
    delivery = Delivery.from_payload(payload)
    record: dict[str, Any] = {"endpoint_id": delivery.endpoint_id, "attempt": ctx.attempt}
    ctx.trail_detail["webhook"] = record
    endpoint = _read_endpoint(_engine(ctx), delivery.endpoint_id)
    skipped = _skip_reason(endpoint, ctx, delivery)
    if skipped is not None:
        record["skipped"] = skipped
        ctx.logger.info("webhook delivery skipped: %s", skipped)
        return
    assert endpoint is not None
    timeout = settings.webhook_timeout_seconds
    remaining = ctx.remaining_seconds()
    if remaining is not None:
        timeout = max(min(timeout, remaining - 1.0), 0.5)
    deadline = time.monotonic() + timeout  # name resolution counts too
    try:
        destination = resolve_destination(
            endpoint["url"],
            allowed_hosts=settings.webhook_allowed_hosts,
            public_ports=settings.webhook_public_ports,
            tenant_id=ctx.tenant_id,
        )
    except errors.WebhookRefused as refused:
        record["refused"] = str(refused)
        raise
    record["destination"] = destination.origin
    record["address"] = str(destination.address)
    if destination.allowed_by is not None:
        record["allowed_by"] = destination.allowed_by
    body = delivery.body()
    headers = _signed_headers(ctx, body, webhooks.active_secrets(endpoint["secrets"], endpoint["now"]))
    keep = keeps_excerpt(destination, settings.webhook_response_excerpt)
    status, retry_after = _send(
        destination, body, headers, deadline, record, keep_excerpt=keep, proxy_url=settings.webhook_proxy_url
    )
    if status == 410:
        _disable_gone(_engine(ctx), delivery.endpoint_id, ctx)
        record["endpoint_disabled"] = webhooks.DISABLED_GONE
    _classify(status, retry_after, record)


def _disable_gone(engine: Engine, endpoint_id: int, ctx: TaskContext) -> None:
    """Disable an endpoint whose receiver answered 410, in a transaction of its own: the
    attempt fails permanently, so the handler's own session is rolled back, and the
    endpoint must stay disabled. Only an enabled endpoint of the run's tenant is changed
    (a second 410 keeps the first ``disabled_at``)."""
    with engine.begin() as connection:
        changed = connection.execute(
            _DISABLE_GONE, {"id": endpoint_id, "tenant_id": ctx.tenant_id, "reason": webhooks.DISABLED_GONE}
        ).rowcount
    if changed:
        ctx.logger.warning("webhook endpoint %s disabled: its receiver answered 410 Gone", endpoint_id)


def keeps_excerpt(destination: Destination, policy: str) -> bool:
    """Whether the trail keeps the answer's content type and first bytes.

    Args:
        destination: Where the attempt connected.
        policy: ``webhook_response_excerpt``: ``public`` (only for a destination no
            allow-list entry let through), ``never`` or ``always``.
    """
    return policy == "always" or (policy == "public" and destination.allowed_by is None)


def _engine(ctx: TaskContext) -> Engine:
    bind = ctx.session.get_bind()
    return bind.engine if isinstance(bind, Connection) else bind


def _read_endpoint(engine: Engine, endpoint_id: int) -> Mapping[str, Any] | None:
    """The endpoint's current settings, in a transaction of its own (closed before the
    HTTP call, so no connection idles in a transaction while the receiver answers)."""
    with engine.connect() as connection:
        row = connection.execute(_ENDPOINT, {"id": endpoint_id}).mappings().one_or_none()
        connection.rollback()
    return None if row is None else dict(row)


def _skip_reason(endpoint: Mapping[str, Any] | None, ctx: TaskContext, delivery: Delivery) -> str | None:
    if endpoint is None:
        return "endpoint-deleted"
    if endpoint["tenant_id"] != ctx.tenant_id:
        return "endpoint-of-another-tenant"
    if not endpoint["enabled"]:
        return "endpoint-disabled"
    if delivery.event not in (endpoint["events"] or ()):
        return "event-unsubscribed"
    return None


def _signed_headers(ctx: TaskContext, body: bytes, secrets: list[str]) -> dict[str, str]:
    """Standard Webhooks headers: the same ``webhook-id`` (the run id) on every attempt,
    this attempt's timestamp, one signature per active secret (space-separated).

    Raises:
        PermanentError: No active secret is a valid ``whsec_`` secret.
    """
    message_id = str(ctx.run_id)
    now = dt.datetime.now(dt.UTC)
    signatures = []
    for secret in secrets:
        try:
            signatures.append(standardwebhooks.Webhook(secret).sign(message_id, now, body.decode("ascii")))
        except Exception:  # noqa: S112 - a malformed secret written around the API: the others still sign
            continue
    if not signatures:
        raise errors.PermanentError("the endpoint has no valid signing secret (whsec_ + base64)")
    return {
        "content-type": "application/json",
        "user-agent": USER_AGENT,
        "webhook-id": message_id,
        "webhook-timestamp": str(math.floor(now.timestamp())),
        "webhook-signature": " ".join(signatures),
        "webhook-attempt": str(ctx.attempt),
        "accept-encoding": "identity",  # the excerpt is read raw: no decompression of untrusted bodies
    }


def _ssl_context() -> ssl.SSLContext:
    # certifi's bundle, plus SSL_CERT_FILE / SSL_CERT_DIR when set (internal CAs)
    return httpx.create_ssl_context(trust_env=True)


def _send(
    destination: Destination,
    body: bytes,
    headers: dict[str, str],
    deadline: float,
    record: dict[str, Any],
    *,
    keep_excerpt: bool,
    proxy_url: str | None,
) -> tuple[int, float | None]:
    """POST to the pinned address by ``deadline`` (``time.monotonic()``); return (status,
    Retry-After seconds or None).

    Args:
        keep_excerpt: Record the answer's content type and first bytes (else status and
            latency only).
        proxy_url: ``webhook_proxy_url``, or None to connect directly.

    Raises:
        WebhookFailed: ``timeout`` (the deadline passed before the status came) or
            ``connection`` (nothing usable came back).
    """
    request_headers = {**headers, "host": destination.host_header}
    started = time.monotonic()
    try:
        answer = deadline_http.exchange(
            "POST",
            destination.pinned_url,
            headers=request_headers,
            body=body,
            deadline=deadline,
            max_bytes=EXCERPT_BYTES,
            ssl_context=_ssl_context() if destination.scheme == "https" else None,
            sni_hostname=destination.host if destination.scheme == "https" else None,
            proxy_url=proxy_url,
        )
    except httpcore.TimeoutException as exc:
        record["error"] = {"kind": "timeout", "after_ms": round((time.monotonic() - started) * 1000, 1)}
        raise errors.WebhookFailed(
            "timeout",
            f"{destination.origin} did not answer within the attempt's deadline ({type(exc).__name__})",
        ) from None
    except _UNUSABLE as exc:
        record["error"] = {"kind": "connection", "type": type(exc).__name__}
        raise errors.WebhookFailed(
            "connection", f"{destination.origin} ({destination.address}): {type(exc).__name__}: {exc}"[:500]
        ) from None
    response: dict[str, Any] = {
        "status": answer.status,
        "latency_ms": round((time.monotonic() - started) * 1000, 1),
    }
    if keep_excerpt:
        response.update(
            content_type=_clean(answer.headers.get("content-type", ""))[:100],
            body=_clean(answer.body.decode("utf-8", errors="replace")),
            body_truncated=answer.truncated,
        )
    else:
        response["excerpt"] = "not kept: allow-listed destination" if destination.allowed_by else "not kept"
    record["response"] = response
    return answer.status, _retry_after(answer.headers.get("retry-after"))


_UNUSABLE = (httpcore.NetworkError, httpcore.ProtocolError, httpcore.ProxyError, httpcore.UnsupportedProtocol)
"""httpcore's errors for "nothing usable came back": refused, reset, TLS, not HTTP, proxy."""


def _clean(value: str) -> str:
    """Text PostgreSQL can store (``jsonb`` refuses NUL)."""
    return value.replace("\x00", "\ufffd")


def _retry_after(value: str | None) -> float | None:
    """``Retry-After`` (RFC 9110 section 10.2.3): delay-seconds or an HTTP-date; None when
    absent or unreadable."""
    if value is None:
        return None
    value = value.strip()
    if value.isdigit():
        return float(int(value[:9]))
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError, IndexError, OverflowError):
        return None
    if when.tzinfo is None:
        when = when.replace(tzinfo=dt.UTC)
    return max((when - dt.datetime.now(dt.UTC)).total_seconds(), 0.0)


def _classify(status: int, retry_after: float | None, record: dict[str, Any]) -> None:
    """Raise for anything but 2xx (see the module docstring)."""
    if 200 <= status < 300:
        return
    if 300 <= status < 400:
        raise errors.WebhookRefused("redirect", f"the receiver answered {status}; redirects are not followed")
    if status == 410:
        raise errors.WebhookRefused("gone", "the receiver answered 410 Gone; the endpoint is disabled")
    if 400 <= status < 500 and status != 429:
        raise errors.WebhookRefused("client-error", f"the receiver answered {status}")
    reason = "rate-limited" if status == 429 else "server-error"
    if retry_after is not None:
        delay = min(retry_after, MAX_RETRY_AFTER_SECONDS)
        record["retry_after_seconds"] = delay
        raise errors.WebhookFailed(
            reason,
            f"the receiver answered {status}; Retry-After {retry_after:g} s",
            retry_after_seconds=delay,
        )
    raise errors.WebhookFailed(reason, f"the receiver answered {status}")
