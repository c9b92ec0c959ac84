"""What real relay, worker and CLI processes print: never a payload, never a password.

Issue 12 (2) and (5); ``docs/security.md`` ("Log readers") cites these tests.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.orm import Session, sessionmaker

from sqla_outbox import Dispatch
from sqla_outbox.config import OutboxSettings
from tests import support
from tests.e2e.test_ops_cli import cli
from tests.support import free_port, run_row, service_env, start_relay, start_worker, wait_for

pytestmark = pytest.mark.e2e

MARKER = "card-4111-1111-1111-1111-marker"
KEY = "leak-test-signing-key-0123456789"


def execute(engine: sa.Engine, statement: str, **params: Any) -> None:
    with engine.begin() as conn:
        conn.execute(sa.text(statement), params)


def test_no_payload_reaches_a_log_line_when_the_database_fails(
    app: sessionmaker[Session],
    engine: sa.Engine,
    settings: OutboxSettings,
    sqs_endpoint: str,
    queues: dict[str, str],
) -> None:
    """A database error in the worker's lease statement (whose parameters hold the
    envelope), in the relay's mark-sent statement (PostgreSQL quotes the failing row, the
    envelope included) and in the CLI's requeue (a trigger refuses the rebuilt row): every
    line the three processes print is searched for the payload's marker. Receipt handles
    appear only shortened (8 characters and the length)."""
    signed = {"SQLA_OUTBOX_SIGNING_KEYS": KEY}
    relay = start_relay(settings, sqs_endpoint, **signed)
    worker = start_worker(settings, sqs_endpoint, **signed)
    printed: list[str] = []
    try:
        relay.wait_for_action("relay.leader")
        worker.wait_for_action("worker.started")
        with app() as session, session.begin():
            charge = Dispatch("charge_card", {"mode": "keyerror", "card": MARKER}, tenant_id=3)
            session.add(charge)
        wait_for(lambda: run_row(engine, charge.run_id).dead_lettered_at is not None, timeout=30)

        # the worker: its lease statement fails (as in a failover); the envelope is a parameter
        execute(
            engine,
            "ALTER TABLE task_run_trail ADD CONSTRAINT leak_test CHECK (status <> 'running') NOT VALID",
        )
        with app() as session, session.begin():
            session.add(Dispatch("audit", {"mode": "ok", "card": MARKER}))
        worker.wait_for_action("worker.handle_error")

        # the relay: marking a row sent fails; PostgreSQL's DETAIL quotes the whole row
        execute(
            engine, "ALTER TABLE outbox_messages ADD CONSTRAINT leak_test CHECK (sent_at IS NULL) NOT VALID"
        )
        with app() as session, session.begin():
            session.add(Dispatch("audit", {"mode": "ok", "card": MARKER}, tenant_id=4))
        relay.wait_for_action("relay.db_error")

        # the CLI: the charge run's row is purged and rebuilt from its signed DLQ body; a
        # trigger refuses the INSERT (not a constraint: the error is not one requeue expects)
        execute(engine, "DELETE FROM outbox_messages WHERE run_id = :r", r=charge.run_id)
        execute(engine, "ALTER TABLE outbox_messages DROP CONSTRAINT leak_test")
        execute(
            engine,
            "CREATE FUNCTION leak_test() RETURNS trigger LANGUAGE plpgsql AS "
            "$$ BEGIN RAISE EXCEPTION 'refused by policy'; END $$",
        )
        execute(
            engine,
            "CREATE TRIGGER leak_test BEFORE INSERT ON outbox_messages "
            "FOR EACH ROW EXECUTE FUNCTION leak_test()",
        )
        env = service_env(settings, sqs_endpoint, **signed)
        for args in (
            ("dlq", "requeue", "--task", "charge_card"),
            ("dlq", "requeue", "--task", "charge_card", "--json"),
            ("-v", "dlq", "requeue", "--task", "charge_card", "--log-format", "text"),
            ("runs", "show", str(charge.run_id), "--with-tracebacks"),
        ):
            result = cli(env, *args)
            printed += [result.stdout, result.stderr]
        requeue = cli(env, "dlq", "requeue", "--task", "charge_card")
        assert requeue.returncode == 1
        assert requeue.stderr.startswith(
            "error: the database refused the operation: psycopg.errors.RaiseException (SQLSTATE P0001"
        ), requeue.stderr
    finally:
        relay.kill()
        worker.kill()
    lines = relay.raw + worker.raw + "".join(printed).splitlines()
    assert relay.actions("relay.db_error") and worker.actions("worker.handle_error")
    assert [line for line in lines if MARKER in line] == []
    receipts = [entry["receipt"] for entry in worker.logs if "receipt" in entry]
    assert receipts and all(re.fullmatch(r".{8}…\(\d+\)", receipt) for receipt in receipts)


def test_query_passwords_and_at_signs_are_masked_in_config_migrate_and_check(pg_url: str) -> None:
    """Issue 12 (5): a password given as ``?password=`` was printed by ``config``,
    ``migrate`` and ``relay --check``; an unescaped ``@`` in a password printed its tail."""
    name = f"masked_{uuid.uuid4().hex[:10]}"
    support.create_database(pg_url, name)
    try:
        reachable = support.database_url(pg_url, name) + "?password=s3cret-query"  # trust auth ignores it
        env = {k: v for k, v in os.environ.items() if not k.startswith("SQLA_OUTBOX_")}
        env.update(
            {
                "SQLA_OUTBOX_DATABASE_URL": reachable,
                "SQLA_OUTBOX_VALKEY_URL": f"redis://:s3cret-valkey@127.0.0.1:{free_port()}/0?password=s3cret-q2",
                "SQLA_OUTBOX_SQS_ENDPOINT_URL": f"http://key:s3cret-sqs@127.0.0.1:{free_port()}",
                "SQLA_OUTBOX_TENANT_FOREIGN_KEY": "none",
                **support.AWS_ENV,
            }
        )
        outputs = [cli(env, "config"), cli(env, "config", "--json"), cli(env, "migrate")]
        assert outputs[-1].returncode == 0, outputs[-1].stderr
        assert "password=***" in outputs[-1].stdout
        relay_check = [sys.executable, "-m", "sqla_outbox.relay", "--check"]
        outputs.append(subprocess.run(relay_check, capture_output=True, text=True, env=env, timeout=120))
        at_sign = dict(
            env, SQLA_OUTBOX_DATABASE_URL=f"postgresql://app:s3cret@tail@127.0.0.1:{free_port()}/app"
        )
        outputs += [cli(at_sign, "config"), cli(at_sign, "status")]
        outputs.append(subprocess.run(relay_check, capture_output=True, text=True, env=at_sign, timeout=120))
    finally:
        support.drop_database(pg_url, name)
    for result in outputs:
        shown = result.stdout + result.stderr
        assert "s3cret" not in shown and "tail@" not in shown, shown


def _listening_address(port: int) -> str:
    """The local address a TCP socket on ``port`` listens on (from /proc/net/tcp)."""
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        address, hex_port = fields[1].split(":")
        if int(hex_port, 16) == port and fields[3] == "0A":  # LISTEN
            return socket.inet_ntoa(bytes.fromhex(address)[::-1])
    raise AssertionError(f"nothing listens on {port}")


def test_the_probe_binds_the_configured_address(settings: OutboxSettings, sqs_endpoint: str) -> None:
    """Issue 12 (5): the probe server bound every interface with no setting to change it."""
    port = free_port()
    relay = start_relay(
        settings, sqs_endpoint, SQLA_OUTBOX_HEALTH_PORT=str(port), SQLA_OUTBOX_HEALTH_HOST="127.0.0.1"
    )
    try:
        relay.wait_for_action("relay.leader")
        wait_for(lambda: _probe_up(port), timeout=10)
        assert _listening_address(port) == "127.0.0.1"
    finally:
        relay.terminate()
    env = service_env(settings, sqs_endpoint, SQLA_OUTBOX_HEALTH_PORT=str(free_port()))
    env["SQLA_OUTBOX_HEALTH_HOST"] = "192.0.2.1"  # TEST-NET-1: an address this host does not have
    refused = subprocess.run(
        [sys.executable, "-m", "sqla_outbox.relay"], capture_output=True, text=True, env=env, timeout=60
    )
    assert refused.returncode == 2
    assert "SQLA_OUTBOX_HEALTH_HOST: cannot serve probes on 192.0.2.1" in refused.stderr


def _probe_up(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1):
            return True
    except OSError:
        return False
