"""Webhook endpoints: create, find, edit, rotate secrets, disable.

An endpoint is a :class:`~sqla_outbox.models.WebhookEndpoint` row: where one tenant's
webhook events are POSTed, which events, and the secrets that sign them (Standard
Webhooks, ``whsec_`` + base64). The functions here check their input and change the
object in memory only; you add and commit it in your own transaction, so they work the
same with a ``Session`` and an ``AsyncSession``::

    from sqla_outbox import webhooks

    endpoint = webhooks.new_endpoint(tenant_id=3, url="https://hooks.example.com/in",
                                     events=["order.paid"])
    session.add(endpoint)                  # commit with your transaction
    show_once(webhooks.signing_secret(endpoint))

    found = (await session.scalars(webhooks.select_endpoints(tenant_id=3))).all()
    webhooks.update_endpoint(found[0], url="https://hooks.example.com/v2")
    new_secret = webhooks.rotate_secret(found[0])   # old one still signs for 24 h
    webhooks.disable_endpoint(found[0])

What a publish schedules and what a delivery does: ``docs/webhooks.md``. Deliveries read
the endpoint at every attempt, so each change here applies to deliveries already
scheduled (a disabled or deleted endpoint gets nothing more).
"""

from __future__ import annotations

import base64
import binascii
import datetime as dt
import secrets as secrets_mod
from collections.abc import Iterable, Mapping, Sequence
from typing import Any
from urllib.parse import urlsplit

from sqlalchemy import Select, select

from sqla_outbox import errors, types
from sqla_outbox.catalog import Catalog, TaskSpec
from sqla_outbox.models import WebhookEndpoint
from sqla_outbox.webhook_fanout import WEBHOOK_TASK

__all__ = [
    "DEFAULT_ROTATION_GRACE",
    "WEBHOOK_SPEC",
    "WEBHOOK_TASK",
    "WebhookEndpoint",
    "active_secrets",
    "disable_endpoint",
    "enable_endpoint",
    "generate_secret",
    "new_endpoint",
    "rotate_secret",
    "select_endpoints",
    "signing_secret",
    "update_endpoint",
]

WEBHOOK_SPEC = TaskSpec(
    name=WEBHOOK_TASK,
    queue="default",
    scope="tenant",
    timeout_seconds=60,
    description="Deliver one webhook event to one endpoint (Standard Webhooks signature).",
)
"""Catalog entry of the built-in delivery task (``Registry.webhook_events`` registers it)."""

DEFAULT_ROTATION_GRACE = dt.timedelta(hours=24)
"""How long a rotated-out secret keeps signing, so receivers can switch without a gap."""

SECRET_PREFIX = "whsec_"  # noqa: S105 - the Standard Webhooks prefix, not a secret
SECRET_BYTES = 32
"""Random bytes of a generated secret (Standard Webhooks: at least 24, at most 64)."""

MAX_URL_CHARS = 2048
_UNSET: Any = object()


def generate_secret() -> str:
    """A new signing secret: ``whsec_`` + base64 of 32 random bytes (``secrets.token_bytes``)."""
    return SECRET_PREFIX + base64.b64encode(secrets_mod.token_bytes(SECRET_BYTES)).decode("ascii")


def check_secret(secret: str) -> str:
    """Return ``secret`` if it is a Standard Webhooks symmetric secret.

    Raises:
        InvalidEndpoint: Not ``whsec_`` + base64 of 24..64 bytes (Standard Webhooks,
            "Signature scheme": random, at least 24 bytes, 512 bits maximum).
    """
    if not isinstance(secret, str) or not secret.startswith(SECRET_PREFIX):
        raise errors.InvalidEndpoint("secret", f"must be a string starting with {SECRET_PREFIX!r}")
    try:
        raw = base64.b64decode(secret[len(SECRET_PREFIX) :], validate=True)
    except (binascii.Error, ValueError):
        raise errors.InvalidEndpoint("secret", "is not base64 after the whsec_ prefix") from None
    if not 24 <= len(raw) <= 64:
        raise errors.InvalidEndpoint("secret", f"must hold 24..64 random bytes, holds {len(raw)}")
    return secret


def check_url(url: str) -> str:
    """Return ``url`` if it can be an endpoint URL (the syntax; addresses are checked at
    every delivery, on what the name resolves to then).

    Raises:
        InvalidEndpoint: Not an absolute ``http://`` or ``https://`` URL with a host,
            longer than 2,048 characters, holding whitespace or control characters, or
            carrying a user name or password (credentials would end up in logs and the
            trail; use the signature, or a token in the path).
    """
    if not isinstance(url, str) or not url:
        raise errors.InvalidEndpoint("url", "must be a non-empty string")
    if len(url) > MAX_URL_CHARS:
        raise errors.InvalidEndpoint("url", f"is longer than {MAX_URL_CHARS} characters")
    if any(ch.isspace() or ord(ch) < 32 or ord(ch) == 127 for ch in url):
        raise errors.InvalidEndpoint("url", "holds whitespace or control characters")
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as exc:
        raise errors.InvalidEndpoint("url", f"cannot be parsed ({exc})") from None
    if parts.scheme not in ("http", "https"):
        raise errors.InvalidEndpoint("url", f"scheme {parts.scheme or '(none)'!r} is not http or https")
    if not parts.hostname:
        raise errors.InvalidEndpoint("url", "has no host")
    if parts.username is not None or parts.password is not None:
        raise errors.InvalidEndpoint("url", "must not carry a user name or password")
    if port == 0:
        raise errors.InvalidEndpoint("url", "port 0 is not a port")
    return url


def check_events(events: Iterable[str], catalog: Catalog | None = None) -> list[str]:
    """Return the event names, duplicates removed, in the given order.

    Args:
        events: Event names.
        catalog: When given, every event must be a webhook event in it (its subscribers
            include ``webhooks.deliver``); otherwise only the name pattern is checked.

    Raises:
        InvalidEndpoint: ``events`` is a string or empty, a name is not 1..200 characters of
            letters, digits and ``_ . : -`` as a whole string (a control character or a
            trailing newline is refused: ``types.is_name``), or (with ``catalog``) not a
            webhook event.
    """
    if isinstance(events, str):
        raise errors.InvalidEndpoint("events", "must be a list of event names, not a string")
    names: list[str] = []
    for name in events:
        if not types.is_name(name):
            raise errors.InvalidEndpoint(
                "events", f"{name!r} is not an event name (1..200 letters, digits, _ . : -)"
            )
        if catalog is not None and WEBHOOK_TASK not in catalog.events.get(name, ()):
            raise errors.InvalidEndpoint(
                "events",
                f"{name!r} is not a webhook event in the catalog (declare it with "
                "sqla_outbox.worker.webhook_events(...) in a task module and regenerate "
                "tasks.json: python -m sqla_outbox catalog write)",
            )
        if name not in names:
            names.append(name)
    if not names:
        raise errors.InvalidEndpoint("events", "must name at least one event")
    return names


def _check_tenant(tenant_id: int) -> int:
    if isinstance(tenant_id, bool) or not isinstance(tenant_id, int) or not -(2**63) <= tenant_id < 2**63:
        raise errors.InvalidEndpoint("tenant_id", f"must be an integer (bigint), got {tenant_id!r}")
    return tenant_id


def _now() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


def _entry(secret: str, now: dt.datetime) -> dict[str, Any]:
    return {"secret": secret, "created_at": now.isoformat(), "expires_at": None}


def new_endpoint(
    *,
    tenant_id: int,
    url: str,
    events: Iterable[str],
    description: str | None = None,
    enabled: bool = True,
    secret: str | None = None,
    catalog: Catalog | None = None,
) -> WebhookEndpoint:
    """A new endpoint, checked, with a fresh signing secret; ``session.add`` it.

    Args:
        tenant_id: The tenant whose events it receives.
        url: ``http://`` or ``https://`` URL (see :func:`check_url`).
        events: Webhook events it receives (see :func:`check_events`).
        description: Free text.
        enabled: False creates it disabled.
        secret: A ``whsec_`` secret to use instead of a generated one (e.g. migrated
            from another system).
        catalog: Check the events against it.

    Raises:
        InvalidEndpoint: A bad argument, named in the message.
    """
    if not isinstance(enabled, bool):
        raise errors.InvalidEndpoint("enabled", f"must be True or False, got {enabled!r}")
    return WebhookEndpoint(
        tenant_id=_check_tenant(tenant_id),
        url=check_url(url),
        events=check_events(events, catalog),
        secrets=[_entry(check_secret(secret) if secret is not None else generate_secret(), _now())],
        enabled=enabled,
        disabled_at=None if enabled else _now(),
        disabled_reason=None if enabled else DISABLED_BY_OPERATOR,
        description=description,
    )


def update_endpoint(
    endpoint: WebhookEndpoint,
    *,
    url: str = _UNSET,
    events: Iterable[str] = _UNSET,
    description: str | None = _UNSET,
    catalog: Catalog | None = None,
) -> WebhookEndpoint:
    """Change an endpoint's URL, events or description (only the arguments given).

    Deliveries already scheduled use the new values at their next attempt.

    Raises:
        InvalidEndpoint: A bad argument, named in the message; nothing was changed.
    """
    changes: dict[str, Any] = {}
    if url is not _UNSET:
        changes["url"] = check_url(url)
    if events is not _UNSET:
        changes["events"] = check_events(events, catalog)
    if description is not _UNSET:
        changes["description"] = description
    for name, value in changes.items():
        setattr(endpoint, name, value)
    return endpoint


DISABLED_BY_OPERATOR = "operator"
"""``disabled_reason`` of an endpoint disabled through :func:`disable_endpoint`."""

DISABLED_GONE = "gone"
"""``disabled_reason`` of an endpoint whose receiver answered ``410 Gone``: Standard
Webhooks ("Sending webhooks", failures) has senders disable an endpoint that answers 410."""


def disable_endpoint(endpoint: WebhookEndpoint) -> WebhookEndpoint:
    """Stop scheduling deliveries to it; scheduled ones are not sent (their runs succeed
    with ``skipped: endpoint-disabled`` in the trail). Records ``disabled_at`` (now, UTC)
    and ``disabled_reason`` ``operator``; disabling a disabled endpoint keeps its first
    reason."""
    if endpoint.enabled is not False:
        endpoint.disabled_at = _now()
        endpoint.disabled_reason = DISABLED_BY_OPERATOR
    endpoint.enabled = False
    return endpoint


def enable_endpoint(endpoint: WebhookEndpoint) -> WebhookEndpoint:
    """Schedule deliveries to it again (events published while disabled are not sent);
    clears ``disabled_at`` and ``disabled_reason``."""
    endpoint.enabled = True
    endpoint.disabled_at = None
    endpoint.disabled_reason = None
    return endpoint


def rotate_secret(
    endpoint: WebhookEndpoint,
    *,
    keep_previous_for: dt.timedelta = DEFAULT_ROTATION_GRACE,
    secret: str | None = None,
    now: dt.datetime | None = None,
) -> str:
    """Give the endpoint a new signing secret; return it (show it to the receiver's owner).

    The new secret signs from the next attempt on. The secrets it replaces keep signing
    (a second ``v1,`` signature in ``webhook-signature``, as Standard Webhooks prescribes
    for zero-downtime rotation) until ``keep_previous_for`` has passed; secrets already
    expired are dropped.

    Args:
        endpoint: The endpoint.
        keep_previous_for: Grace period of the replaced secrets; ``timedelta(0)`` stops
            them at once (a leaked secret).
        secret: Use this ``whsec_`` secret instead of a generated one.
        now: The current time (UTC); tests pass one.

    Raises:
        InvalidEndpoint: A bad ``secret`` or a negative ``keep_previous_for``.
    """
    if not isinstance(keep_previous_for, dt.timedelta) or keep_previous_for < dt.timedelta(0):
        raise errors.InvalidEndpoint("keep_previous_for", "must be a timedelta >= 0")
    now = now or _now()
    fresh = check_secret(secret) if secret is not None else generate_secret()
    until = now + keep_previous_for
    kept = []
    for entry in endpoint.secrets or []:
        expires = _expiry(entry)
        if keep_previous_for and (expires is None or expires > now):
            kept.append({**entry, "expires_at": min(expires or until, until).isoformat()})
    endpoint.secrets = [_entry(fresh, now), *kept]  # a new list, so the ORM sees the change
    return fresh


def signing_secret(endpoint: WebhookEndpoint) -> str:
    """The newest secret (the one receivers should configure)."""
    return str(endpoint.secrets[0]["secret"])


def active_secrets(secrets: Sequence[Mapping[str, Any]], now: dt.datetime) -> list[str]:
    """The secrets that sign at ``now``: the newest, then older ones not yet expired.

    Args:
        secrets: ``webhook_endpoints.secrets`` (newest first).
        now: Current time, timezone-aware (the worker passes the database clock).

    Returns:
        Secret strings, newest first; entries that are not well-formed are skipped.
    """
    active: list[str] = []
    for index, entry in enumerate(secrets):
        if not isinstance(entry, Mapping) or not isinstance(entry.get("secret"), str):
            continue
        expires = _expiry(entry)
        if index == 0 or (expires is not None and expires > now):
            active.append(entry["secret"])
    return active


def _expiry(entry: Mapping[str, Any]) -> dt.datetime | None:
    raw = entry.get("expires_at")
    if not isinstance(raw, str):
        return None
    try:
        value = dt.datetime.fromisoformat(raw)
    except ValueError:
        return None
    return value if value.tzinfo is not None else value.replace(tzinfo=dt.UTC)


def select_endpoints(
    *, tenant_id: int, event: str | None = None, enabled: bool | None = None
) -> Select[WebhookEndpoint]:
    """A query for a tenant's endpoints, oldest first: ``session.scalars(...)`` (or
    ``await session.scalars(...)``).

    Args:
        tenant_id: The tenant.
        event: Only endpoints that subscribe to this event.
        enabled: Only enabled (True) or disabled (False) endpoints; None for both.
    """
    query = select(WebhookEndpoint).where(WebhookEndpoint.tenant_id == _check_tenant(tenant_id))
    if event is not None:
        query = query.where(WebhookEndpoint.events.any_() == event)
    if enabled is not None:
        query = query.where(WebhookEndpoint.enabled.is_(enabled))
    return query.order_by(WebhookEndpoint.id)
