"""The README's first command: the demo runs end to end and every committed run ends as expected."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import uuid
from pathlib import Path
from urllib.parse import urlsplit

import psycopg
import pytest

pytestmark = pytest.mark.e2e


def test_demo_runs_the_shop_end_to_end(pg_url: str, redis_url: str) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SQLA_OUTBOX_", "AWS_"))}
    env.update({"DATABASE_URL": pg_url, "REDIS_URL": redis_url})
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "sqla_outbox",
            "demo",
            "--orders",
            "14",
            "--json",
            "--database-name",
            f"demo_{uuid.uuid4().hex[:10]}",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    summary = json.loads(result.stdout)
    assert summary["ok"] is True
    # 14 orders x 4 runs, plus 3 welcome runs from the shop's data migration
    assert summary["runs_found"] == summary["runs_expected"] == 14 * 4 + 3
    # orders 6 and 13 use invalid.example addresses: their loyalty runs fail permanently
    assert summary["runs_by_status"] == {"failed": 2, "succeeded": 57}
    assert summary["unexpected"] == []
    assert summary["handler_effects"] == 57  # one effect per succeeded run, none twice
    assert (
        sorted((d["task"], d["reason"]) for d in summary["dlq"]) == [("award_loyalty", "permanent-error")] * 2
    )
    assert summary["latency_ms"]["count"] > 0 and summary["latency_ms"]["p99"] is not None
    assert summary["delayed_lateness_ms"]["count"] == 14


def test_demo_header_names_the_database_used_and_reads_well_in_a_narrow_terminal(
    pg_url: str, redis_url: str
) -> None:
    name = f"demo_{uuid.uuid4().hex[:6]}"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SQLA_OUTBOX_", "AWS_"))}
    env.update({"DATABASE_URL": pg_url, "REDIS_URL": redis_url, "COLUMNS": "72"})
    result = subprocess.run(
        [sys.executable, "-m", "sqla_outbox", "demo", "--orders", "2", "--database-name", name],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    lines = [line.rstrip() for line in result.stderr.splitlines()]
    assert all(len(line) <= 72 for line in lines), lines
    [database] = [line for line in lines if line.startswith("PostgreSQL:")]
    assert database.endswith(f"/{name}"), database  # the demo's database, not the server's
    password = urlsplit(pg_url).password
    assert password is None or password not in result.stderr + result.stdout
    [sqs] = [i for i, line in enumerate(lines) if line.startswith("SQS:")]
    assert "in-process moto server at http://127.0.0.1:" in lines[sqs]
    assert lines[sqs + 1].strip() == "SQLA_OUTBOX_SQS_ENDPOINT_URL is not set"
    assert "OK: all 11 committed runs reached their expected status" in result.stdout


def _demo_without_services(*args: str) -> subprocess.CompletedProcess[str]:
    """The demo where no PostgreSQL and no Valkey answer (ports where nothing listens)."""
    from tests.support import free_port

    env = {k: v for k, v in os.environ.items() if not k.startswith(("SQLA_OUTBOX_", "AWS_"))}
    env.update(
        {
            "DATABASE_URL": f"postgresql://postgres@127.0.0.1:{free_port()}/postgres",
            "REDIS_URL": f"redis://127.0.0.1:{free_port()}/0",
            "COLUMNS": "200",
        }
    )
    return subprocess.run(
        [sys.executable, "-m", "sqla_outbox", "demo", "--orders", "6", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )


def _embedded_folder(stderr: str) -> Path:
    [line] = [line for line in stderr.splitlines() if "an embedded PostgreSQL" in line]
    return Path(line.split(" in ", 1)[1].strip()).parent


def _server_running(folder: Path) -> bool:
    import psutil

    for process in psutil.process_iter(["name", "cmdline"]):
        if process.info["name"] == "postgres" and str(folder) in " ".join(process.info["cmdline"] or []):
            return True
    return False


def test_demo_starts_an_embedded_postgres_and_wakes_through_it_when_nothing_answers() -> None:
    result = _demo_without_services()
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "OK: all 27 committed runs reached their expected status" in result.stdout  # 6 x 4 + 3
    assert "PostgreSQL LISTEN/NOTIFY wake" in result.stdout
    header = result.stderr
    assert "started because nothing answered at postgresql://postgres@127.0.0.1:" in header
    assert "Wake:       PostgreSQL (NOTIFY in the dispatching transaction, LISTEN in the relay)" in header
    folder = _embedded_folder(header)
    assert not folder.exists() and not _server_running(folder)  # removed at the end

    kept = _demo_without_services("--keep", "--orders", "1")
    assert kept.returncode == 0, kept.stdout[-3000:] + kept.stderr[-3000:]
    assert "commit → handler finished" in kept.stdout and "PostgreSQL LISTEN/NOTIFY wake" in kept.stdout
    folder = _embedded_folder(kept.stderr)
    try:
        assert (folder / "pgdata" / "PG_VERSION").exists()  # kept, with the server stopped
        assert not _server_running(folder)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def test_demo_refuses_a_database_it_did_not_create_and_leaves_it_alone(pg_url: str, redis_url: str) -> None:
    """Trial finding: ``--database-name`` of an existing database used to drop it."""
    from tests import support

    name = f"precious_{uuid.uuid4().hex[:6]}"
    support.create_database(pg_url, name)
    try:
        url = support.database_url(pg_url, name)
        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute("CREATE TABLE precious (x int)")
            conn.execute("INSERT INTO precious VALUES (42)")
        env = {k: v for k, v in os.environ.items() if not k.startswith(("SQLA_OUTBOX_", "AWS_"))}
        env.update({"DATABASE_URL": pg_url, "REDIS_URL": redis_url})
        result = subprocess.run(
            [sys.executable, "-m", "sqla_outbox", "demo", "--orders", "1", "--database-name", name],
            capture_output=True,
            text=True,
            env=env,
            timeout=120,
        )
        assert result.returncode == 2, result.stdout[-2000:] + result.stderr[-2000:]
        assert f"database {name!r} already exists and the demo did not create it" in result.stderr
        with psycopg.connect(url, autocommit=True) as conn:
            assert conn.execute("SELECT x FROM precious").fetchall() == [(42,)]
    finally:
        support.drop_database(pg_url, name)


def test_demo_options_refuse_nonsense_before_starting_anything() -> None:
    for args in (["--orders", "-5"], ["--orders", "0"], ["--review-delay", "-1"], ["--timeout", "0"]):
        result = subprocess.run(
            [sys.executable, "-m", "sqla_outbox", "demo", *args], capture_output=True, text=True, timeout=60
        )
        assert result.returncode == 2, (args, result.stderr)
        assert "Invalid value for" in result.stderr, (args, result.stderr)
