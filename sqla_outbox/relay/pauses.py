"""Keeping a paused task's, tenant's or queue's rows pending, inside the relay's pass.

The relay re-reads ``flow_pauses`` every ``flow_refresh_seconds`` (one small query; a
new pause applies within that time, as it does on the workers). A claimed row whose
task, tenant or queue is paused is not sent: in the claiming
transaction its ``available_at`` moves :data:`~sqla_outbox.flow.PAUSE_HOLD_SECONDS`
ahead and nothing else changes (``attempts`` counts failed sends; this is not one; the
run stays ``queued``). :func:`sqla_outbox.flow.resume` makes such rows due again at once.

The hold statement re-checks the pause in SQL: a row whose pause ended after the relay
read the pauses (a resume) is not held but sent in the same pass.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from sqlalchemy import Float, bindparam
from sqlalchemy.engine import Connection

from sqla_outbox import flow, metrics
from sqla_outbox.lifecycle import sending
from sqla_outbox.logging import log_extra
from sqla_outbox.relay.claim import TABLES, ClaimedRow

logger = logging.getLogger("sqla_outbox.relay")


def _hold_sql(table: str) -> Any:
    tenant = "OR (p.scope = 'tenant' AND p.target = o.tenant_id::text)" if table == "outbox_messages" else ""
    return sending.hold_statement(
        table,
        until="clock_timestamp() + make_interval(secs => :seconds)",
        unless="EXISTS (SELECT 1 FROM flow_pauses AS p WHERE (p.scope = 'queue' AND p.target = o.queue) "
        f"OR (p.scope = 'task' AND p.target = o.envelope->>'task') {tenant})",
    ).bindparams(bindparam("seconds", type_=Float))


_HOLD = {table: _hold_sql(table) for table in TABLES}


def split(connection: Connection, rows: Sequence[ClaimedRow], pauses: flow.Pauses) -> list[ClaimedRow]:
    """Hold the rows a pause applies to; return the others (to send).

    Runs in the claiming transaction, on rows it locked. A row whose pause ended since
    ``pauses`` was read is not held (the statement re-checks) and is returned to send.
    """
    if not pauses:
        return list(rows)
    keep: list[ClaimedRow] = []
    held: dict[str, list[ClaimedRow]] = {}
    scopes: dict[int, str] = {}
    for row in rows:
        task = row.envelope.get("task") if isinstance(row.envelope, dict) else None
        blocking = pauses.blocking(task if isinstance(task, str) else None, row.tenant_id, row.queue)
        if blocking is None:
            keep.append(row)
        else:
            held.setdefault(row.table, []).append(row)
            scopes[row.id] = blocking.scope
    count = 0
    for table, items in held.items():
        done = set(
            connection.execute(
                _HOLD[table], {"ids": [r.id for r in items], "seconds": flow.PAUSE_HOLD_SECONDS}
            ).scalars()
        )
        keep.extend(r for r in items if r.id not in done)  # resumed meanwhile: send
        count += len(done)
        for row_id in done:
            metrics.RELAY_PAUSED.labels(scopes[row_id]).inc()
    if count:
        logger.debug("rows held: paused", extra=log_extra(action="relay.paused", rows=count))
    return keep
