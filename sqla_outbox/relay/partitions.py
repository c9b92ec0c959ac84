"""Several active relays: the outbox split into partitions, each owned by one relay at a time.

With ``relay_partitions = 1`` (the default) one relay is active per database, elected by
the session-level advisory lock ``relay_lock_id``, and the others are hot standbys. With
``relay_partitions = P > 1`` every row belongs to one of P partitions and up to P relays
are active at once, each claiming only the rows of the partitions it owns:

* **Partition of a row.** A tenant row's partition is ``abs(hashint8(tenant_id)) % P``,
  so all of a tenant's rows are in one partition and one relay sends them: its fair
  share, priority order and rate-limit window stay exact. A platform row's partition is
  ``abs(hashint8(id)) % P``. ``hashint8`` is PostgreSQL's built-in hash of a bigint
  (the one hash partitioning and hash indexes use); it is computed by the database, so
  every relay agrees.
* **Ownership.** Partition ``p`` is owned by the session that holds the advisory lock
  ``(classid, p)`` (the two-int4 form; ``classid`` is ``relay_lock_id`` masked to 31
  bits). A session lock ends with its session, so a relay killed with ``kill -9`` frees
  its partitions as soon as PostgreSQL notices the connection is gone. A relay claims
  only inside a transaction on the session that holds the lock, so two relays never
  claim the same partition at once; and even then ``FOR UPDATE SKIP LOCKED`` plus the
  ``sent_at IS NULL`` recheck would keep a row from being sent twice by two live relays.
* **Membership.** Each relay also holds a shared advisory lock ``(classid, MEMBER_BASE +
  P)``; the relays alive are the holders of those locks in ``pg_locks`` (any role may
  read it). A relay whose P differs from another's shows up there too and is reported
  (``action="relay.partitions_disagree"``).
* **Rebalancing.** Every ``relay_standby_poll_seconds`` each relay reads the owners from
  ``pg_locks`` and moves toward an even split (``floor(P / relays)`` or one more each):
  it releases partitions above its share while another relay is below the floor, and
  takes free partitions while it is below its share (leaving them to relays further
  below the floor first). A partition changes hands only between passes, after the
  releasing relay committed its claims.
* **Work that needs one relay** (the scheduler, which already fires each slot once
  through its durable slot rows) runs in the owner of partition 0.

The rule the other relay modules follow: every claim, every "next due" probe and every
release of held rows filters on :data:`TENANT_FILTER` / :data:`PLATFORM_FILTER` with the
parameters of :meth:`Ownership.params`.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import logging
import math
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from sqla_outbox import metrics
from sqla_outbox.config import OutboxSettings
from sqla_outbox.logging import log_extra

logger = logging.getLogger("sqla_outbox.relay")

MAX_PARTITIONS = 1024
"""Upper bound of ``relay_partitions`` (far more than relays a database can serve)."""

MEMBER_BASE = 1 << 20
"""Membership locks use ``objid = MEMBER_BASE + P``, above every partition number."""


def _filter(key: str) -> str:
    return (
        "(CAST(:partition_count AS integer) = 1 OR "
        f"abs(hashint8({key})::bigint) % CAST(:partition_count AS integer) "
        "= ANY(CAST(:partitions AS integer[])))"
    )


TENANT_FILTER = _filter("tenant_id")
"""SQL predicate: the tenant row (column ``tenant_id``) is in an owned partition."""
PLATFORM_FILTER = _filter("id")
"""SQL predicate: the platform row (column ``id``) is in an owned partition."""


def filter_for(table: str, alias: str = "") -> str:
    """:data:`TENANT_FILTER` for ``outbox_messages``, :data:`PLATFORM_FILTER` for
    ``platform_outbox_messages``, with columns qualified by ``alias`` when given."""
    prefix = f"{alias}." if alias else ""
    return _filter(f"{prefix}tenant_id" if table == "outbox_messages" else f"{prefix}id")


ALL: dict[str, Any] = {"partition_count": 1, "partitions": [0]}
"""Parameters of the filters that match every row (one relay, or a caller that owns all)."""


_OWNERS = sa.text(
    """
SELECT objid::bigint AS objid, pid, mode FROM pg_locks
WHERE locktype = 'advisory' AND granted AND objsubid = 2 AND classid = CAST(:classid AS oid)
  AND database = (SELECT oid FROM pg_database WHERE datname = current_database())
"""
)


@dataclasses.dataclass(frozen=True)
class Layout:
    """Who owns what, as ``pg_locks`` shows it.

    Attributes:
        members: Backend pids of the relays alive (membership locks), any P.
        owners: Partition → backend pid holding it.
        disagreeing: Membership lock ids of relays configured with another P.
    """

    members: frozenset[int]
    owners: dict[int, int]
    disagreeing: frozenset[int] = frozenset()

    def count_of(self, pid: int) -> int:
        return sum(1 for owner in self.owners.values() if owner == pid)


def read_layout(connection: Connection, settings: OutboxSettings) -> Layout:
    """The relays alive and the partition owners of ``settings``' lock class (one
    ``pg_locks`` read; commits the connection's transaction)."""
    count = settings.relay_partitions
    rows = connection.execute(_OWNERS, {"classid": class_id(settings)}).all()
    connection.commit()
    members = frozenset(r.pid for r in rows if r.objid >= MEMBER_BASE)
    other = frozenset(int(r.objid) - MEMBER_BASE for r in rows if r.objid >= MEMBER_BASE) - {count}
    owners = {int(r.objid): int(r.pid) for r in rows if r.objid < MEMBER_BASE}
    return Layout(members, owners, other)


@dataclasses.dataclass(frozen=True)
class ActiveRelay:
    """A relay that owns part of the outbox, as ``python -m sqla_outbox status`` shows it.

    Attributes:
        pid: Its backend pid in PostgreSQL. client: The address it connects from (None: a
            Unix socket). since: When its session started (UTC).
        partitions: The partitions it owns (``[0]`` with ``relay_partitions`` 1).
    """

    pid: int
    client: str | None
    since: dt.datetime | None
    partitions: list[int]


_ACTIVE = sa.text(
    """
SELECT l.pid, host(a.client_addr) AS client, a.backend_start AS since,
       array_agg(CASE WHEN l.objsubid = 1 THEN 0 ELSE l.objid::bigint END ORDER BY l.objid) AS partitions
FROM pg_locks AS l LEFT JOIN pg_stat_activity AS a ON a.pid = l.pid
WHERE l.locktype = 'advisory' AND l.granted AND l.mode = 'ExclusiveLock'
  AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
  AND ((l.objsubid = 2 AND l.classid = CAST(:classid AS oid) AND l.objid < CAST(:member_base AS oid))
    OR (l.objsubid = 1 AND l.classid = CAST(:high AS oid) AND l.objid = CAST(:low AS oid)))
GROUP BY l.pid, a.client_addr, a.backend_start
ORDER BY min(l.objid)
"""
)


def active_relays(connection: Connection, settings: OutboxSettings) -> list[ActiveRelay]:
    """The relays that own partitions now (one with ``relay_partitions`` 1), from
    ``pg_locks``; a relay's address and start come from ``pg_stat_activity`` (None when
    the reading role may not see other sessions)."""
    key = settings.relay_lock_id & 0xFFFF_FFFF_FFFF_FFFF
    rows = connection.execute(
        _ACTIVE,
        {
            "classid": class_id(settings),
            "member_base": MEMBER_BASE,
            "high": key >> 32,
            "low": key & 0xFFFF_FFFF,
        },
    ).all()
    return [ActiveRelay(int(r.pid), r.client, r.since, [int(p) for p in r.partitions]) for r in rows]


def class_id(settings: OutboxSettings) -> int:
    """The advisory ``classid`` of the partition and membership locks (int4, >= 0)."""
    return settings.relay_lock_id & 0x7FFF_FFFF


@dataclasses.dataclass(frozen=True)
class Change:
    """Partitions a rebalance took and gave up."""

    gained: tuple[int, ...] = ()
    lost: tuple[int, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.gained or self.lost)


class Ownership:
    """The partitions one relay owns, on its claim connection.

    Args:
        settings: Uses ``relay_partitions`` and ``relay_lock_id``.
        name: The relay's name, for logs.

    With one partition it is the single-relay election of before: partition 0 is the
    bigint advisory lock ``relay_lock_id`` itself (no membership lock).
    """

    def __init__(self, settings: OutboxSettings, name: str) -> None:
        self.settings = settings
        self.count = settings.relay_partitions
        self.name = name
        self.owned: set[int] = set()
        self._member = False
        self._classid = class_id(settings)
        self._pid: int | None = None
        self._warned_disagree = False
        self.relays = 1
        """Relays alive at the last rebalance."""

    # --- what the claims use -------------------------------------------------------------
    def params(self) -> dict[str, Any]:
        """Bind parameters of :data:`TENANT_FILTER` / :data:`PLATFORM_FILTER`."""
        if self.count == 1 or len(self.owned) == self.count:
            return ALL
        return {"partition_count": self.count, "partitions": sorted(self.owned)}

    @property
    def share(self) -> float:
        """Owned fraction of the outbox (0..1)."""
        return len(self.owned) / self.count

    @property
    def runs_singletons(self) -> bool:
        """This relay runs the once-per-database work (the scheduler): it owns partition 0."""
        return 0 in self.owned

    # --- taking and giving up ------------------------------------------------------------
    def join(self, connection: Connection) -> bool:
        """Become a member and take this relay's share of the free partitions.

        Returns:
            True when at least one partition is owned now (the relay is active).
        """
        if self.count == 1:
            if 0 not in self.owned and self._try(
                connection, "SELECT pg_try_advisory_lock(:k)", k=self._lock_id
            ):
                self.owned.add(0)
                self._publish()
            return bool(self.owned)
        if not self._member:
            connection.execute(
                sa.text("SELECT pg_advisory_lock_shared(:c, :o)"),
                {"c": self._classid, "o": MEMBER_BASE + self.count},
            )
            self._pid = int(connection.execute(sa.text("SELECT pg_backend_pid()")).scalar_one())
            connection.commit()
            self._member = True
        self.rebalance(connection)
        return bool(self.owned)

    def take_all_free(self, connection: Connection) -> bool:
        """Lock every partition no one holds, without joining (``relay --once``)."""
        if self.count == 1:
            return self.join(connection)
        for partition in range(self.count):
            if partition not in self.owned and self._try_partition(connection, partition):
                self.owned.add(partition)
        self._publish()
        return bool(self.owned)

    def rebalance(self, connection: Connection) -> Change:
        """Move one step toward an even split (see the module docstring).

        Runs between passes (no claim transaction open). Returns what changed.
        """
        if self.count == 1:
            joined = 0 not in self.owned and self.join(connection)
            return Change(gained=(0,)) if joined else Change()
        layout = read_layout(connection, self.settings)
        if layout.disagreeing and not self._warned_disagree:
            self._warned_disagree = True
            logger.error(
                "relays of this database disagree on relay_partitions; set the same value everywhere",
                extra=log_extra(
                    action="relay.partitions_disagree",
                    relay=self.name,
                    partitions=self.count,
                    others=",".join(str(p) for p in sorted(layout.disagreeing)),
                ),
            )
        members = max(1, len(layout.members))
        floor, ceil = self.count // members, math.ceil(self.count / members)
        starved = any(layout.count_of(pid) < floor for pid in layout.members if pid != self._pid)
        lost: list[int] = []
        keep = floor if starved else ceil
        for partition in sorted(self.owned, reverse=True)[: max(0, len(self.owned) - keep)]:
            self._unlock_partition(connection, partition)  # highest first: partition 0 moves last
            lost.append(partition)
        gained: list[int] = []
        # take free partitions up to the share; while another relay is below the floor, only
        # a relay that is itself below it takes any (the others leave them to it)
        target = ceil if (len(self.owned) < floor or not starved) else len(self.owned)
        free = [p for p in range(self.count) if p not in layout.owners and p not in self.owned]
        for partition in free:
            if len(self.owned) >= target:
                break
            if self._try_partition(connection, partition):
                self.owned.add(partition)
                gained.append(partition)
        self.relays = members
        change = Change(tuple(gained), tuple(lost))
        if change:
            self._publish()
            logger.info(
                "relay partitions changed",
                extra=log_extra(
                    action="relay.partitions",
                    relay=self.name,
                    relays=members,
                    owned=",".join(str(p) for p in sorted(self.owned)) or "-",
                    gained=len(gained),
                    released=len(lost),
                ),
            )
        return change

    def release(self, connection: Connection) -> None:
        """Give up every partition and the membership (a clean stop)."""
        try:
            if self.count == 1:
                if self.owned:
                    connection.execute(sa.text("SELECT pg_advisory_unlock(:k)"), {"k": self._lock_id})
            else:
                for partition in sorted(self.owned):
                    connection.execute(
                        sa.text("SELECT pg_advisory_unlock(:c, :p)"), {"c": self._classid, "p": partition}
                    )
                if self._member:
                    connection.execute(
                        sa.text("SELECT pg_advisory_unlock_shared(:c, :o)"),
                        {"c": self._classid, "o": MEMBER_BASE + self.count},
                    )
            connection.commit()
        except sa.exc.DBAPIError:  # the session is gone; so are its locks
            pass
        self.lost()

    def lost(self) -> None:
        """The session ended (or was given up): nothing is owned any more."""
        self.owned.clear()
        self._member = False
        self._pid = None
        self._publish()

    # --- internals -----------------------------------------------------------------------
    @property
    def _lock_id(self) -> int:
        return self.settings.relay_lock_id

    def _try_partition(self, connection: Connection, partition: int) -> bool:
        return self._try(connection, "SELECT pg_try_advisory_lock(:c, :p)", c=self._classid, p=partition)

    def _unlock_partition(self, connection: Connection, partition: int) -> None:
        connection.execute(sa.text("SELECT pg_advisory_unlock(:c, :p)"), {"c": self._classid, "p": partition})
        connection.commit()
        self.owned.discard(partition)

    @staticmethod
    def _try(connection: Connection, statement: str, **params: int) -> bool:
        got = bool(connection.execute(sa.text(statement), params).scalar())
        connection.commit()
        return got

    def _publish(self) -> None:
        metrics.RELAY_PARTITIONS_OWNED.set(len(self.owned))
