"""Shared fixtures: real PostgreSQL, real Valkey/Redis, a real moto SQS server.

* PostgreSQL: ``DATABASE_URL`` (default ``postgresql://postgres@127.0.0.1:5432/test``).
  A template database with the migrations applied (and a ``tenants`` table holding ids
  1..20) is built once per session; each test gets its own clone, because listeners need
  real COMMITs.
* Valkey/Redis: ``REDIS_URL`` (default ``redis://127.0.0.1:6379/0``). Each test uses its
  own wake key, so nothing needs flushing.
* SQS: a ``moto_server`` subprocess on a free loopback port, reset between tests.

When a service is unreachable and Docker is available, testcontainers starts one. With
neither, the session fails loudly: these tests never skip.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
import redis
import sqlalchemy as sa
from psycopg import sql

from sqla_outbox.catalog import Catalog
from sqla_outbox.config import OutboxSettings, sqlalchemy_url
from tests import support

DEFAULT_DATABASE_URL = "postgresql://postgres@127.0.0.1:5432/test"
DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"
ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(autouse=True)
def _scrub_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """No test sees the developer's SQLA_OUTBOX_* variables."""
    for name in list(os.environ):
        if name.startswith("SQLA_OUTBOX_"):
            monkeypatch.delenv(name)


def _docker_available() -> bool:
    if shutil.which("docker") is None:
        return False
    probe = subprocess.run(["docker", "info"], capture_output=True, timeout=20)
    return probe.returncode == 0


def _libpq_url(url: str) -> str:
    return url.replace("postgresql+psycopg://", "postgresql://")


@pytest.fixture(scope="session")
def pg_url() -> Iterator[str]:
    """URL of a reachable PostgreSQL server database (libpq form)."""
    url = os.environ.get("DATABASE_URL", DEFAULT_DATABASE_URL)
    try:
        psycopg.connect(_libpq_url(url), connect_timeout=5).close()
        yield _libpq_url(url)
        return
    except psycopg.OperationalError as exc:
        reason = str(exc).strip().splitlines()[0]
    if not _docker_available():
        pytest.fail(
            f"PostgreSQL is not reachable at {url} ({reason}) and Docker is not available "
            "for testcontainers. Start PostgreSQL or set DATABASE_URL.",
            pytrace=False,
        )
    from testcontainers.postgres import PostgresContainer

    with PostgresContainer("postgres:15", driver=None) as container:
        yield container.get_connection_url()


@pytest.fixture(scope="session")
def redis_url() -> Iterator[str]:
    """URL of a reachable Valkey/Redis server."""
    url = os.environ.get("REDIS_URL", DEFAULT_REDIS_URL)
    try:
        redis.Redis.from_url(url, socket_connect_timeout=3).ping()
        yield url
        return
    except redis.RedisError as exc:
        reason = str(exc)
    if not _docker_available():
        pytest.fail(
            f"Valkey/Redis is not reachable at {url} ({reason}) and Docker is not available "
            "for testcontainers. Start Redis/Valkey or set REDIS_URL.",
            pytrace=False,
        )
    from testcontainers.redis import RedisContainer

    with RedisContainer("valkey/valkey:8") as container:
        host = container.get_container_host_ip()
        yield f"redis://{host}:{container.get_exposed_port(6379)}/0"


@pytest.fixture(scope="session")
def template_db(pg_url: str) -> Iterator[str]:
    """Name of a template database with a tenants table and the migrations at head."""
    name = f"sqla_outbox_tpl_{os.getpid()}"
    support.create_database(pg_url, name)
    url = support.database_url(pg_url, name)
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("CREATE TABLE tenants (id bigint PRIMARY KEY, name text)")
        conn.execute("INSERT INTO tenants SELECT g, 'tenant ' || g FROM generate_series(1, 20) g")
        # what test handlers do through their session (counted to prove exactly-once)
        conn.execute(
            "CREATE TABLE effects (id bigserial PRIMARY KEY, run_id uuid NOT NULL, task text NOT NULL, "
            "attempt int, worker text, note text, at timestamptz DEFAULT clock_timestamp())"
        )
    from sqla_outbox import migrations

    migrations.upgrade(sqlalchemy_url(url))
    yield name
    support.drop_database(pg_url, name)


@pytest.fixture
def database_url(pg_url: str, template_db: str) -> Iterator[str]:
    """SQLAlchemy URL (psycopg 3) of a fresh clone of the template, for this test only."""
    name = f"t_{uuid.uuid4().hex[:16]}"
    with psycopg.connect(pg_url, autocommit=True) as conn:
        conn.execute(
            sql.SQL("CREATE DATABASE {} TEMPLATE {}").format(
                sql.Identifier(name), sql.Identifier(template_db)
            )
        )
    yield sqlalchemy_url(support.database_url(pg_url, name))
    support.drop_database(pg_url, name)


@pytest.fixture
def engine(database_url: str) -> Iterator[sa.Engine]:
    engine = sa.create_engine(database_url)
    yield engine
    engine.dispose()


@pytest.fixture
def catalog() -> Catalog:
    return Catalog.from_dict(support.CATALOG)


@pytest.fixture
def catalog_path(tmp_path: Path, catalog: Catalog) -> Path:
    path = tmp_path / "tasks.json"
    path.write_text(catalog.to_json())
    return path


@pytest.fixture
def settings(database_url: str, redis_url: str, catalog_path: Path) -> OutboxSettings:
    """Settings isolated to this test: its own database, wake key and queue prefix."""
    tag = uuid.uuid4().hex[:10]
    return OutboxSettings(
        database_url=database_url,
        valkey_url=redis_url,
        wake_key=f"test:{tag}:wake",
        queue_prefix=f"t{tag}-",
        catalog_path=str(catalog_path),
        relay_sweep_interval_seconds=1.0,
    )


@pytest.fixture
def valkey(redis_url: str) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(redis_url)
    yield client
    client.close()


@pytest.fixture(scope="session")
def moto_endpoint() -> Iterator[str]:
    """Endpoint URL of a moto server subprocess (SQS protocol) on a free loopback port."""
    server = support.MotoServer.start()
    yield server.endpoint
    server.stop()


@pytest.fixture
def sqs_endpoint(moto_endpoint: str, monkeypatch: pytest.MonkeyPatch) -> str:
    """The moto endpoint, reset for this test, with dummy AWS credentials in the env."""
    support.reset_moto(moto_endpoint)
    for key, value in support.AWS_ENV.items():
        monkeypatch.setenv(key, value)
    return moto_endpoint


@pytest.fixture
def python() -> str:
    return sys.executable


@pytest.fixture
def sqs(sqs_endpoint: str):
    """A boto3 SQS client on the test's moto server."""
    return support.sqs_client(sqs_endpoint)


@pytest.fixture
def queues(sqs, settings: OutboxSettings, sqs_endpoint: str) -> dict[str, str]:
    """Provision the test's queues; return logical name → URL (``<name>-dlq`` for DLQs)."""
    from sqla_outbox.sqs.provision import provision

    reports = provision(sqs, settings.replace(sqs_endpoint_url=sqs_endpoint))
    return {r.queue + ("-dlq" if r.dead_letter else ""): r.url for r in reports}


@pytest.fixture
def app(engine: sa.Engine, settings: OutboxSettings, catalog: Catalog):
    """An installed sessionmaker on the test database (the 'application')."""
    from sqlalchemy.orm import sessionmaker

    import sqla_outbox

    maker = sessionmaker(engine)
    sqla_outbox.install(maker, settings, catalog=catalog)
    yield maker
    sqla_outbox.uninstall(maker)
