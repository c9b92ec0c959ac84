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
import time
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from sqla_outbox import metrics
from sqla_outbox.config import OutboxSettings
from sqla_outbox.logging import log_extra

logger = logging.getLogger("sqla_outbox.relay")

MAX_PARTITIONS = 1024
"""Upper bound of ``relay_partitions`` (far more than relays a database can serve)."""

DISAGREEMENT_LOG_SECONDS = 60.0
"""While relays with different ``relay_partitions`` run, each logs it this often."""

MEMBER_BASE = 1 << 20
"""Membership locks use ``objid = MEMBER_BASE + P``, above every partition number."""


PARTITION_OF = "abs(hashint8({key})::bigint) % CAST(:partition_count AS integer)"
"""SQL of a row's partition, ``{key}`` being ``tenant_id`` (tenant rows) or ``id``
(platform rows)."""


def _filter(key: str) -> str:
    return (
        "(CAST(:partition_count AS integer) = 1 OR "
        f"{PARTITION_OF.format(key=key)} "
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


_LOCK_ROWS = """
WHERE l.locktype = 'advisory' AND l.granted
  AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
  AND ((l.objsubid = 2 AND l.classid = CAST(:classid AS oid))
    OR (l.objsubid = 1 AND l.classid = CAST(:high AS oid) AND l.objid = CAST(:low AS oid)))
"""
_LOCKS = sa.text(
    "SELECT l.pid, l.objsubid, l.objid::bigint AS objid, NULL AS client, NULL::timestamptz AS since, "
    "NULL AS application FROM pg_locks AS l" + _LOCK_ROWS
)
"""The relays' locks, as every rebalance reads them (``pg_locks`` alone)."""
_LOCKS_SHOWN = sa.text(
    "SELECT l.pid, l.objsubid, l.objid::bigint AS objid, host(a.client_addr) AS client, "
    "a.backend_start AS since, a.application_name AS application "
    "FROM pg_locks AS l LEFT JOIN pg_stat_activity AS a ON a.pid = l.pid" + _LOCK_ROWS
)
"""The same, with each session's address, start and name for ``status`` (a
``pg_stat_activity`` snapshot, which the relays' rebalance does not need)."""

RELAY_APPLICATION_PREFIX = "sqla_outbox relay "
"""A relay's connections carry ``application_name = RELAY_APPLICATION_PREFIX + name``
(PostgreSQL keeps the first 63 bytes), so ``status`` can show the name its logs use."""


@dataclasses.dataclass(frozen=True)
class ActiveRelay:
    """A running relay, as ``python -m sqla_outbox status`` shows it.

    Attributes:
        pid: Its backend pid in PostgreSQL. name: The name in its logs (``host:pid`` by
            default; None when the reading role may not see other sessions).
        client: The address it connects from (None: a Unix socket or not visible).
        since: When its session started (UTC; None when not visible).
        relay_partitions: The ``relay_partitions`` it runs with.
        partitions: The partitions it owns (``[0]`` for the active relay with
            ``relay_partitions`` 1; empty for a relay waiting for a share).
        due: Unsent, unparked rows already due in the partitions it owns; None when not
            read. Rows held for want of a live worker or by a pause are not due: holding
            moves their ``available_at`` forward (:mod:`sqla_outbox.relay.hold`,
            :mod:`sqla_outbox.relay.pauses`).
        oldest_due_age_seconds: How long the oldest of them has been due (seconds); None
            when there is none or it was not read. A relay whose due rows keep ageing while
            the others' do not is the one to look at (hung, or throttled by SQS).
    """

    pid: int
    name: str | None
    client: str | None
    since: dt.datetime | None
    relay_partitions: int
    partitions: list[int]
    due: int | None = None
    oldest_due_age_seconds: float | None = None


@dataclasses.dataclass(frozen=True)
class Layout:
    """Who runs and who owns what, as ``pg_locks`` shows it.

    Attributes:
        members: Backend pid → ``relay_partitions`` of every relay that holds a
            membership lock, and of the active relay with ``relay_partitions`` 1 (its lock).
        owners: Partition lock number → backend pid holding it (whatever P it was taken
            under: the lock numbers of relays with different P overlap).
        single: Backend pid of the active relay with ``relay_partitions`` 1, if any.
        relays: Every running relay seen, for display.
    """

    members: dict[int, int]
    owners: dict[int, int]
    single: int | None = None
    relays: tuple[ActiveRelay, ...] = ()

    def count_of(self, pid: int) -> int:
        return sum(1 for owner in self.owners.values() if owner == pid)

    def others(self, count: int) -> dict[int, int]:
        """Members configured with another ``relay_partitions`` than ``count``."""
        return {pid: p for pid, p in self.members.items() if p != count}

    def others_own(self, count: int) -> bool:
        """A relay with another ``relay_partitions`` owns part of the outbox now."""
        other = self.others(count)
        return any(pid in other for pid in self.owners.values()) or (self.single is not None and count != 1)


def read_layout(connection: Connection, settings: OutboxSettings, *, shown: bool = False) -> Layout:
    """The relays running on this database and what they own (one ``pg_locks`` read;
    ``shown``: joined to ``pg_stat_activity`` for each relay's name, address and start,
    else those are None). Commits the connection's transaction."""
    key = settings.relay_lock_id & 0xFFFF_FFFF_FFFF_FFFF
    rows = connection.execute(
        _LOCKS_SHOWN if shown else _LOCKS,
        {"classid": class_id(settings), "high": key >> 32, "low": key & 0xFFFF_FFFF},
    ).all()
    connection.commit()
    members: dict[int, int] = {}
    owners: dict[int, int] = {}
    single: int | None = None
    seen: dict[int, Any] = {}
    for r in rows:
        seen[int(r.pid)] = r
        if r.objsubid == 1:
            single = int(r.pid)
            members[single] = 1
        elif r.objid >= MEMBER_BASE:
            members[int(r.pid)] = int(r.objid) - MEMBER_BASE
        else:
            owners[int(r.objid)] = int(r.pid)
    relays = []
    for pid, count in sorted(members.items(), key=lambda item: (item[0] != single, item[0])):
        row = seen[pid]
        app = row.application or ""
        relays.append(
            ActiveRelay(
                pid=pid,
                name=app.removeprefix(RELAY_APPLICATION_PREFIX)
                if app.startswith(RELAY_APPLICATION_PREFIX)
                else None,
                client=row.client,
                since=row.since,
                relay_partitions=count,
                partitions=[0] if pid == single else sorted(p for p, owner in owners.items() if owner == pid),
            )
        )
    relays.sort(key=lambda r: (min(r.partitions, default=MEMBER_BASE), r.pid))
    return Layout(members, owners, single, tuple(relays))


def active_relays(connection: Connection, settings: OutboxSettings) -> list[ActiveRelay]:
    """Every running relay (each holds a membership lock): active ones with what they own,
    standbys and relays waiting for a share with no partitions."""
    return list(read_layout(connection, settings, shown=True).relays)


_DUE_BY_PARTITION = sa.text(
    f"""
SELECT p, count(*) AS due, EXTRACT(EPOCH FROM clock_timestamp() - min(available_at))::float8 AS age
FROM (
    SELECT {PARTITION_OF.format(key="tenant_id")} AS p, available_at FROM outbox_messages
    WHERE sent_at IS NULL AND parked_at IS NULL AND available_at <= clock_timestamp()
    UNION ALL
    SELECT {PARTITION_OF.format(key="id")}, available_at FROM platform_outbox_messages
    WHERE sent_at IS NULL AND parked_at IS NULL AND available_at <= clock_timestamp()
) AS due
GROUP BY p
"""
)


def with_due_rows(connection: Connection, relays: list[ActiveRelay]) -> list[ActiveRelay]:
    """``relays`` with :attr:`ActiveRelay.due` and :attr:`ActiveRelay.oldest_due_age_seconds`
    filled in: the due rows of the partitions each one owns, counted with its own
    ``relay_partitions`` (one read of the unsent rows per value in use)."""
    by_count: dict[int, dict[int, tuple[int, float]]] = {}
    for count in sorted({r.relay_partitions for r in relays}):
        rows = connection.execute(_DUE_BY_PARTITION, {"partition_count": count})
        by_count[count] = {int(row.p): (int(row.due), float(row.age)) for row in rows}
    filled = []
    for relay in relays:
        found = [by_count[relay.relay_partitions].get(p) for p in relay.partitions]
        counts = [f for f in found if f is not None]
        filled.append(
            dataclasses.replace(
                relay,
                due=sum(c for c, _ in counts),
                oldest_due_age_seconds=max((age for _, age in counts), default=None),
            )
        )
    return filled


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
        self._warned_at = float("-inf")
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
        if not self._member:  # every relay, standbys included, so status and the others see it
            connection.execute(
                sa.text("SELECT pg_advisory_lock_shared(:c, :o)"),
                {"c": self._classid, "o": MEMBER_BASE + self.count},
            )
            self._pid = int(connection.execute(sa.text("SELECT pg_backend_pid()")).scalar_one())
            connection.commit()
            self._member = True
        if self.count == 1:
            if 0 not in self.owned:
                layout = read_layout(connection, self.settings)
                self._warn_disagreement(layout)
                if not layout.others_own(1) and self._try(
                    connection, "SELECT pg_try_advisory_lock(:k)", k=self._lock_id
                ):
                    self.owned.add(0)
                    self._publish()
            return bool(self.owned)
        self.rebalance(connection)
        return bool(self.owned)

    def take_all_free(self, connection: Connection) -> bool:
        """Lock every partition no one holds, without joining (``relay --once``)."""
        if self.count == 1:
            return self.join(connection)
        layout = read_layout(connection, self.settings)
        self._warn_disagreement(layout)
        if layout.others_own(self.count):
            return False
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
            if 0 in self.owned:  # the active relay: only look for relays of another value
                self._warn_disagreement(read_layout(connection, self.settings))
                return Change()
            return Change(gained=(0,)) if self.join(connection) else Change()
        layout = read_layout(connection, self.settings)
        self._warn_disagreement(layout)
        same = {pid for pid, count in layout.members.items() if count == self.count}
        if self._pid is not None:
            same.add(self._pid)
        members = max(1, len(same))  # relays of another relay_partitions are not counted
        floor, ceil = self.count // members, math.ceil(self.count / members)
        starved = any(layout.count_of(pid) < floor for pid in same if pid != self._pid)
        lost: list[int] = []
        keep = floor if starved else ceil
        for partition in sorted(self.owned, reverse=True)[: max(0, len(self.owned) - keep)]:
            self._unlock_partition(connection, partition)  # highest first: partition 0 moves last
            lost.append(partition)
        gained: list[int] = []
        # take free partitions up to the share; while another relay is below the floor, only
        # a relay that is itself below it takes any (the others leave them to it)
        target = ceil if (len(self.owned) < floor or not starved) else len(self.owned)
        if layout.others_own(self.count):
            target = len(self.owned)  # relays with another relay_partitions run: wait for them to go
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
    def _warn_disagreement(self, layout: Layout) -> None:
        """Relays with another ``relay_partitions`` run on this database: log it (at most
        once a minute while it lasts). A relay never takes partitions while relays of
        another value own some, so a mistaken value waits instead of splitting the work
        two ways; relays already active keep going."""
        others = {pid: count for pid, count in layout.others(self.count).items() if pid != self._pid}
        metrics.RELAY_PARTITIONS_DISAGREE.set(1 if others else 0)
        now = time.monotonic()
        if not others or now - self._warned_at < DISAGREEMENT_LOG_SECONDS:
            return
        self._warned_at = now
        values = sorted(set(others.values()))
        logger.warning(  # a warning: it is also the normal state during a rolling change of P
            "relays of this database disagree on relay_partitions; set the same value everywhere",
            extra=log_extra(
                action="relay.partitions_disagree",
                relay=self.name,
                partitions=self.count,
                others=",".join(str(v) for v in values),
                other_relays=len(others),
                waiting=not self.owned,
            ),
        )

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
