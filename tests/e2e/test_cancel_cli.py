"""``python -m sqla_outbox runs cancel`` and ``runs show`` of a result, as operators run them."""

from __future__ import annotations

import json
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.orm import Session, sessionmaker

from sqla_outbox.config import OutboxSettings
from tests.e2e.test_ops_cli import cli, cli_json, dispatch, execute
from tests.support import outbox_rows, run_row, service_env, trail

pytestmark = pytest.mark.e2e


@pytest.fixture
def env(settings: OutboxSettings, sqs_endpoint: str) -> dict[str, str]:
    return service_env(settings, sqs_endpoint)


def test_runs_cancel_dry_run_filters_json_and_trail(
    app: sessionmaker[Session], engine: sa.Engine, env: dict[str, str]
) -> None:
    mine = [dispatch(app, "charge_card", {}, tenant_id=3) for _ in range(2)]
    other = dispatch(app, "charge_card", {}, tenant_id=4)
    running = dispatch(app, "charge_card", {}, tenant_id=3)
    execute(engine, "UPDATE task_runs SET status = 'running', attempts = 1 WHERE run_id = :r", r=running)

    dry = cli_json(env, "runs", "cancel", "--task", "charge_card", "--tenant", "3", "--dry-run")
    assert dry["dry_run"] is True and dry["by"].startswith("operator:")
    assert {(r["run_id"], r["outcome"], r["external_effects_possible"]) for r in dry["results"]} == {
        (str(mine[0]), "cancelled", False),
        (str(mine[1]), "cancelled", False),
        (str(running), "stop_requested", True),  # its handler may have acted already
    }
    assert {run_row(engine, r).status for r in mine} == {"queued"}  # nothing changed
    assert len(outbox_rows(engine)) == 4

    only_queued = (
        "--task",
        "charge_card",
        "--tenant",
        "3",
        "--status",
        "queued",
        "--reason",
        "clinic closed",
    )
    human = cli(env, "runs", "cancel", *only_queued)
    assert human.returncode == 0, human.stderr
    assert "2 run(s) were cancelled, 0 running run(s) were asked to stop" in human.stdout
    assert {run_row(engine, r).status for r in mine} == {"cancelled"}
    assert run_row(engine, other).status == "queued"
    assert run_row(engine, running).cancel_requested_at is None
    [step] = trail(engine, mine[0])
    assert step.worker_id.startswith("operator:") and step.detail["reason"] == "clinic closed"
    assert {r.run_id for r in outbox_rows(engine)} == {other, running}

    human_again = cli(env, "runs", "cancel", "--run-id", str(running), "--dry-run")
    assert "what it did outside the database before it saw the cancel" in human_again.stdout
    again = cli_json(env, "runs", "cancel", "--run-id", str(mine[0]), "--run-id", str(running))
    assert {(r["run_id"], r["outcome"], r["previous_status"]) for r in again["results"]} == {
        (str(mine[0]), "finished", "cancelled"),
        (str(running), "stop_requested", "running"),
    }
    missing = cli(env, "runs", "cancel", "--run-id", "00000000-0000-0000-0000-000000000001")
    assert missing.returncode == 1 and "not_found" in missing.stdout
    assert cli(env, "runs", "cancel").returncode == 2  # no filter: refused


def test_runs_cancel_by_idempotency_key(
    app: sessionmaker[Session], engine: sa.Engine, env: dict[str, str]
) -> None:
    keyed = dispatch(app, "audit", {}, idempotency_key="reminder:appointment-7")
    args = ("runs", "cancel", "--task", "audit", "--idempotency-key", "reminder:appointment-7")
    [result] = cli_json(env, *args)["results"]
    assert (result["run_id"], result["outcome"], result["was_sent"]) == (str(keyed), "cancelled", False)
    assert run_row(engine, keyed).status == "cancelled"


def test_runs_show_prints_the_result(
    app: sessionmaker[Session], engine: sa.Engine, env: dict[str, str]
) -> None:
    run_id = dispatch(app, "audit", {})
    quote = {"price_cents": 12500, "note": "\x1b[31mred\x1b[0m"}
    execute(
        engine,
        "UPDATE task_runs SET status = 'succeeded', result = CAST(:q AS jsonb) WHERE run_id = :r",
        r=run_id,
        q=json.dumps(quote),
    )
    assert cli_json(env, "runs", "show", str(run_id))["run"]["result"] == quote
    human = cli(env, "runs", "show", str(run_id))
    assert human.returncode == 0 and '"price_cents": 12500' in human.stdout
    assert "\x1b" not in human.stdout  # escaped, never sent to the terminal
    listed: list[dict[str, Any]] = cli_json(env, "runs", "list")
    assert listed[0]["result"] is None  # lists never load results


def test_a_mistyped_task_or_queue_is_refused_not_reported_as_done(
    app: sessionmaker[Session], engine: sa.Engine, env: dict[str, str]
) -> None:
    """Trial finding: `pause --task typo_task` printed "paused task typo_task" and
    `runs cancel --task nope` "0 run(s) were cancelled", both exit 0: during an incident a
    typo would silently do nothing. With a catalog, names it does not know are refused."""
    run_id = dispatch(app, "charge_card", {}, tenant_id=3)
    for args, option in (
        (("pause", "--task", "charge_crad"), "--task"),
        (("pause", "--queue", "critcal"), "--queue"),
        (("runs", "cancel", "--task", "charge_crad"), "--task"),
    ):
        result = cli(env, *args)
        assert result.returncode == 2, (args, result.stdout, result.stderr)
        assert result.stderr.startswith(f"error: {option}: no ") and "check the name" in result.stderr
    with engine.connect() as conn:
        assert conn.execute(sa.text("SELECT count(*) FROM flow_pauses")).scalar() == 0
    assert run_row(engine, run_id).status == "queued"
    assert cli(env, "pause", "--task", "charge_card").returncode == 0  # a known task still pauses
