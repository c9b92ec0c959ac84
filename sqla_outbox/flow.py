"""Flow control records: pauses (task, tenant, queue) and tenant weights and rate limits.

The Python API behind ``python -m sqla_outbox pause|resume|flow`` and the dashboard's
controls, and what the relay and the workers read. Everything lives in PostgreSQL
(``flow_pauses``, ``tenant_flow``, migration ``sqlaob_0007``), so it survives restarts
and every relay and worker sees the same state. docs/flow-control.md explains the design.

Pausing writes one row; nothing else moves. The relay (:mod:`sqla_outbox.relay.flow`)
keeps the rows of a paused target pending, pushed :data:`PAUSE_HOLD_SECONDS` ahead; a
worker that receives a message of a paused target defers it back to the outbox without
calling the handler (:mod:`sqla_outbox.worker.deferral`, reason ``paused``: no attempt, no
receive budget). Resuming deletes the row and, in the same transaction, makes the
target's held rows due now and ``NOTIFY``s the relay, so they leave at once::

    with engine.begin() as conn:
        flow.pause(conn, task="send_newsletter", by="alice", reason="provider incident")
    ...
    with engine.begin() as conn:
        flow.resume(conn, task="send_newsletter", by="alice")

Each function runs in the caller's transaction (a ``Connection`` or ORM ``Session``);
the caller commits.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import threading
import time
from typing import Any

from sqlalchemy import text

from sqla_outbox import errors
from sqla_outbox.lifecycle import sending
from sqla_outbox.types import WAKE_CHANNEL, is_name, is_queue_name

SCOPES = ("task", "tenant", "queue")
PAUSE_HOLD_SECONDS = 30.0
"""How far ahead a paused run's outbox row is pushed each time the relay or a worker
meets it. Resume releases held rows at once; this only bounds how long a row missed by
a release (a race with a pass in flight) waits."""

MAX_WEIGHT = 1000


@dataclasses.dataclass(frozen=True)
class Target:
    """What a pause applies to: ``scope`` (task, tenant, queue) and ``target`` as stored
    (the task name, the tenant id as decimal text, the queue name)."""

    scope: str
    target: str

    def __str__(self) -> str:
        return f"{self.scope} {self.target}"


def target(*, task: str | None = None, tenant_id: int | None = None, queue: str | None = None) -> Target:
    """The :class:`Target` named by exactly one of the three arguments.

    Raises:
        InvalidFlowControl: None or several given; a task name that is not a valid name
            (1..200 of letters, digits and ``_ . : -``); an unknown queue; a tenant id that
            is not an integer.
    """
    given = [
        name for name, value in (("task", task), ("tenant", tenant_id), ("queue", queue)) if value is not None
    ]
    if len(given) != 1:
        raise errors.InvalidFlowControl(
            f"name exactly one of task, tenant or queue (got {', '.join(given) or 'none'})"
        )
    if task is not None:
        if not is_name(task):
            raise errors.InvalidFlowControl(
                f"task names are 1..200 characters of letters, digits and _ . : - (got {task!r})"
            )
        return Target("task", task)
    if queue is not None:
        if not is_queue_name(queue):
            raise errors.InvalidFlowControl(f"{queue!r} is not a queue name (a default or declared queue)")
        return Target("queue", queue)
    if isinstance(tenant_id, bool) or not isinstance(tenant_id, int) or not -(2**63) <= tenant_id < 2**63:
        raise errors.InvalidFlowControl(f"tenant_id must be an integer (bigint), got {tenant_id!r}")
    return Target("tenant", str(tenant_id))


@dataclasses.dataclass(frozen=True)
class Pause:
    """One row of ``flow_pauses``."""

    scope: str
    target: str
    paused_at: dt.datetime
    paused_by: str | None
    reason: str | None

    def to_dict(self) -> dict[str, Any]:
        return {
            "scope": self.scope,
            "target": self.target,
            "paused_at": self.paused_at.isoformat(),
            "paused_by": self.paused_by,
            "reason": self.reason,
        }


@dataclasses.dataclass(frozen=True)
class Pauses:
    """The paused targets at one moment, for quick checks per row or message."""

    tasks: frozenset[str] = frozenset()
    tenants: frozenset[int] = frozenset()
    queues: frozenset[str] = frozenset()

    def __bool__(self) -> bool:
        return bool(self.tasks or self.tenants or self.queues)

    def blocking(self, task: str | None, tenant_id: int | None, queue: str) -> Target | None:
        """The pause that holds a run of ``task`` for ``tenant_id`` on ``queue``, if any
        (queue first, then tenant, then task)."""
        if queue in self.queues:
            return Target("queue", queue)
        if tenant_id is not None and tenant_id in self.tenants:
            return Target("tenant", str(tenant_id))
        if task is not None and task in self.tasks:
            return Target("task", task)
        return None

    @classmethod
    def of(cls, rows: list[tuple[str, str]]) -> Pauses:
        return cls(
            tasks=frozenset(t for s, t in rows if s == "task"),
            tenants=frozenset(int(t) for s, t in rows if s == "tenant" and _is_int(t)),
            queues=frozenset(t for s, t in rows if s == "queue"),
        )


def _is_int(value: str) -> bool:
    try:
        int(value)
    except ValueError:
        return False
    return True


_PAUSE = text(
    """
INSERT INTO flow_pauses (scope, target, paused_by, reason) VALUES (:scope, :target, :by, :reason)
ON CONFLICT (scope, target) DO NOTHING
RETURNING paused_at
"""
)
_RESUME = text("DELETE FROM flow_pauses WHERE scope = :scope AND target = :target RETURNING paused_at")
_LIST = text("SELECT scope, target, paused_at, paused_by, reason FROM flow_pauses ORDER BY scope, target")
_CURRENT = text("SELECT scope, target FROM flow_pauses")
_NOTIFY = text(f"SELECT pg_notify('{WAKE_CHANNEL}', '')")
_RELEASE_FILTER = {
    "task": "o.envelope->>'task' = :target",
    "tenant": "o.tenant_id = CAST(:target AS bigint)",
    "queue": "o.queue = :target",
}


def _release_sql(table: str, scope: str) -> Any:
    return sending.release_statement(table, which=_RELEASE_FILTER[scope])


_RELEASE = {
    (table, scope): _release_sql(table, scope)
    for table in ("outbox_messages", "platform_outbox_messages")
    for scope in SCOPES
    if not (table == "platform_outbox_messages" and scope == "tenant")
}


def pause(
    connection: Any,
    *,
    task: str | None = None,
    tenant_id: int | None = None,
    queue: str | None = None,
    by: str | None = None,
    reason: str | None = None,
) -> bool:
    """Pause a task, a tenant or a queue (exactly one). Idempotent.

    Args:
        connection: A SQLAlchemy ``Connection`` or ``Session``, in the caller's transaction.
        task / tenant_id / queue: What to pause.
        by: Who pauses (recorded; the dashboard records its user, the CLI the OS user).
        reason: Free text shown by ``python -m sqla_outbox flow list`` and the dashboard.

    Returns:
        True when this call paused it; False when it was paused already (the first
        pause's ``by`` and ``reason`` stay).

    Raises:
        InvalidFlowControl: See :func:`target`.
    """
    what = target(task=task, tenant_id=tenant_id, queue=queue)
    row = connection.execute(
        _PAUSE, {"scope": what.scope, "target": what.target, "by": by, "reason": reason}
    ).first()
    return row is not None


def resume(
    connection: Any,
    *,
    task: str | None = None,
    tenant_id: int | None = None,
    queue: str | None = None,
) -> tuple[bool, int]:
    """Resume a task, tenant or queue, and release its runs at once.

    In the caller's transaction: delete the pause, make the target's held outbox rows
    (pending, pushed ahead by the pause, their run due) due now, and ``NOTIFY`` the relay
    (delivered at commit; it reaches a relay whose ``wake_mode`` includes ``postgres``).
    With the Valkey wake alone, call your :class:`~sqla_outbox.wakeup.Waker` after the
    commit (the CLI and the dashboard do), or the relay sends them at its next sweep. Rows
    still held by another pause (say the tenant's) are released too and held again by the
    relay's next pass.

    Returns:
        ``(was_paused, released)``: whether a pause was deleted, and how many outbox rows
        became due now.

    Raises:
        InvalidFlowControl: See :func:`target`.
    """
    what = target(task=task, tenant_id=tenant_id, queue=queue)
    was_paused = connection.execute(_RESUME, {"scope": what.scope, "target": what.target}).first() is not None
    released = 0
    for (_table, scope), statement in _RELEASE.items():
        if scope == what.scope:
            released += int(connection.execute(statement, {"target": what.target}).rowcount or 0)
    connection.execute(_NOTIFY)
    return was_paused, released


def list_pauses(connection: Any) -> list[Pause]:
    """Every pause, by scope and target."""
    return [Pause(r.scope, r.target, r.paused_at, r.paused_by, r.reason) for r in connection.execute(_LIST)]


def current(connection: Any) -> Pauses:
    """The paused targets now (one small query)."""
    return Pauses.of([(r.scope, r.target) for r in connection.execute(_CURRENT)])


class PauseCache:
    """The paused targets as a worker sees them: re-read at most every ``refresh_seconds``
    (a pause reaches messages already in SQS within that time; the relay applies it at
    its next pass).

    Args:
        refresh_seconds: ``flow_refresh_seconds``.
    """

    def __init__(self, refresh_seconds: float) -> None:
        self.refresh_seconds = refresh_seconds
        self.pauses = Pauses()
        self._read_at = float("-inf")
        self._lock = threading.Lock()

    @property
    def stale(self) -> bool:
        return time.monotonic() - self._read_at >= self.refresh_seconds

    def refresh(self, connection: Any) -> Pauses:
        """Re-read the pauses on ``connection`` when stale; return them."""
        with self._lock:
            if self.stale:
                self.pauses = current(connection)
                self._read_at = time.monotonic()
        return self.pauses


# --- tenant weights and rate limits ---------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class TenantFlow:
    """One tenant's flow settings (``tenant_flow``).

    Attributes:
        tenant_id: The tenant. weight: Share of a relay pass relative to other tenants
            (1..1000). rate_limit_per_minute: Override of the global default; 0 is
            unlimited, None the default. updated_by: Who last changed it.
    """

    tenant_id: int
    weight: int = 1
    rate_limit_per_minute: int | None = None
    updated_by: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


_UNSET: Any = object()
_UPSERT = text(
    """
INSERT INTO tenant_flow AS f (tenant_id, weight, rate_limit_per_minute, updated_by)
VALUES (:tenant_id, COALESCE(:weight, 1), :limit, :by)
ON CONFLICT (tenant_id) DO UPDATE
SET weight = COALESCE(:weight, f.weight),
    rate_limit_per_minute = CASE WHEN :set_limit THEN :limit ELSE f.rate_limit_per_minute END,
    updated_at = clock_timestamp(), updated_by = :by
RETURNING tenant_id, weight, rate_limit_per_minute, updated_by
"""
)
_TENANTS = text(
    "SELECT tenant_id, weight, rate_limit_per_minute, updated_by FROM tenant_flow ORDER BY tenant_id"
)
_CLEAR = text("DELETE FROM tenant_flow WHERE tenant_id = :tenant_id")


def set_tenant(
    connection: Any,
    tenant_id: int,
    *,
    weight: int | None = None,
    rate_limit_per_minute: int | None = _UNSET,
    by: str | None = None,
) -> TenantFlow:
    """Set a tenant's weight and/or rate-limit override (arguments left out keep their value).

    Args:
        tenant_id: The tenant.
        weight: 1..1000; a tenant of weight 3 gets three times the share of a weight-1
            tenant in each relay pass while both have due rows.
        rate_limit_per_minute: Runs sent per sliding minute; 0 unlimited; None back to
            the global default (``tenant_rate_limit_per_minute``).
        by: Who changes it (recorded).

    Raises:
        InvalidFlowControl: A weight outside 1..1000, a negative rate limit, or a tenant
            id that is not an integer.
    """
    target(tenant_id=tenant_id)
    if weight is not None and (
        isinstance(weight, bool) or not isinstance(weight, int) or not 1 <= weight <= MAX_WEIGHT
    ):
        raise errors.InvalidFlowControl(
            f"tenant {tenant_id}: weight must be an integer within 1..{MAX_WEIGHT}, got {weight!r}"
        )
    set_limit = rate_limit_per_minute is not _UNSET
    limit = None if not set_limit else rate_limit_per_minute
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 0):
        raise errors.InvalidFlowControl(
            f"tenant {tenant_id}: rate_limit_per_minute must be an integer >= 0 (0: unlimited), got {limit!r}"
        )
    row = connection.execute(
        _UPSERT, {"tenant_id": tenant_id, "weight": weight, "limit": limit, "set_limit": set_limit, "by": by}
    ).one()
    return TenantFlow(row.tenant_id, row.weight, row.rate_limit_per_minute, row.updated_by)


def clear_tenant(connection: Any, tenant_id: int) -> bool:
    """Forget a tenant's settings (weight 1, the global rate limit). True if it had any."""
    target(tenant_id=tenant_id)
    return bool(connection.execute(_CLEAR, {"tenant_id": tenant_id}).rowcount)


def tenants(connection: Any) -> dict[int, TenantFlow]:
    """Every tenant with settings, by id."""
    return {
        r.tenant_id: TenantFlow(r.tenant_id, r.weight, r.rate_limit_per_minute, r.updated_by)
        for r in connection.execute(_TENANTS)
    }


def effective_limit(default: int | None, override: TenantFlow | None) -> int | None:
    """The rate limit (runs per minute) in force for a tenant; None when unlimited."""
    if override is not None and override.rate_limit_per_minute is not None:
        return override.rate_limit_per_minute or None
    return default


_TENANT_SENT = text(
    "SELECT count(*) FROM outbox_messages "
    "WHERE tenant_id = :tenant_id AND sent_at > clock_timestamp() - interval '60 seconds'"
)


def tenant_rate_use(connection: Any, tenant_id: int, default_limit: int | None) -> tuple[int, int] | None:
    """``(limit per minute, rows sent in the last 60 s)`` for one tenant, as the relay's
    window counts them (:mod:`sqla_outbox.relay.ratelimit`); None when no limit holds it.

    Args:
        connection: Any connection to the outbox database (read-only).
        default_limit: ``tenant_rate_limit_per_minute``.
    """
    limit = effective_limit(default_limit, tenants(connection).get(tenant_id))
    if limit is None:
        return None
    return limit, int(connection.execute(_TENANT_SENT, {"tenant_id": tenant_id}).scalar_one())


@dataclasses.dataclass(frozen=True)
class ThrottledTenant:
    """A tenant whose due runs wait in the outbox for its rate limit.

    Attributes:
        tenant_id: The tenant. limit_per_minute: The limit in force.
        sent_last_minute: Rows of the tenant sent in the last 60 s (``sent_at``).
        due: Due rows waiting. waited_seconds: How long the oldest due row has waited
            since it became due.
    """

    tenant_id: int
    limit_per_minute: int
    sent_last_minute: int
    due: int
    waited_seconds: float


_THROTTLED = text(
    """
WITH due AS (
    SELECT tenant_id, count(*) AS due,
           EXTRACT(EPOCH FROM clock_timestamp() - min(available_at))::float8 AS waited
    FROM outbox_messages
    WHERE sent_at IS NULL AND parked_at IS NULL AND available_at <= clock_timestamp()
    GROUP BY tenant_id
),
sent AS (
    SELECT tenant_id, count(*) AS sent FROM outbox_messages
    WHERE sent_at > clock_timestamp() - interval '60 seconds' AND tenant_id IN (SELECT tenant_id FROM due)
    GROUP BY tenant_id
)
SELECT d.tenant_id, d.due, d.waited, COALESCE(s.sent, 0) AS sent, f.rate_limit_per_minute
FROM due AS d LEFT JOIN sent AS s USING (tenant_id) LEFT JOIN tenant_flow AS f USING (tenant_id)
ORDER BY d.tenant_id
"""
)
_ANY_OVERRIDE = text("SELECT EXISTS (SELECT 1 FROM tenant_flow WHERE rate_limit_per_minute > 0)")


def throttled_tenants(connection: Any, default_limit: int | None) -> list[ThrottledTenant]:
    """Tenants with due rows that have used their rate limit for the last minute (what
    the relay leaves waiting), for ``status`` and the dashboard.

    Args:
        connection: Any connection to the outbox database (read-only).
        default_limit: ``tenant_rate_limit_per_minute``.
    """
    if default_limit is None and not connection.execute(_ANY_OVERRIDE).scalar():
        return []
    found = []
    for r in connection.execute(_THROTTLED):
        override = (
            None if r.rate_limit_per_minute is None else TenantFlow(r.tenant_id, 1, r.rate_limit_per_minute)
        )
        limit = effective_limit(default_limit, override)
        if limit is not None and int(r.sent) >= limit:
            found.append(ThrottledTenant(int(r.tenant_id), limit, int(r.sent), int(r.due), float(r.waited)))
    return found
