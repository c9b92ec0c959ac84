"""The database engines of the relay and the worker: libpq options and the bookkeeping engine.

Both processes hold connections for minutes or hours (the relay's lock session, the worker's
pool) and must notice a server or network that vanished without closing them: TCP
keepalives (:data:`ENGINE_CONNECT_ARGS`) do, within about 25 s. Errors never carry a
statement's parameters (``hide_parameters``): those are envelopes and payloads, which are
never logged (``docs/security.md``).

The relay uses :func:`make_engine`; the worker builds its own pools on the same libpq options
(:mod:`sqla_outbox.worker.engine`). This module sits below both (``docs/architecture.md``),
since the relay may not import the worker nor the worker the relay, and it imports neither
boto3 nor redis.
"""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Engine

from sqla_outbox.config import OutboxSettings

ENGINE_CONNECT_ARGS: dict[str, Any] = {
    "keepalives": 1,
    "keepalives_idle": 10,
    "keepalives_interval": 5,
    "keepalives_count": 3,
    "application_name": "sqla_outbox",
}
"""libpq options of the relay's and the worker's engines: TCP keepalives notice a vanished
peer within about 25 s (10 s idle, then 3 probes 5 s apart)."""


def make_engine(
    settings: OutboxSettings, *, pool_size: int = 2, application_name: str | None = None
) -> Engine:
    """Engine for relay/worker bookkeeping: pre-ping, TCP keepalives so a vanished peer is
    noticed within about 25 s, and ``hide_parameters`` so a failed statement's error never
    carries its parameters (an envelope, a payload) into a log line.

    Args:
        settings: Uses ``sqlalchemy_url`` (``database_url`` with the psycopg 3 driver).
        pool_size: Connections the pool keeps; up to 2 more overflow.
        application_name: The sessions' ``application_name`` (default ``sqla_outbox``);
            PostgreSQL keeps its first 63 bytes.

    Returns:
        An engine that has not connected yet (it connects on first use).
    """
    connect_args = dict(ENGINE_CONNECT_ARGS)
    if application_name is not None:
        connect_args["application_name"] = application_name
    return sa.create_engine(
        settings.sqlalchemy_url,
        pool_size=pool_size,
        max_overflow=2,
        pool_pre_ping=True,
        hide_parameters=True,
        connect_args=connect_args,
    )
