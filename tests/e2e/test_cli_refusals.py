"""What the command line refuses at start, and how it says so: one line, the documented exit code."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import psycopg
import pytest

from sqla_outbox.config import OutboxSettings
from tests import support
from tests.support import free_port, service_env, start_relay

pytestmark = pytest.mark.e2e

SCRIPT = Path(sys.executable).with_name("sqla-outbox")


def worker(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "sqla_outbox.worker", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )


def test_worker_without_task_modules_refuses_to_start(settings: OutboxSettings, sqs_endpoint: str) -> None:
    result = worker("--wait-seconds", "1", env=service_env(settings, sqs_endpoint))
    assert result.returncode == 2
    assert "no task handlers are registered" in result.stderr
    assert "Traceback" not in result.stderr


def test_check_reports_the_handlers(
    settings: OutboxSettings, sqs_endpoint: str, queues: dict[str, str]
) -> None:
    env = service_env(settings, sqs_endpoint)
    ok = worker("--check", "--json", "--imports", "tests.e2e.worker_tasks", env=env)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    checks = {c["service"]: c for c in json.loads(ok.stdout)["checks"]}
    listen = ["listen"] if settings.wake_notify else []  # the PostgreSQL wake (no Valkey here)
    assert list(checks) == ["postgresql", "valkey", *listen, "sqs", "handlers"]
    assert checks["handlers"]["ok"] and "tasks" in checks["handlers"]["detail"]

    bare = worker("--check", "--json", env=env)
    assert bare.returncode == 2  # only the configuration is wrong: the services answered
    handlers = json.loads(bare.stdout)["checks"][-1]
    assert handlers["service"] == "handlers" and not handlers["ok"]
    assert "no task handlers are registered" in handlers["detail"]


def test_retry_limit_at_or_above_the_redrive_limit_is_refused(
    settings: OutboxSettings, sqs_endpoint: str, queues: dict[str, str]
) -> None:
    env = service_env(settings, sqs_endpoint, SQLA_OUTBOX_WORKER_MAX_RECEIVES="7")
    result = worker("--imports", "tests.e2e.worker_tasks", env=env)
    assert result.returncode == 2
    assert "has redrive maxReceiveCount 7" in result.stderr  # the queue's own policy


def test_console_script_imports_task_modules_from_the_current_directory(tmp_path: Path) -> None:
    (tmp_path / "shoptasks.py").write_text(
        "from sqla_outbox.worker import task\n\n"
        "@task('ship_order', queue='critical')\n"
        "def ship_order(payload):\n"
        "    pass\n"
    )
    result = subprocess.run(
        [str(SCRIPT), "catalog", "write", "--imports", "shoptasks", "--output", "tasks.json"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    assert "ship_order" in json.loads((tmp_path / "tasks.json").read_text())["tasks"]


def test_a_queue_whose_redrive_acts_before_the_worker_is_refused(
    settings: OutboxSettings, sqs_endpoint: str, sqs: Any, queues: dict[str, str]
) -> None:
    """The settings say 7, but the queue was provisioned (or edited) with 4: the worker
    reads the queue's own RedrivePolicy and refuses, since tasks decide on receive 5."""
    url = queues["default"]
    policy = json.loads(
        sqs.get_queue_attributes(QueueUrl=url, AttributeNames=["RedrivePolicy"])["Attributes"][
            "RedrivePolicy"
        ]
    )
    policy["maxReceiveCount"] = 4
    sqs.set_queue_attributes(QueueUrl=url, Attributes={"RedrivePolicy": json.dumps(policy)})
    result = worker("--imports", "tests.e2e.worker_tasks", env=service_env(settings, sqs_endpoint))
    assert result.returncode == 2, result.stderr
    assert "has redrive maxReceiveCount 4" in result.stderr
    assert "Traceback" not in result.stderr


def test_a_queue_that_accepts_larger_messages_than_the_worker_reads_is_refused(
    settings: OutboxSettings, sqs_endpoint: str, sqs: Any, queues: dict[str, str]
) -> None:
    """Trial finding: queues provisioned for 1 MiB by a process with a larger
    max_message_bytes; a worker with the default refused the runs' messages unexecuted and
    the runs stayed queued. The worker now refuses to start, naming both sizes."""
    sqs.set_queue_attributes(QueueUrl=queues["default"], Attributes={"MaximumMessageSize": "1048576"})
    result = worker("--imports", "tests.e2e.worker_tasks", env=service_env(settings, sqs_endpoint))
    assert result.returncode == 2, result.stderr
    assert "accepts messages up to 1048576 bytes (MaximumMessageSize)" in result.stderr
    assert "refuses messages above 262144" in result.stderr and "Traceback" not in result.stderr


def test_an_unreachable_database_is_one_line_with_exit_code_3(tmp_path: Path) -> None:
    env = {
        **os.environ,
        "SQLA_OUTBOX_DATABASE_URL": f"postgresql://app:s3cret@127.0.0.1:{free_port()}/app",
        "SQLA_OUTBOX_VALKEY_URL": "none",
    }
    result = subprocess.run(
        [str(SCRIPT), "status"], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=60
    )
    assert result.returncode == 3, result.stderr
    assert result.stderr.startswith("error: cannot reach a service: OperationalError: ")
    assert result.stderr.count("\n") == 1 and "s3cret" not in result.stderr


def test_a_relay_on_an_unmigrated_database_says_to_migrate_and_keeps_trying(
    pg_url: str, settings: OutboxSettings, sqs_endpoint: str
) -> None:
    """Unlike the one-shot commands, a relay started before the migrations waits for them."""
    name = f"empty_{uuid.uuid4().hex[:12]}"
    support.create_database(pg_url, name)
    relay = start_relay(settings.replace(database_url=support.database_url(pg_url, name)), sqs_endpoint)
    try:
        entry = relay.wait_for_action("relay.db_error")
        assert entry["message"] == (
            "the outbox tables are missing (run `python -m sqla_outbox migrate`, or `alembic upgrade heads` "
            "if your application's Alembic environment holds sqla_outbox's migrations (docs/alembic.md)); "
            "retrying"
        )
        assert relay.process.poll() is None
    finally:
        relay.terminate()
        support.drop_database(pg_url, name)


def test_migrate_leaves_tables_that_an_application_alembic_manages(pg_url: str) -> None:
    """The tables exist, but their version is in the application's own ``alembic_version``
    (as after the documented recipe): ``migrate`` says so instead of failing to create them."""
    name = f"appmanaged_{uuid.uuid4().hex[:12]}"
    support.create_database(pg_url, name)
    url = support.database_url(pg_url, name)
    env = {**os.environ, "SQLA_OUTBOX_DATABASE_URL": url, "SQLA_OUTBOX_TENANT_FOREIGN_KEY": "none"}
    try:
        first = subprocess.run([str(SCRIPT), "migrate"], capture_output=True, text=True, env=env, timeout=120)
        assert first.returncode == 0, first.stderr
        with psycopg.connect(url) as conn:  # what an application's environment looks like
            conn.execute("ALTER TABLE sqla_outbox_alembic_version RENAME TO alembic_version")
        again = subprocess.run([str(SCRIPT), "migrate"], capture_output=True, text=True, env=env, timeout=120)
        assert again.returncode == 2, again.stderr
        assert "already exist" in again.stderr and "alembic upgrade heads" in again.stderr
        assert again.stderr.count("\n") == 1
    finally:
        support.drop_database(pg_url, name)


def test_a_health_port_in_use_is_a_configuration_error(settings: OutboxSettings, sqs_endpoint: str) -> None:
    with socket.socket() as taken:
        taken.bind(("0.0.0.0", 0))
        taken.listen()
        port = taken.getsockname()[1]
        env = service_env(settings, sqs_endpoint, SQLA_OUTBOX_HEALTH_PORT=str(port))
        for command in (
            ["-m", "sqla_outbox.relay"],
            ["-m", "sqla_outbox.worker", "--imports", "tests.e2e.worker_tasks"],
        ):
            result = subprocess.run(
                [sys.executable, *command], capture_output=True, text=True, env=env, timeout=60
            )
            assert result.returncode == 2, result.stderr
            assert f"SQLA_OUTBOX_HEALTH_PORT: cannot serve probes on 0.0.0.0:{port}" in result.stderr
            assert "Traceback" not in result.stderr


def test_a_bad_flag_value_is_named_by_the_flag_and_an_env_value_by_the_variable(tmp_path: Path) -> None:
    flag = subprocess.run(
        [str(SCRIPT), "purge", "--dry-run", "--succeeded-after-days", "-1"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=60,
    )
    assert (flag.returncode, flag.stderr) == (2, "error: --succeeded-after-days: must be >= 0, got -1\n")
    env = {**os.environ, "SQLA_OUTBOX_PURGE_SUCCEEDED_AFTER_DAYS": "-1"}
    variable = subprocess.run(
        [str(SCRIPT), "purge", "--dry-run"], capture_output=True, text=True, cwd=tmp_path, env=env, timeout=60
    )
    assert (variable.returncode, variable.stderr) == (
        2,
        "error: SQLA_OUTBOX_PURGE_SUCCEEDED_AFTER_DAYS: must be >= 0, got -1\n",
    )


def test_provision_without_aws_credentials_says_so_as_a_configuration_error(
    settings: OutboxSettings, tmp_path: Path
) -> None:
    """Pasted before the moto step, ``provision`` said "cannot reach a service:
    NoCredentialsError" and exited 3 (a service down): it is the configuration (exit 2)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "SQLA_OUTBOX_"))}
    env.update(
        SQLA_OUTBOX_DATABASE_URL=settings.database_url,
        SQLA_OUTBOX_CATALOG_PATH=str(settings.catalog_path),
        AWS_REGION="eu-west-1",
        AWS_CONFIG_FILE=str(tmp_path / "none"),
        AWS_SHARED_CREDENTIALS_FILE=str(tmp_path / "none"),
        AWS_EC2_METADATA_DISABLED="true",
    )
    result = subprocess.run(
        [sys.executable, "-m", "sqla_outbox", "provision"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert result.returncode == 2, result.stderr
    assert "no AWS credentials found" in result.stderr and "Traceback" not in result.stderr
