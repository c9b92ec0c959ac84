"""The command line as users run it: catalog, provisioning, --check, the HTTP probe."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
import sqlalchemy as sa
from sqlalchemy.orm import Session, sessionmaker

from sqla_outbox import Dispatch, migrations
from sqla_outbox.config import OutboxSettings, redact_url, sqlalchemy_url
from tests import support
from tests.support import free_port, service_env, start_relay, start_worker, status_of, wait_for

pytestmark = pytest.mark.e2e


def cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return support.run_cli(env if env is not None else dict(os.environ), *args)


def test_catalog_write_and_check(tmp_path: Path) -> None:
    path = tmp_path / "tasks.json"
    written = cli("catalog", "write", "--imports", "tests.e2e.worker_tasks", "--output", str(path))
    assert written.returncode == 0, written.stderr
    document = json.loads(path.read_text())
    own = len([t for t in document["tasks"] if not t.startswith("maintenance.")])
    assert f"({own} tasks, and 1 built in)" in written.stdout  # the built-in purge counted apart
    assert document["tasks"]["charge_card"] == {
        "queue": "critical",
        "scope": "tenant",
        "timeout_seconds": 1.5,
    }
    assert document["events"] == {"user.created": {"subscribers": ["index_user"]}}
    fresh = cli("catalog", "write", "--check", "--imports", "tests.e2e.worker_tasks", "--output", str(path))
    assert fresh.returncode == 0 and "up to date" in fresh.stdout
    document["tasks"]["audit"]["queue"] = "bulk"
    path.write_text(json.dumps(document, indent=2) + "\n")
    stale = cli("catalog", "write", "--check", "--imports", "tests.e2e.worker_tasks", "--output", str(path))
    assert stale.returncode == 1
    assert "is stale" in stale.stderr
    assert "run `python -m sqla_outbox catalog write --imports tests.e2e.worker_tasks`" in stale.stderr
    assert '-      "queue": "bulk"' in stale.stdout


def test_catalog_write_without_tasks_is_a_configuration_error(tmp_path: Path) -> None:
    result = cli("catalog", "write", "--imports", "json", "--output", str(tmp_path / "t.json"))
    assert result.returncode == 2
    assert "no tasks registered" in result.stderr


def test_unknown_import_is_reported_with_exit_code_2(settings: OutboxSettings, sqs_endpoint: str) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "sqla_outbox.worker", "--imports", "no.such.module"],
        capture_output=True,
        text=True,
        env=service_env(settings, sqs_endpoint),
        timeout=60,
    )
    assert result.returncode == 2
    assert "cannot import task module 'no.such.module'" in result.stderr


def test_provision_refuses_a_visibility_setting_for_a_queue_that_does_not_exist(
    settings: OutboxSettings, sqs_endpoint: str
) -> None:
    """Trial finding: ``nosuch=60`` was ignored and every queue reported unchanged."""
    env = {**service_env(settings, sqs_endpoint), "SQLA_OUTBOX_QUEUE_VISIBILITY_TIMEOUTS": "nosuch=60"}
    result = cli("provision", env=env)
    assert_one_line_error(result, 2, "SQLA_OUTBOX_QUEUE_VISIBILITY_TIMEOUTS", "no queue 'nosuch'")


def test_provision_is_idempotent_and_reports_drift(settings: OutboxSettings, sqs_endpoint: str) -> None:
    env = service_env(settings, sqs_endpoint)
    first = cli("provision", "--json", env=env)
    assert first.returncode == 0, first.stderr
    assert {r["action"] for r in json.loads(first.stdout)} == {"created"}
    again = cli("provision", "--json", env=env)
    assert {r["action"] for r in json.loads(again.stdout)} == {"unchanged"}
    drift = cli("provision", "--json", "--max-receive-count", "4", env=env)
    assert drift.returncode == 1
    drifted = [r for r in json.loads(drift.stdout) if r["action"] == "drift"]
    assert len(drifted) == 4 and all("RedrivePolicy" in r["differences"] for r in drifted)
    fixed = cli("provision", "--json", "--max-receive-count", "4", "--fix", env=env)
    assert fixed.returncode == 0
    assert {r["action"] for r in json.loads(fixed.stdout)} == {"unchanged", "updated"}
    human = cli("provision", "--max-receive-count", "4", env=env)
    assert "unchanged" in human.stdout and "SQS queues" in human.stdout
    # visibility timeouts and retention are settings that provision applies (issue 11, item 10)
    sqs = support.sqs_client(sqs_endpoint)
    bulk = sqs.get_queue_url(QueueName=f"{settings.queue_prefix}bulk")["QueueUrl"]
    attributes = sqs.get_queue_attributes(QueueUrl=bulk, AttributeNames=["All"])["Attributes"]
    assert (attributes["VisibilityTimeout"], attributes["MessageRetentionPeriod"]) == ("900", "1209600")
    longer = {
        **env,
        "SQLA_OUTBOX_MAX_RECEIVE_COUNT": "4",
        "SQLA_OUTBOX_VISIBILITY_TIMEOUT_BULK_SECONDS": "1800",
    }
    drift = cli("provision", "--json", env=longer)
    assert drift.returncode == 1
    assert {r["name"] for r in json.loads(drift.stdout) if r["action"] == "drift"} == {
        f"{settings.queue_prefix}bulk",
        f"{settings.queue_prefix}bulk-dlq",
    }
    assert cli("provision", "--fix", env=longer).returncode == 0
    assert sqs.get_queue_attributes(QueueUrl=bulk, AttributeNames=["VisibilityTimeout"])["Attributes"] == {
        "VisibilityTimeout": "1800"
    }
    assert cli("provision", "--json", env=longer).returncode == 0  # the setting is what --fix keeps


def test_check_reports_each_service(
    settings: OutboxSettings, sqs_endpoint: str, queues: dict[str, str]
) -> None:
    ok = cli("relay", "--check", "--json", env=service_env(settings, sqs_endpoint))
    assert ok.returncode == 0, ok.stdout + ok.stderr
    checks = json.loads(ok.stdout)["checks"]
    listen = ["listen"] if settings.wake_notify else []  # the PostgreSQL wake (no Valkey here)
    services = ["postgresql", "valkey", *listen, "sqs", "schedules", "relay_partitions"]
    assert [c["service"] for c in checks] == services
    assert checks[-2]["detail"].startswith(settings.catalog_path)
    broken = service_env(settings, sqs_endpoint, SQLA_OUTBOX_QUEUE_PREFIX="nothing-here-")
    bad = cli("relay", "--check", "--json", env=broken)
    assert bad.returncode == 3
    assert not json.loads(bad.stdout)["ok"]


def test_check_refuses_a_relay_partitions_the_running_relays_do_not_use(
    settings: OutboxSettings, sqs_endpoint: str, queues: dict[str, str]
) -> None:
    running = start_relay(settings, sqs_endpoint, name="running", SQLA_OUTBOX_RELAY_PARTITIONS="6")
    try:
        running.wait_for_action("relay.leader")
        same = cli(
            "relay",
            "--check",
            "--json",
            env=service_env(settings, sqs_endpoint, SQLA_OUTBOX_RELAY_PARTITIONS="6"),
        )
        assert same.returncode == 0, same.stdout
        odd = cli("relay", "--check", "--json", env=service_env(settings, sqs_endpoint))  # the default 1
        assert odd.returncode == 2, odd.stdout
        (check,) = [c for c in json.loads(odd.stdout)["checks"] if c["service"] == "relay_partitions"]
        assert not check["ok"] and "use 6" in check["detail"]
    finally:
        assert running.terminate() == 0


def get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def test_probe_liveness_readiness_and_metrics(
    app: sessionmaker[Session], engine: sa.Engine, settings: OutboxSettings, sqs_endpoint: str, queues: Any
) -> None:
    port = free_port()
    worker = start_worker(
        settings,
        sqs_endpoint,
        SQLA_OUTBOX_HEALTH_PORT=str(port),
        SQLA_OUTBOX_WORKER_RUN_RELAY="true",
        SQLA_OUTBOX_WORKER_STOP_BUDGET_SECONDS="3",
    )
    try:
        worker.wait_for_action("worker.started")
        base = f"http://127.0.0.1:{port}"
        assert get(base + "/livez")[0] == 200
        assert get(base + "/readyz")[0] == 200
        with app() as session, session.begin():
            item = Dispatch("audit", {"mode": "sleep", "seconds": 20})
            session.add(item)
        wait_for(lambda: status_of(engine, item.run_id) == "running", timeout=20)
        status, text = get(base + "/metrics")
        assert status == 200
        assert "sqla_outbox_worker_in_flight" in text and "sqla_outbox_relay_leader 1.0" in text
        worker.process.send_signal(__import__("signal").SIGTERM)
        wait_for(lambda: get(base + "/readyz")[0] == 503, timeout=5)  # not ready while draining
        assert worker.process.wait(30) == 0
    finally:
        worker.kill()


def test_config_shows_settings_with_secrets_masked() -> None:
    import os

    env = {k: v for k, v in os.environ.items() if not k.startswith("SQLA_OUTBOX_")}
    env.update({"DATABASE_URL": "postgresql://app:s3cret@db/app", "SQLA_OUTBOX_SIGNING_KEYS": "k" * 20})
    shown = cli("config", "--json", env=env)
    assert shown.returncode == 0
    values = json.loads(shown.stdout)
    assert values["database_url"] == "postgresql://app:***@db/app"
    assert values["signing_keys"] == ["***"]
    assert "s3cret" not in shown.stdout and "k" * 20 not in shown.stdout
    table = cli("config", env=env)
    assert "SQLA_OUTBOX_WORKER_CONCURRENCY" in table.stdout
    reference = cli("config", "--reference")
    assert reference.stdout == (Path(__file__).resolve().parents[2] / "docs" / "configuration.md").read_text()


# --- expected errors: one line, the documented exit code, never a traceback ----------------


def bare_env(**variables: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SQLA_OUTBOX_")}
    env.pop("DATABASE_URL", None)
    env.update(variables)
    return env


def assert_one_line_error(result: subprocess.CompletedProcess[str], code: int, *texts: str) -> None:
    assert result.returncode == code, result.stdout + result.stderr
    assert result.stderr.startswith("error: "), result.stderr
    assert "Traceback" not in result.stderr and len(result.stderr.strip().splitlines()) == 1
    for text in texts:
        assert text in result.stderr, result.stderr


@pytest.mark.parametrize(
    ("variables", "texts"),
    [
        (
            {"SQLA_OUTBOX_DATABASE_URL": "notaurl"},
            ("error: SQLA_OUTBOX_DATABASE_URL: 'notaurl' is not a database URL",),
        ),
        (
            {"DATABASE_URL": "mysql://app:s3cret@db/app"},
            ("error: SQLA_OUTBOX_DATABASE_URL: ", "supports only PostgreSQL", "app:***@db"),
        ),
        (
            {"SQLA_OUTBOX_SQS_ENDPOINT_URL": "notaurl"},
            ("error: SQLA_OUTBOX_SQS_ENDPOINT_URL: 'notaurl' is not an http:// or https:// URL",),
        ),
        (
            {"SQLA_OUTBOX_WORKER_CONCURRENCY": "0x10"},
            ("error: SQLA_OUTBOX_WORKER_CONCURRENCY: expected a whole number in base 10",),
        ),
    ],
)
def test_bad_settings_are_configuration_errors(variables: dict[str, str], texts: tuple[str, ...]) -> None:
    for command in (("status",), ("runs", "list"), ("relay", "--once")):
        result = cli(*command, env=bare_env(**variables))
        assert_one_line_error(result, 2, *texts)
        assert "s3cret" not in result.stderr


@pytest.fixture
def empty_database(pg_url: str) -> Iterator[str]:
    """SQLAlchemy URL of a new database without any table."""
    name = f"empty_{uuid.uuid4().hex[:12]}"
    support.create_database(pg_url, name)
    yield sqlalchemy_url(support.database_url(pg_url, name))
    support.drop_database(pg_url, name)


def tables(url: str) -> set[str]:
    with psycopg.connect(url.replace("postgresql+psycopg://", "postgresql://")) as conn:
        rows = conn.execute("SELECT tablename FROM pg_tables WHERE schemaname = 'public'").fetchall()
    return {row[0] for row in rows}


def test_commands_on_an_unmigrated_database_say_to_migrate(
    empty_database: str, settings: OutboxSettings, sqs_endpoint: str, queues: dict[str, str]
) -> None:
    env = service_env(settings.replace(database_url=empty_database), sqs_endpoint)
    expected = (
        f"error: the outbox tables are missing in {redact_url(empty_database)}: run `python -m sqla_outbox "
        "migrate`, or `alembic upgrade heads` if your application's Alembic environment holds sqla_outbox's "
        "migrations (docs/alembic.md)"
    )
    for command in (
        ("status",),
        ("status", "--no-sqs", "--json"),
        ("runs", "list"),
        ("runs", "show", str(uuid.uuid4())),
        ("dlq", "list"),
        ("dlq", "requeue", "--all"),
        ("purge", "--dry-run"),
        ("relay", "--once", "--json"),
    ):
        result = cli(*command, env=env)
        assert_one_line_error(result, 2, expected)
        assert result.stdout == ""
    assert tables(empty_database) == set()
    # a database the application's Alembic manages: `migrate` would be the wrong advice
    with psycopg.connect(
        empty_database.replace("postgresql+psycopg://", "postgresql://"), autocommit=True
    ) as conn:
        conn.execute("CREATE TABLE alembic_version (version_num varchar(32) PRIMARY KEY)")
    assert_one_line_error(
        cli("status", "--no-sqs", env=env),
        2,
        f"error: the outbox tables are missing in {redact_url(empty_database)}: your application's Alembic "
        "environment manages this database: add sqla_outbox's migrations to it and run "
        "`alembic upgrade heads` "
        "there (docs/alembic.md)",
    )


def test_migrate_explains_a_missing_tenant_table_then_reports_what_it_did(empty_database: str) -> None:
    env = bare_env(SQLA_OUTBOX_DATABASE_URL=empty_database)
    shown = redact_url(empty_database)

    refused = cli("migrate", env=env)
    assert_one_line_error(
        refused,
        2,
        "error: SQLA_OUTBOX_TENANT_FOREIGN_KEY: outbox_messages.tenant_id references tenants.id",
        f"but {shown.replace('postgresql+psycopg://', 'postgresql://')} has no table 'tenants'",
        "create that table first",
        "SQLA_OUTBOX_TENANT_FOREIGN_KEY=none",
    )
    assert tables(empty_database) == set()  # the whole upgrade rolled back
    with_stack = cli("migrate", "--traceback", env=env)
    assert with_stack.returncode == 1 and "Traceback (most recent call last)" in with_stack.stderr

    with psycopg.connect(empty_database.replace("postgresql+psycopg://", "postgresql://")) as conn:
        conn.execute("CREATE TABLE tenants (id bigint PRIMARY KEY, name text)")
    wrong_column = cli("migrate", env={**env, "SQLA_OUTBOX_TENANT_FOREIGN_KEY": "tenants.uuid"})
    assert_one_line_error(wrong_column, 2, "table 'tenants'", "has no column 'uuid'")

    migrated = cli("migrate", env=env)
    assert migrated.returncode == 0, migrated.stderr
    [head] = migrations.head_revisions()
    assert migrated.stdout == f"migrated {shown} from base to {head} (head)\n"
    assert {"outbox_messages", "task_runs", "sqla_outbox_alembic_version"} <= tables(empty_database)
    again = cli("migrate", env=env)
    assert again.stdout == f"{shown} is already at {head} (head); nothing to do\n"
    with psycopg.connect(empty_database.replace("postgresql+psycopg://", "postgresql://")) as conn:
        conn.execute(
            "INSERT INTO platform_outbox_messages (run_id, queue, envelope, available_at) "
            "SELECT gen_random_uuid(), 'default', '{}'::jsonb, now()"
        )
    refused_down = cli("migrate", "--downgrade", "--revision", "base", env=env)  # no terminal, no --yes
    assert_one_line_error(
        refused_down, 2, "hold rows (platform_outbox_messages 1", "1 outbox rows not yet sent", "--yes"
    )
    assert "platform_outbox_messages" in tables(empty_database)  # nothing dropped
    down = cli("migrate", "--downgrade", "--revision", "base", "--yes", env=env)
    assert down.stdout == f"downgraded {shown} from {head} (head) to base\n"
    assert tables(empty_database) == {"tenants", "sqla_outbox_alembic_version"}


def test_migrate_without_a_tenant_foreign_key_needs_no_tenants_table(empty_database: str) -> None:
    env = bare_env(SQLA_OUTBOX_DATABASE_URL=empty_database, SQLA_OUTBOX_TENANT_FOREIGN_KEY="none")
    migrated = cli("migrate", env=env)
    assert migrated.returncode == 0, migrated.stderr
    [head] = migrations.head_revisions()
    assert migrated.stdout.startswith("migrated ") and f"to {head} (head)" in migrated.stdout


def test_relay_once_reports_that_another_relay_is_active(
    app: sessionmaker[Session],
    engine: sa.Engine,
    settings: OutboxSettings,
    sqs_endpoint: str,
    queues: dict[str, str],
) -> None:
    env = service_env(settings, sqs_endpoint)
    with app() as session, session.begin():
        item = Dispatch("audit", {})
        session.add(item)
    with engine.connect() as leader:  # holds the lock the way an active relay does
        assert leader.execute(
            sa.text("SELECT pg_try_advisory_lock(:k)"), {"k": settings.relay_lock_id}
        ).scalar()
        leader.commit()
        skipped = cli("relay", "--once", "--json", env=env)
        assert skipped.returncode == 0, skipped.stderr
        assert json.loads(skipped.stdout) == {
            "claimed": 0,
            "sent": 0,
            "failed": 0,
            "held": 0,
            "parked": 0,
            "full": False,
            "leader": False,
            "stalled": False,
            "throttled": [],
            "depth_bound": [],
        }
        human = cli("relay", "--once", env=env)
        assert (human.returncode, human.stdout) == (
            0,
            "another relay is active; nothing done (it sends the pending rows)\n",
        )
        assert status_of(engine, item.run_id) == "queued"
        with engine.connect() as conn:
            assert conn.execute(sa.text("SELECT sent_at FROM platform_outbox_messages")).scalar() is None
        leader.execute(sa.text("SELECT pg_advisory_unlock(:k)"), {"k": settings.relay_lock_id})
        leader.commit()
    done = cli("relay", "--once", "--json", env=env)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == {
        "claimed": 1,
        "sent": 1,
        "failed": 0,
        "held": 0,
        "parked": 0,
        "full": False,
        "leader": True,
        "stalled": False,
        "throttled": [],
        "depth_bound": [],
    }


def test_a_worker_refuses_to_start_on_a_database_without_the_outbox_tables(empty_database: str) -> None:
    """Trial finding: it used to start, receive messages it could not record and spend their
    receive budget; now it stops before receiving anything, naming the cause."""
    env = bare_env(
        SQLA_OUTBOX_DATABASE_URL=empty_database,
        SQLA_OUTBOX_SQS_ENDPOINT_URL="http://127.0.0.1:9",  # never reached
        SQLA_OUTBOX_WORKER_IMPORTS="tests.e2e.worker_tasks",
    )
    result = subprocess.run(
        [sys.executable, "-m", "sqla_outbox.worker"], capture_output=True, text=True, env=env, timeout=60
    )
    assert result.returncode == 2, result.stdout + result.stderr
    assert "outbox tables" in result.stderr and "migrate" in result.stderr, result.stderr
    assert "worker started" not in result.stderr


def test_bad_input_is_a_usage_or_configuration_error_not_an_outage(pg_url: str, empty_database: str) -> None:
    """Trial findings: these were reported as a refused operation, a service that cannot be
    reached, or a BrokenPipeError."""
    absent = support.database_url(pg_url, f"absent_{uuid.uuid4().hex[:12]}")
    missing = cli("status", env=bare_env(SQLA_OUTBOX_DATABASE_URL=absent, SQLA_OUTBOX_VALKEY_URL="none"))
    assert_one_line_error(missing, 2, "error: database 'absent_", "does not exist on the server of")

    env = bare_env(SQLA_OUTBOX_DATABASE_URL=empty_database, SQLA_OUTBOX_TENANT_FOREIGN_KEY="none")
    huge = cli("runs", "list", "--tenant", "99999999999999999999", env=env)
    assert huge.returncode == 2 and "outside the range of a tenant id" in huge.stderr, huge.stderr

    piped = subprocess.run(  # the reader stops after one line
        f"{sys.executable} -m sqla_outbox migrate --sql | head -1",
        shell=True,
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert piped.stdout.strip() and piped.stderr == "", piped.stderr
