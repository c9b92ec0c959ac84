"""Per-tenant rate limits, enforced by the relay with a sliding one-minute window.

A tenant limited to N runs a minute gets at most N rows *sent* (SendMessageBatch accepted)
in any 60 seconds. Rows over the limit are simply not claimed: they stay pending in the
outbox, unchanged (no attempt spent, nothing failed, no message in SQS), and go out as the
window frees. The limit is ``tenant_rate_limit_per_minute`` (default: none) unless
``tenant_flow.rate_limit_per_minute`` overrides it for the tenant (0: unlimited).

The window is kept in the active relay's memory (one timestamp per send of a limited
tenant, so N floats at most per tenant). A relay that becomes active seeds it from the
outbox's ``sent_at`` of the last minute, so a failover neither forgets nor doubles the
sends already made. A run deferred back to the outbox by a worker (pause, no handler) and
sent again counts again: the limit is on messages handed to SQS.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Iterable, Mapping

from sqlalchemy import BigInteger, bindparam, text
from sqlalchemy.dialects.postgresql import ARRAY
from sqlalchemy.engine import Connection

WINDOW_SECONDS = 60.0

_RECENT = text(
    """
SELECT tenant_id, EXTRACT(EPOCH FROM clock_timestamp() - sent_at)::float8 AS age
FROM outbox_messages
WHERE sent_at > clock_timestamp() - interval '60 seconds' AND tenant_id = ANY(CAST(:tenants AS bigint[]))
"""
).bindparams(bindparam("tenants", type_=ARRAY(BigInteger)))


class RateWindows:
    """Sends per tenant in the last :data:`WINDOW_SECONDS`, for the tenants with a limit."""

    def __init__(self, clock: collections.abc.Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._sent: dict[int, collections.deque[float]] = {}
        self._seeded: set[int] = set()

    def _trim(self, tenant: int, now: float) -> collections.deque[float]:
        sent = self._sent.setdefault(tenant, collections.deque())
        while sent and sent[0] <= now - WINDOW_SECONDS:
            sent.popleft()
        return sent

    def seed(self, connection: Connection, tenants: Iterable[int]) -> None:
        """Load the last minute's sends of limited tenants not seen yet (from ``sent_at``)."""
        new = sorted(set(tenants) - self._seeded)
        if not new:
            return
        now = self._clock()
        for row in connection.execute(_RECENT, {"tenants": new}):
            self._sent.setdefault(int(row.tenant_id), collections.deque()).append(now - float(row.age))
        for tenant in new:
            self._sent[tenant] = collections.deque(sorted(self._sent.get(tenant, ())))
        self._seeded.update(new)

    def forget(self) -> None:
        """Drop everything (the relay lost leadership; the next active relay seeds again)."""
        self._sent.clear()
        self._seeded.clear()

    def allowance(self, limits: Mapping[int, int]) -> dict[int, int]:
        """Rows each limited tenant may still be sent now (``limit - sent in window``, >= 0)."""
        now = self._clock()
        return {tenant: max(0, limit - len(self._trim(tenant, now))) for tenant, limit in limits.items()}

    def record(self, tenant: int, count: int = 1) -> None:
        """Count ``count`` rows of ``tenant`` sent now."""
        if count > 0:
            self._sent.setdefault(tenant, collections.deque()).extend([self._clock()] * count)

    def reopens_in(self, tenant: int, limit: int) -> float:
        """Seconds until ``tenant`` may be sent one more row (0 when it may now)."""
        now = self._clock()
        sent = self._trim(tenant, now)
        if len(sent) < limit:
            return 0.0
        return max(0.0, sent[len(sent) - limit] + WINDOW_SECONDS - now)
