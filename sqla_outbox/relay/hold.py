"""Holding back rows no live worker can run (rolling deploys), inside the relay's pass.

Before sending a claimed batch, the relay checks each row's task and queue against the
live workers (:mod:`sqla_outbox.presence`, refreshed every
:data:`COVERAGE_REFRESH_SECONDS`). A row no live worker implements is *held*: it stays
pending (``sent_at`` NULL) with ``available_at`` pushed forward, in the claiming
transaction; ``attempts`` is unchanged (it counts failed sends, and this is not one). So
the message never cycles through SQS: no receive is spent, no DLQ is reached, and
``python -m sqla_outbox status`` shows the task waiting, with how long.

The hold grows with the row's age (a quarter of it, from :data:`HOLD_MIN_SECONDS` to
:data:`HOLD_MAX_SECONDS`), so a long-unimplemented task costs one update per row every
minute at most. When a (task, queue) pair becomes served (a worker with the new code
registered), the held rows of that task are released at once: those whose outbox
``available_at`` is in the future although their run is due (held, or deferred by a
worker, or backing off after a failed send) become due now.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from typing import Any

from sqlalchemy import Float, Text, bindparam
from sqlalchemy.dialects.postgresql import ARRAY
from sqlalchemy.engine import Connection

from sqla_outbox import metrics, presence
from sqla_outbox.lifecycle import sending
from sqla_outbox.logging import log_extra
from sqla_outbox.relay.claim import TABLES, ClaimedRow
from sqla_outbox.relay.partitions import ALL, filter_for

logger = logging.getLogger("sqla_outbox.relay")

COVERAGE_REFRESH_SECONDS = 2.0
"""How often the relay re-reads the live workers."""

HOLD_MIN_SECONDS = 5.0
HOLD_MAX_SECONDS = 60.0

_HOLD = {
    table: sending.hold_statement(
        table,
        until="clock_timestamp() + make_interval(secs => LEAST(:max_seconds, "
        "GREATEST(:min_seconds, EXTRACT(EPOCH FROM clock_timestamp() - o.created_at) / 4)))",
    ).bindparams(bindparam("min_seconds", type_=Float), bindparam("max_seconds", type_=Float))
    for table in TABLES
}

_RELEASE = {
    table: sending.release_statement(
        table,
        which="(o.envelope->>'task', o.queue) IN ("
        "SELECT * FROM unnest(CAST(:tasks AS text[]), CAST(:queues AS text[]))) "
        f"AND {filter_for(table, 'o')}",
    ).bindparams(bindparam("tasks", type_=ARRAY(Text)), bindparam("queues", type_=ARRAY(Text)))
    for table in TABLES
}


class Holder:
    """The relay's view of which rows a live worker can run, and the hold itself."""

    def __init__(self) -> None:
        self.coverage = presence.Coverage(frozenset(), 0)
        self._refreshed_at = float("-inf")
        self.held_total = 0

    def refresh(self, connection: Connection, partitions: Mapping[str, Any] = ALL) -> int:
        """Re-read the live workers (at most every :data:`COVERAGE_REFRESH_SECONDS`);
        release the held rows (of the owned ``partitions``) of pairs that became served.
        Returns rows released. Runs in the caller's transaction."""
        now = time.monotonic()
        if now - self._refreshed_at < COVERAGE_REFRESH_SECONDS:
            return 0
        self._refreshed_at = now
        before = self.coverage
        self.coverage = presence.Coverage.of(presence.live_workers(connection))
        if (before.workers, before.pairs) != (self.coverage.workers, self.coverage.pairs):
            logger.info(
                "live workers changed",
                extra=log_extra(
                    action="relay.workers",
                    workers=self.coverage.workers,
                    tasks=len({task for task, _ in self.coverage.pairs}),
                ),
            )
        if before.workers == 0:
            return 0  # nothing was held while no worker was known
        new = sorted(self.coverage.pairs - before.pairs)
        if not new:
            return 0
        params = {"tasks": [t for t, _ in new], "queues": [q for _, q in new], **partitions}
        released = sum(int(connection.execute(_RELEASE[table], params).rowcount or 0) for table in TABLES)
        if released:
            logger.info(
                "held runs released: a worker now implements their task",
                extra=log_extra(
                    action="relay.released", rows=released, tasks=",".join(sorted({t for t, _ in new}))
                ),
            )
        return released

    def reread_soon(self) -> None:
        """Re-read the live workers at the next pass (instead of within two seconds)."""
        self._refreshed_at = float("-inf")

    def split(self, connection: Connection, rows: Sequence[ClaimedRow]) -> list[ClaimedRow]:
        """Hold the rows no live worker can run; return the others (to send).

        Runs in the claiming transaction, on rows it locked.
        """
        keep: list[ClaimedRow] = []
        held: dict[str, list[ClaimedRow]] = {}
        for row in rows:
            task = row.envelope.get("task") if isinstance(row.envelope, dict) else None
            if not isinstance(task, str) or self.coverage.serves(task, row.queue):
                keep.append(row)  # (a row without a readable task is sent: the worker judges it)
            else:
                held.setdefault(row.table, []).append(row)
        for table, items in held.items():
            connection.execute(
                _HOLD[table],
                {
                    "ids": [r.id for r in items],
                    "min_seconds": HOLD_MIN_SECONDS,
                    "max_seconds": HOLD_MAX_SECONDS,
                },
            )
            for row in items:
                metrics.RELAY_HELD.labels(str(row.envelope.get("task"))).inc()
        count = sum(len(items) for items in held.values())
        if count:
            self.held_total += count
            logger.debug(
                "rows held: no live worker implements their task",
                extra=log_extra(action="relay.held", rows=count),
            )
        return keep
