"""The worker's engine (issue 17): a bounded pool, and an idle connection pinged before use."""

from __future__ import annotations

import pytest
import sqlalchemy as sa

from sqla_outbox.config import OutboxSettings
from sqla_outbox.worker import engine as worker_engine


def test_the_pool_is_the_setting_without_overflow(settings: OutboxSettings) -> None:
    engine = worker_engine.make_worker_engine(settings.replace(worker_db_pool_size=2))
    try:
        assert (engine.pool.size(), engine.pool._max_overflow) == (2, 0)  # type: ignore[attr-defined]
    finally:
        engine.dispose()


def test_an_idle_connection_that_died_is_replaced_at_checkout(settings: OutboxSettings) -> None:
    engine = sa.create_engine(settings.sqlalchemy_url, pool_size=1, max_overflow=0)
    worker_engine.ping_idle_connections(engine, idle_seconds=0.0)
    try:
        with engine.connect() as conn:
            pid = conn.exec_driver_sql("SELECT pg_backend_pid()").scalar_one()
        with sa.create_engine(settings.sqlalchemy_url).connect() as other:
            other.exec_driver_sql(f"SELECT pg_terminate_backend({int(pid)})")
        with engine.connect() as conn:  # the ping finds it dead; the pool opens another
            assert conn.exec_driver_sql("SELECT pg_backend_pid()").scalar_one() != pid
    finally:
        engine.dispose()


def test_a_connection_used_moments_ago_is_not_pinged(settings: OutboxSettings) -> None:
    """No ping within the idle threshold: a connection that died meanwhile fails its
    statement (the worker's run then comes back with its message) instead of costing every
    checkout a round trip."""
    engine = sa.create_engine(settings.sqlalchemy_url, pool_size=1, max_overflow=0)
    worker_engine.ping_idle_connections(engine, idle_seconds=60.0)
    try:
        with engine.connect() as conn:
            pid = conn.exec_driver_sql("SELECT pg_backend_pid()").scalar_one()
        with sa.create_engine(settings.sqlalchemy_url).connect() as other:
            other.exec_driver_sql(f"SELECT pg_terminate_backend({int(pid)})")
        with pytest.raises(sa.exc.OperationalError), engine.connect() as conn:
            conn.exec_driver_sql("SELECT 1")
    finally:
        engine.dispose()
