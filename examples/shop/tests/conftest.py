"""The shop's test fixtures: a real database built by the shop's own Alembic environment.

An application's tests, as the shop would write them:

* once per test session, a template database is migrated with ``alembic upgrade heads``
  (the shop's revisions plus sqla_outbox's, run in a subprocess the way a deployment
  runs them, with ``SHOP_DATABASE_URL`` pointing at it);
* each test gets its own copy of it (``CREATE DATABASE ... TEMPLATE``), because the
  outbox listeners need real COMMITs;
* ``shop_sessions`` is the shop's installed ``sessionmaker``; overriding
  ``outbox_session_factory`` with it gives sqla_outbox's ``outbox`` fixture (from the
  pytest plugin that installing sqla_outbox registers) a database to read and run.

The PostgreSQL server is sqla_outbox's ``outbox_postgres_server`` fixture: the server at
``DATABASE_URL`` (default ``postgresql://postgres@127.0.0.1:5432/test``) when it answers,
else an embedded one in a temporary folder (the ``embedded`` extra), so the suite also
runs where CI has no database service. Databases are created beside it.
"""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import psycopg
import pytest
import sqlalchemy as sa
from psycopg import sql
from sqlalchemy.orm import Session, sessionmaker

import examples.shop.tasks  # noqa: F401  (registers the shop's handlers with @task)
import sqla_outbox
from sqla_outbox.config import sqlalchemy_url

SHOP = Path(__file__).resolve().parents[1]
ROOT = SHOP.parents[1]


def _database_url(server: str, name: str) -> str:
    parts = urlsplit(server)
    return urlunsplit((parts.scheme, parts.netloc, "/" + name, parts.query, parts.fragment))


def _drop(server: str, name: str) -> None:
    with psycopg.connect(server, autocommit=True) as conn:
        conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))


@pytest.fixture(scope="session")
def shop_template(outbox_postgres_server: str) -> Iterator[str]:
    """Name of a database migrated to the shop's heads (the seed's welcome runs included)."""
    server = outbox_postgres_server
    name = f"shop_tpl_{os.getpid()}"
    _drop(server, name)
    with psycopg.connect(server, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    env = {k: v for k, v in os.environ.items() if not k.startswith("SQLA_OUTBOX_")}
    env["SHOP_DATABASE_URL"] = _database_url(server, name)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    result = subprocess.run(
        [sys.executable, "-m", "alembic", "-c", str(SHOP / "alembic.ini"), "upgrade", "heads"],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=120,
    )
    if result.returncode != 0:
        _drop(server, name)
        pytest.fail(f"alembic upgrade heads failed:\n{result.stderr[-3000:]}", pytrace=False)
    yield name
    _drop(server, name)


@pytest.fixture
def shop_engine(outbox_postgres_server: str, shop_template: str) -> Iterator[sa.Engine]:
    """Engine on this test's own copy of the shop database."""
    server = outbox_postgres_server
    name = f"shop_{uuid.uuid4().hex[:16]}"
    with psycopg.connect(server, autocommit=True) as conn:
        conn.execute(
            sql.SQL("CREATE DATABASE {} TEMPLATE {}").format(
                sql.Identifier(name), sql.Identifier(shop_template)
            )
        )
    engine = sa.create_engine(sqlalchemy_url(_database_url(server, name)))
    yield engine
    engine.dispose()
    _drop(server, name)


@pytest.fixture
def shop_sessions(shop_engine: sa.Engine) -> Iterator[sessionmaker[Session]]:
    """The shop's session factory, installed as its composition root would install it.

    No wake in tests (``wake_mode="none"``): nothing relays, so nothing needs waking.
    """
    factory = sessionmaker(shop_engine)
    sqla_outbox.install(
        factory,
        sqla_outbox.OutboxSettings(wake_mode="none"),
        catalog=sqla_outbox.Catalog.load(SHOP / "tasks.json"),
    )
    yield factory
    sqla_outbox.uninstall(factory)


@pytest.fixture
def outbox_session_factory(shop_sessions: sessionmaker[Session]) -> sessionmaker[Session]:
    """What sqla_outbox's ``outbox`` fixture reads and runs through."""
    return shop_sessions
