"""Upgrading worker pools one at a time: the previous release's workers keep serving.

A pool-by-pool upgrade runs the new release's relay and some new workers beside workers of
the previous release. The relay holds back a due run only while no live worker serves its
task on its queue (worker presence); a worker of the previous release must count as live
for what it serves, or the relay holds its queue's work while it sits idle. Here the
previous release is 0.1.0, run from its own source (taken from git by the commit it was
released from, so a clone without tags serves), against the database as this release
migrates it."""

from __future__ import annotations

import subprocess
import sys
import tarfile
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.orm import Session, sessionmaker

from sqla_outbox import Dispatch
from sqla_outbox.config import OutboxSettings
from tests import support
from tests.support import ServiceProcess, start_relay, start_worker, status_of, wait_for

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]
# The commit 0.1.0 was released from. Named by its hash rather than the ``v0.1.0`` tag: a
# clone carries the commits of main but not always its tags (CI's clone has none).
PREVIOUS_RELEASE = "05ca6bad035e0dd178a662b401932f2189ffd443"


def previous_release(tmp_path: Path) -> Path:
    """The previous release's package, from git (``git archive``), in a folder of its own.

    Raises:
        AssertionError: The release's commit is not in this clone (a shallow clone).
    """
    archive = tmp_path / "previous.tar"
    made = subprocess.run(
        [
            "git",
            "-C",
            str(ROOT),
            "archive",
            "--format=tar",
            "-o",
            str(archive),
            PREVIOUS_RELEASE,
            "sqla_outbox",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert made.returncode == 0, (
        f"the 0.1.0 commit {PREVIOUS_RELEASE[:12]} is needed (a full clone, not a shallow one): {made.stderr}"
    )
    folder = tmp_path / "previous"
    with tarfile.open(archive) as tar:
        tar.extractall(folder, filter="data")
    return folder


def start_previous_worker(
    settings: OutboxSettings, endpoint: str, folder: Path, **extra: str
) -> ServiceProcess:
    """A worker of the previous release: its own package first on the path (the working
    directory), this repository after it for the test tasks."""
    args = [
        sys.executable,
        "-m",
        "sqla_outbox.worker",
        "--log-format",
        "json",
        "--imports",
        "tests.e2e.upgrade_tasks",
    ]
    env = support.service_env(settings, endpoint, PYTHONPATH=str(ROOT), **extra)
    env.setdefault("SQLA_OUTBOX_WORKER_WAIT_SECONDS", "1")
    return ServiceProcess(args, env, "previous-worker", cwd=str(folder))


def test_a_pool_by_pool_upgrade_keeps_the_previous_releases_workers_serving(
    app: sessionmaker[Session],
    engine: sa.Engine,
    settings: OutboxSettings,
    sqs_endpoint: str,
    queues: dict[str, str],
    tmp_path: Path,
) -> None:
    folder = previous_release(tmp_path)
    where = subprocess.run(  # the previous worker's interpreter imports the previous package
        [sys.executable, "-c", "import sqla_outbox; print(sqla_outbox.__file__)"],
        cwd=folder,
        env={**support.service_env(settings, sqs_endpoint), "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert where.stdout.strip().startswith(str(folder)), where.stdout + where.stderr
    old = start_previous_worker(settings, sqs_endpoint, folder, SQLA_OUTBOX_WORKER_QUEUES="default")
    new = start_worker(
        settings, sqs_endpoint, imports="tests.e2e.upgrade_tasks", SQLA_OUTBOX_WORKER_QUEUES="critical"
    )
    relay = start_relay(settings, sqs_endpoint)
    processes: list[Any] = [old, new, relay]
    try:
        old.wait_for_action("worker.started", timeout=60)
        new.wait_for_action("worker.started", timeout=60)
        relay.wait_for_action("relay.leader", timeout=60)
        with app() as session, session.begin():
            default = [Dispatch("audit", {"n": n}) for n in range(5)]
            critical = [Dispatch("charge_card", {"n": n}, tenant_id=1) for n in range(5)]
            session.add_all(default + critical)
        runs = [d.run_id for d in default + critical]
        wait_for(lambda: all(status_of(engine, r) == "succeeded" for r in runs), timeout=60)
        with engine.connect() as conn:
            by_task = dict(
                conn.execute(
                    sa.text("SELECT task, array_agg(DISTINCT worker) FROM effects GROUP BY task")
                ).all()
            )
        assert by_task["audit"] == [str(old.process.pid)]  # the previous release's worker ran them
        assert by_task["charge_card"] == [str(new.process.pid)]
    finally:
        for process in processes:
            process.kill()
