"""The fair claim: share each relay pass across the tenants with due rows, priority first.

The claim of :mod:`sqla_outbox.relay.claim` takes the oldest due rows across all
tenants, so a tenant that commits 20,000 runs takes every pass until they are sent. With
``relay_fairness`` on (the default) the relay claims per queue instead:

1. **Budget.** Each queue gets ``relay_batch_size`` rows, or fewer when SQS already holds
   ``relay_queue_depth`` messages of that queue that no worker has taken yet
   (:mod:`sqla_outbox.relay.depth`): the backlog stays in PostgreSQL, where priority,
   pauses and rate limits still apply.
2. **Tenants.** The tenants with due rows on that queue are found with a skip scan of the
   ``outbox_messages_fair_idx`` index (queue, tenant_id, priority, available_at, id): one
   index probe per tenant, never a scan of a tenant's backlog. With more such tenants
   than the budget, a cursor rotates through them pass after pass (round-robin).
3. **Shares.** The budget is split by tenant weight (``tenant_flow.weight``, default 1):
   each tenant gets at least one row, ``weight / sum(weights)`` of the budget otherwise,
   and never more than its rate-limit allowance (:mod:`sqla_outbox.relay.ratelimit`).
   Budget a tenant cannot use (it had fewer due rows) goes in a second round to the
   tenants that filled their share, so one tenant alone still gets the whole batch.
4. **Order.** Within a tenant, rows go in ``priority, available_at, id`` order (lower
   priority value first); the claimed rows are then interleaved across tenants (priority,
   then rank within the tenant), so the SendMessageBatch calls carry every tenant's first
   row before anyone's second.

Platform rows (``platform_outbox_messages``, no tenant) take part as one more tenant of
weight 1, in ``priority, available_at, id`` order. Every claim is ``FOR UPDATE SKIP
LOCKED`` in the pass's transaction, as before.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from sqlalchemy import BigInteger, Integer, bindparam, text
from sqlalchemy.dialects.postgresql import ARRAY
from sqlalchemy.engine import Connection

from sqla_outbox.relay.claim import ClaimedRow
from sqla_outbox.relay.partitions import ALL, PLATFORM_FILTER, TENANT_FILTER

_PENDING_DUE = "sent_at IS NULL AND parked_at IS NULL AND available_at <= clock_timestamp()"

_DISCOVER = text(
    f"""
WITH RECURSIVE t(queue, tenant_id, n) AS (
    (SELECT queue, tenant_id, 1 FROM outbox_messages
     WHERE {_PENDING_DUE} AND (queue, tenant_id) > (:after_queue, :after_tenant)
     ORDER BY queue, tenant_id LIMIT 1)
    UNION ALL
    SELECT x.queue, x.tenant_id, t.n + 1 FROM t CROSS JOIN LATERAL (
        SELECT o.queue, o.tenant_id FROM outbox_messages AS o
        WHERE o.sent_at IS NULL AND o.parked_at IS NULL AND o.available_at <= clock_timestamp()
          AND (o.queue, o.tenant_id) > (t.queue, t.tenant_id)
        ORDER BY o.queue, o.tenant_id LIMIT 1
    ) AS x
    WHERE t.n < :most
),
p(queue) AS (
    (SELECT queue FROM platform_outbox_messages WHERE {_PENDING_DUE} ORDER BY queue LIMIT 1)
    UNION ALL
    SELECT (SELECT o.queue FROM platform_outbox_messages AS o
            WHERE o.sent_at IS NULL AND o.parked_at IS NULL
              AND o.available_at <= clock_timestamp() AND o.queue > p.queue
            ORDER BY o.queue LIMIT 1)
    FROM p WHERE p.queue IS NOT NULL
)
SELECT queue, tenant_id, n, {TENANT_FILTER} AS mine FROM t WHERE {TENANT_FILTER} OR n = :most
UNION ALL
SELECT queue, NULL, NULL, true FROM p WHERE queue IS NOT NULL
"""
).bindparams(bindparam("after_tenant", type_=BigInteger))
"""The (queue, tenant) pairs with due rows, in index order from a cursor, up to ``most``
(a skip scan of ``outbox_messages_fair_idx``: one index probe per pair, never a scan of a
tenant's backlog), of which those in the owned partitions are returned; then the queues
with due platform rows (``tenant_id`` NULL; any partition: the claim filters them)."""

_COLUMNS = "c.id, c.run_id, c.queue, c.tenant_id, c.envelope, c.attempts, c.available_at, c.priority"
_TENANT_ROWS = text(
    f"""
SELECT {_COLUMNS}
FROM unnest(CAST(:tenants AS bigint[]), CAST(:limits AS integer[])) AS t(tenant_id, n)
CROSS JOIN LATERAL (
    SELECT * FROM outbox_messages AS o
    WHERE o.queue = :queue AND o.tenant_id = t.tenant_id AND o.sent_at IS NULL
      AND o.parked_at IS NULL AND o.available_at <= clock_timestamp()
      AND o.id <> ALL(CAST(:taken AS bigint[]))
    ORDER BY o.priority, o.available_at, o.id
    LIMIT t.n
    FOR UPDATE SKIP LOCKED
) AS c
"""
).bindparams(
    bindparam("tenants", type_=ARRAY(BigInteger)),
    bindparam("limits", type_=ARRAY(Integer)),
    bindparam("taken", type_=ARRAY(BigInteger)),
)
_PLATFORM_ROWS = text(
    f"""
SELECT id, run_id, queue, NULL::bigint AS tenant_id, envelope, attempts, available_at, priority
FROM platform_outbox_messages
WHERE queue = :queue AND {_PENDING_DUE} AND id <> ALL(CAST(:taken AS bigint[]))
  AND {PLATFORM_FILTER}
ORDER BY priority, available_at, id
LIMIT :limit
FOR UPDATE SKIP LOCKED
"""
).bindparams(bindparam("taken", type_=ARRAY(BigInteger)))


_MIN_TENANT_ID = -(2**63)
_START = ("", _MIN_TENANT_ID)


class Allowance(Protocol):
    """Rows a tenant may still be sent now under its rate limit; ``default`` when it has
    no limit (a ``dict`` will do)."""

    def get(self, tenant: int, default: int | None = None, /) -> int | None: ...


@dataclasses.dataclass
class QueueClaim:
    """What the fair claim did on one queue in one pass.

    Attributes:
        rows: The claimed rows, interleaved across tenants (send order).
        tenants: Tenants found with due rows (rate-limited ones included).
        throttled: Of those, tenants with no rate-limit allowance left (due rows of
            theirs may wait for the window).
        served: Tenants that got rows, or had their turn (throttled).
    """

    rows: list[ClaimedRow] = dataclasses.field(default_factory=list)
    tenants: list[int] = dataclasses.field(default_factory=list)
    throttled: list[int] = dataclasses.field(default_factory=list)
    served: set[int] = dataclasses.field(default_factory=set)


def shares(budget: int, weights: Sequence[int], caps: Sequence[int | None]) -> list[int]:
    """Split ``budget`` rows by weight: each entry gets ``floor(budget * w / sum(w))``, at
    least 1, at most its cap (None: no cap); rows left by the rounding go one each to the
    entries in list order; the total never exceeds ``budget`` (entries earlier in the list
    keep their share when it would).

    >>> shares(100, [1, 1], [None, None])
    [50, 50]
    >>> shares(17, [1, 1], [None, None])
    [9, 8]
    >>> shares(10, [3, 1], [None, 2])
    [8, 2]
    >>> shares(2, [1, 1, 1], [None, None, None])
    [1, 1, 0]
    """
    total = sum(weights)
    out: list[int] = []
    left = budget
    for weight, cap in zip(weights, caps, strict=True):
        share = max(1, math.floor(budget * weight / total)) if total else 0
        if cap is not None:
            share = min(share, cap)
        share = max(0, min(share, left))
        out.append(share)
        left -= share
    for i, cap in enumerate(caps):  # the rounding's remainder
        if left <= 0:
            break
        if out[i] and (cap is None or out[i] < cap):
            out[i] += 1
            left -= 1
    return out


@dataclasses.dataclass(frozen=True)
class Due:
    """What :meth:`FairClaimer.discover` found on one queue: the tenants with due rows (in
    round-robin order) and whether platform rows are due."""

    tenants: list[int]
    platform: bool


class FairClaimer:
    """Claims one pass's rows fairly (see the module docstring); keeps the round-robin
    cursor between passes (a ``(queue, tenant)`` pair of the fair index)."""

    def __init__(self) -> None:
        self._cursor: tuple[str, int] = _START
        self._walk: list[tuple[str, int]] = []
        self._cut_at: tuple[str, int] | None = None

    def discover(
        self, connection: Connection, *, most: int, partitions: Mapping[str, Any] = ALL
    ) -> dict[str, Due]:
        """The queues with due rows and their tenants, from the cursor (wrapping around),
        at most about ``most`` (queue, tenant) pairs of the owned ``partitions`` (the walk
        visits ``most / owned share`` pairs of any partition and keeps the owned ones). One
        statement (two when it wraps)."""
        count = int(partitions["partition_count"])
        walk = most if count == 1 else math.ceil(most * count / max(1, len(partitions["partitions"])))
        after_queue, after_tenant = self._cursor
        rows = connection.execute(
            _DISCOVER,
            {"after_queue": after_queue, "after_tenant": after_tenant, "most": walk, **partitions},
        ).all()
        # the walk's last pair comes back even when another relay owns it: it says the walk
        # was cut there (more pairs follow) and where the cursor goes next
        last = [(r.queue, int(r.tenant_id)) for r in rows if r.n == walk]
        pairs = [(r.queue, int(r.tenant_id)) for r in rows if r.tenant_id is not None and r.mine]
        platform = {r.queue for r in rows if r.tenant_id is None}
        if not last and self._cursor != _START:  # wrap around to the pairs before the cursor
            walked = max((int(r.n) for r in rows if r.n is not None), default=0)
            again = connection.execute(
                _DISCOVER,
                {
                    "after_queue": "",
                    "after_tenant": _MIN_TENANT_ID,
                    "most": max(1, walk - walked),
                    **partitions,
                },
            ).all()
            seen = set(pairs)
            before = [
                (r.queue, int(r.tenant_id), bool(r.mine), r.n)
                for r in again
                if r.tenant_id is not None and (r.queue, int(r.tenant_id)) <= self._cursor
            ]
            pairs += [(q, t) for q, t, mine, _ in before if mine and (q, t) not in seen]
            last = [(q, t) for q, t, _, n in before if n == max(1, walk - walked)]
        self._walk = pairs
        self._cut_at = last[0] if last else None
        found: dict[str, Due] = {}
        for queue, tenant in pairs:
            found.setdefault(queue, Due([], queue in platform)).tenants.append(tenant)
        for queue in platform - set(found):
            found[queue] = Due([], True)
        return found

    def advance(self, served: set[tuple[str, int]]) -> None:
        """Move the cursor after a pass: to just before the first (queue, tenant) pair the
        pass found but could not serve (it goes first next time), or past the last pair
        when the walk stopped at ``most``; otherwise back to the start."""
        for i, pair in enumerate(self._walk):
            if pair not in served:
                self._cursor = self._walk[i - 1] if i else self._cursor
                return
        self._cursor = self._cut_at if self._cut_at is not None else _START

    def claim_queue(
        self,
        connection: Connection,
        queue: str,
        due: Due,
        *,
        budget: int,
        weights: Mapping[int, int],
        allowance: Allowance,
        partitions: Mapping[str, Any] = ALL,
    ) -> QueueClaim:
        """Claim up to ``budget`` due rows of ``queue`` from both outbox tables.

        Args:
            connection: The relay's connection, in the pass's transaction.
            queue: Logical queue.
            due: What :meth:`discover` found on the queue.
            budget: Most rows to claim (batch size, less what SQS already holds).
            weights: Tenant weights (absent: 1).
            allowance: Rows each rate-limited tenant may still be sent now (absent:
                unlimited).
            partitions: The owned partitions (platform rows of others are left alone;
                ``due`` holds only owned tenants already).

        Returns:
            A :class:`QueueClaim`.
        """
        result = QueueClaim()
        if budget <= 0:
            return result
        tenants = due.tenants
        result.tenants = tenants
        result.throttled = [t for t in tenants if (allowance.get(t, 1) or 0) <= 0]
        servable = [t for t in tenants if (allowance.get(t, 1) or 0) > 0]
        platform_share = math.ceil(budget / (len(servable) + 1))
        platform = self._platform(
            connection, queue, limit=platform_share if due.platform else 0, taken=[], partitions=partitions
        )
        left = budget - len(platform)
        by_tenant: dict[int, list[ClaimedRow]] = {}
        if servable and left > 0:
            caps = [allowance.get(t) for t in servable]
            first = shares(left, [weights.get(t, 1) for t in servable], caps)
            got = self._tenant_rows(connection, queue, servable, first, taken=[])
            for row in got:
                by_tenant.setdefault(row.tenant_id or 0, []).append(row)
            left -= len(got)
            # second round: what some tenants could not use goes to those that filled their share
            full = [
                (t, cap)
                for t, n, cap in zip(servable, first, caps, strict=True)
                if n > 0 and len(by_tenant.get(t, [])) == n and (cap is None or cap > n)
            ]
            if full and left > 0:
                more = shares(
                    left,
                    [weights.get(t, 1) for t, _ in full],
                    [None if cap is None else cap - len(by_tenant[t]) for t, cap in full],
                )
                taken = [r.id for r in got]
                for row in self._tenant_rows(connection, queue, [t for t, _ in full], more, taken=taken):
                    by_tenant[row.tenant_id or 0].append(row)
                    left -= 1
        # a tenant that used its whole allowance may have more due rows: they wait for the window
        result.throttled += [
            t for t in servable if (cap := allowance.get(t)) is not None and len(by_tenant.get(t, [])) >= cap
        ]
        result.served = set(by_tenant) | set(result.throttled)
        if left > 0 and due.platform and len(platform) == platform_share:
            platform += self._platform(
                connection, queue, limit=left, taken=[r.id for r in platform], partitions=partitions
            )
        groups = [platform, *by_tenant.values()]
        result.rows = interleave(groups)
        return result

    @staticmethod
    def _tenant_rows(
        connection: Connection, queue: str, tenants: list[int], limits: list[int], *, taken: list[int]
    ) -> list[ClaimedRow]:
        pairs = [(t, n) for t, n in zip(tenants, limits, strict=True) if n > 0]
        if not pairs:
            return []
        rows = connection.execute(
            _TENANT_ROWS,
            {
                "queue": queue,
                "tenants": [t for t, _ in pairs],
                "limits": [n for _, n in pairs],
                "taken": taken,
            },
        ).all()
        return [_row("outbox_messages", r) for r in rows]

    @staticmethod
    def _platform(
        connection: Connection, queue: str, *, limit: int, taken: list[int], partitions: Mapping[str, Any]
    ) -> list[ClaimedRow]:
        if limit <= 0:
            return []
        rows = connection.execute(
            _PLATFORM_ROWS, {"queue": queue, "limit": limit, "taken": taken, **partitions}
        ).all()
        return [_row("platform_outbox_messages", r) for r in rows]


def _row(table: str, r: Any) -> ClaimedRow:
    return ClaimedRow(
        table=table,
        id=r.id,
        run_id=r.run_id,
        queue=r.queue,
        tenant_id=r.tenant_id,
        envelope=r.envelope,
        attempts=r.attempts,
        available_at=r.available_at,
        priority=r.priority,
    )


def interleave(groups: Sequence[Sequence[ClaimedRow]]) -> list[ClaimedRow]:
    """Rows of several tenants in send order: by priority, then by rank within their
    tenant (every tenant's first row before anyone's second), then by group."""
    keyed = [
        ((row.priority, rank, g), row)
        for g, group in enumerate(groups)
        for rank, row in enumerate(sorted(group, key=lambda r: (r.priority, r.available_at, r.id)))
    ]
    return [row for _, row in sorted(keyed, key=lambda item: item[0])]
