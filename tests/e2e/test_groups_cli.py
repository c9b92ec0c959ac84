"""``python -m sqla_outbox groups list|show`` in a subprocess: progress n of m, --json."""

from __future__ import annotations

import json
import subprocess
import uuid
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.orm import Session, sessionmaker

from sqla_outbox import Dispatch, Group
from sqla_outbox.config import OutboxSettings
from sqla_outbox.lifecycle import attempts
from tests.support import run_cli, service_env

pytestmark = pytest.mark.e2e


def cli(settings: OutboxSettings, *args: str) -> subprocess.CompletedProcess[str]:
    return run_cli({**service_env(settings, "http://127.0.0.1:1"), "COLUMNS": "200"}, *args)


def finish(engine: sa.Engine, run_id: uuid.UUID) -> None:
    with engine.begin() as conn:
        claim = attempts.take_lease(
            conn,
            run_id=run_id,
            task="audit",
            tenant_id=None,
            worker_id="w",
            lease_seconds=60,
            receive_count=1,
            honour_due_time=False,
        )
        attempts.mark_succeeded(conn, attempts.Attempt(run_id, claim.attempt, 1, "w"))


def test_groups_list_and_show_report_progress(
    app: sessionmaker[Session], engine: sa.Engine, settings: OutboxSettings
) -> None:
    with app() as session, session.begin():
        group = Group(
            [Dispatch("audit", {"seat": i}) for i in range(3)], on_complete=Dispatch("send_welcome")
        )
        session.add(group)
    first = group.members[0].run_id
    finish(engine, first)

    listed = cli(settings, "groups", "list")
    assert listed.returncode == 0, listed.stderr
    assert "1 of 3 finished" in listed.stdout and "send_welcome" in listed.stdout

    shown: Any = json.loads(cli(settings, "groups", "show", str(group.group_id), "--json").stdout)
    assert shown["progress"] == "1 of 3 finished"
    assert (shown["total"], shown["finished"], shown["completed_at"]) == (3, 1, None)
    assert {m["run_id"]: m["finished_status"] for m in shown["members"]}[str(first)] == "succeeded"

    for member in group.members[1:]:
        finish(engine, member.run_id)
    (entry,) = json.loads(cli(settings, "groups", "list", "--json").stdout)
    assert entry["progress"] == "3 of 3 finished" and entry["completion_status"] == "queued"
    assert json.loads(cli(settings, "groups", "list", "--unfinished", "--json").stdout) == []
    human = cli(settings, "groups", "show", str(group.group_id))
    assert "3 of 3 finished" in human.stdout and str(group.completion_run_id) in human.stdout

    missing = cli(settings, "groups", "show", str(uuid.uuid4()))
    assert missing.returncode == 1 and "no group" in missing.stderr
