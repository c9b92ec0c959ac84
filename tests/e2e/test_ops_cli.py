"""The operations commands as on-call engineers run them: ``python -m sqla_outbox <command>``.

Each test runs the real CLI in a subprocess against the test's PostgreSQL database, Redis
and moto queues, and checks both what it prints (tables, ``--json`` shapes, exit codes)
and what it did to real rows and messages.
"""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.orm import Session, sessionmaker

import sqla_outbox
from sqla_outbox import Dispatch
from sqla_outbox.catalog import Catalog
from sqla_outbox.config import OutboxSettings
from tests import support
from tests.integration.test_ops import fail_into_dlq, outbox_row
from tests.support import effects, receive_all, run_row, service_env, start_worker, status_of, trail, wait_for

pytestmark = pytest.mark.e2e

SECRET = "s3cr3t-payload-4242"
RUN_KEYS = {
    "run_id",
    "task",
    "event",
    "queue",
    "tenant_id",
    "status",
    "idempotency_key",
    "attempts",
    "available_at",
    "created_at",
    "updated_at",
    "started_at",
    "finished_at",
    "lease_owner",
    "lease_expires_at",
    "last_error_type",
    "last_error",
    "dead_lettered_at",
    "cancel_requested_at",
    "age_seconds",
    "parked",
    "result",
}
LETTER_KEYS = {
    "queue",
    "dlq",
    "message_id",
    "run_id",
    "task",
    "tenant_id",
    "reason",
    "error_type",
    "receive_count",
    "failed_at",
    "age_seconds",
    "run_status",
    "origin",
    "resolved",
    "claims",
    "run_queue",
    "run_failed_age_seconds",
}


@pytest.fixture
def env(settings: OutboxSettings, sqs_endpoint: str, queues: dict[str, str]) -> dict[str, str]:
    return service_env(settings, sqs_endpoint)


@pytest.fixture
def ops_settings(settings: OutboxSettings, sqs_endpoint: str, queues: dict[str, str]) -> OutboxSettings:
    return settings.replace(sqs_endpoint_url=sqs_endpoint)


cli = support.run_cli


def cli_json(env: dict[str, str], *args: str, code: int = 0) -> Any:
    result = cli(env, *args, "--json")
    assert result.returncode == code, result.stdout + result.stderr
    return json.loads(result.stdout)


def dispatch(app: sessionmaker[Session], task: str, payload: dict[str, Any], **options: Any) -> uuid.UUID:
    with app() as session, session.begin():
        item = Dispatch(task, payload, **options)
        session.add(item)
    assert item.resolved_run_id is not None
    return item.resolved_run_id


def relay_once(env: dict[str, str]) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "sqla_outbox.relay", "--once", "--json"],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr


def visible(sqs: Any, url: str) -> int:
    """Messages visible in a queue now (moto's count is exact)."""
    attributes = sqs.get_queue_attributes(QueueUrl=url, AttributeNames=["ApproximateNumberOfMessages"])
    return int(attributes["Attributes"]["ApproximateNumberOfMessages"])


def execute(engine: sa.Engine, sql: str, **params: Any) -> None:
    with engine.begin() as conn:
        conn.execute(sa.text(sql), params)


# --- status --------------------------------------------------------------------------------


def test_status_prints_tables_and_a_json_document(
    app: sessionmaker[Session], engine: sa.Engine, env: dict[str, str], sqs: Any, queues: dict[str, str]
) -> None:
    stuck = dispatch(app, "audit", {})
    dispatch(app, "charge_card", {}, tenant_id=2)
    execute(
        engine,
        "UPDATE task_runs SET status = 'running', lease_owner = 'gone:1', "
        "lease_expires_at = clock_timestamp() - interval '2 hours' WHERE run_id = :r",
        r=stuck,
    )
    sqs.send_message(QueueUrl=queues["bulk-dlq"], MessageBody="{}")

    document = cli_json(env, "status")

    assert set(document) == {
        "database_time",
        "pending",
        "runs_by_status",
        "stale_after_seconds",
        "stale_running_count",
        "stale_running",
        "queues",
        "workers",
        "waiting_for_a_worker",
        "parked_count",
        "parked",
        "unreceived_after_seconds",
        "unreceived_count",
        "unreceived",
        "flow_control",
        "pauses",
        "throttled",
        "relay_partitions",
        "relays",
        "without_live_copy_count",
        "without_live_copy",
        "rescued_last_day",
    }
    assert (document["without_live_copy_count"], document["rescued_last_day"]) == (0, 0)
    assert document["pauses"] == [] and document["throttled"] == []
    assert document["relays"] == [] and document["relay_partitions"] is None  # no relay is running
    assert {(p["table"], p["queue"], p["pending"], p["due"]) for p in document["pending"]} == {
        ("platform_outbox_messages", "default", 1, 1),
        ("outbox_messages", "critical", 1, 1),
    }
    assert set(document["pending"][0]) == {
        "table",
        "queue",
        "pending",
        "due",
        "oldest_pending_age_seconds",
        "oldest_due_age_seconds",
        "max_attempts",
    }
    assert document["runs_by_status"] == {
        "queued": 1,
        "running": 1,
        "retrying": 0,
        "succeeded": 0,
        "failed": 0,
        "cancelled": 0,
    }
    assert (document["stale_after_seconds"], document["stale_running_count"]) == (900.0, 1)
    assert document["stale_running"][0]["run_id"] == str(stuck)
    assert document["stale_running"][0]["lease_owner"] == "gone:1"
    depths = {(q["queue"], q["dead_letter"]): q for q in document["queues"]}
    assert len(depths) == 8 and depths[("bulk", True)]["visible"] == 1
    assert set(document["queues"][0]) == {
        "queue",
        "name",
        "dead_letter",
        "visible",
        "not_visible",
        "delayed",
        "error",
    }

    human = cli(env, "status", "--stale-after", "1h")
    assert human.returncode == 0, human.stderr
    for text in (
        "Pending outbox rows",
        "Runs by status",
        "running, lease expired > 1h 00m",
        "Stale running runs",
    ):
        assert text in human.stdout
    assert str(stuck) in human.stdout and "SQS queues" in human.stdout

    without_sqs = cli_json(env, "status", "--no-sqs", "--stale-after", "3h")
    assert without_sqs["queues"] is None and without_sqs["stale_running_count"] == 0

    bad = cli(env, "status", "--stale-after", "ten minutes")
    assert bad.returncode == 2 and "is not a duration" in bad.stderr


# --- runs ----------------------------------------------------------------------------------


def test_runs_list_filters_and_runs_show(
    app: sessionmaker[Session], engine: sa.Engine, env: dict[str, str]
) -> None:
    old = dispatch(app, "audit", {})
    tenant_run = dispatch(app, "charge_card", {}, tenant_id=7)
    execute(
        engine, "UPDATE task_runs SET created_at = created_at - interval '3 days' WHERE run_id = :r", r=old
    )
    execute(
        engine,
        "UPDATE task_runs SET status = 'failed', last_error_type = 'KeyError' WHERE run_id = :r",
        r=old,
    )
    execute(
        engine,
        "INSERT INTO task_run_trail (run_id, status, attempt, worker_id, error_type, error_message, "
        "traceback) VALUES (:r, 'failed', 1, 'w:1', 'KeyError', 'missing-sku', :tb)",
        r=old,
        tb="Traceback (most recent call last):\nKeyError",
    )

    tenant_filters = ("--task", "charge_card", "--tenant", "7", "--queue", "critical", "--newer-than", "1h")
    platform_filters = ("--status", "failed", "--tenant", "platform", "--older-than", "2d")

    everything = cli_json(env, "runs", "list")
    assert [r["run_id"] for r in everything] == [str(tenant_run), str(old)]
    assert set(everything[0]) == RUN_KEYS
    assert [r["run_id"] for r in cli_json(env, "runs", "list", *tenant_filters)] == [str(tenant_run)]
    assert [r["run_id"] for r in cli_json(env, "runs", "list", *platform_filters)] == [str(old)]
    assert len(cli_json(env, "runs", "list", "--limit", "1")) == 1
    table = cli(env, "runs", "list", "--status", "failed")
    assert table.returncode == 0 and str(old) in table.stdout and "KeyError" in table.stdout
    bad_age = cli(env, "runs", "list", "--older-than", "soon")
    assert bad_age.returncode == 2 and "is not a duration" in bad_age.stderr
    # too large for any timestamp, or any page: bad input (exit 2), not a traceback or a database error
    too_old = cli(env, "runs", "list", "--older-than", "999999999999999w")
    assert too_old.returncode == 2 and "longer than 100 years" in too_old.stderr
    too_many = cli(env, "runs", "list", "--limit", "99999999999999999999")
    assert too_many.returncode == 2 and "Traceback" not in too_many.stderr

    shown = cli_json(env, "runs", "show", str(old))
    assert set(shown) == {"run", "trail"} and set(shown["run"]) == RUN_KEYS
    assert shown["run"]["status"] == "failed"
    [step] = shown["trail"]
    assert set(step) == {
        "id",
        "at",
        "status",
        "attempt",
        "receive_count",
        "worker_id",
        "error_type",
        "error_message",
        "traceback",
        "detail",
    }
    assert (step["error_type"], step["error_message"], step["traceback"]) == ("KeyError", "missing-sku", None)
    with_tb = cli_json(env, "runs", "show", str(old), "--with-tracebacks")
    assert with_tb["trail"][0]["traceback"].startswith("Traceback")
    human = cli(env, "runs", "show", str(old), "--with-tracebacks")
    assert human.returncode == 0
    assert "missing-sku" in human.stdout and "Traceback (most recent call last)" in human.stdout

    missing = uuid.uuid4()
    unknown = cli(env, "runs", "show", str(missing))
    assert unknown.returncode == 1 and f"error: no run {missing}" in unknown.stderr
    assert cli(env, "runs", "show", "not-a-uuid").returncode == 2
    # the first hex digits of a run id name it, as on the dashboard
    by_prefix = cli_json(env, "runs", "show", str(old)[:8])
    assert by_prefix["run"]["run_id"] == str(old)
    nowhere = cli(env, "runs", "show", "ffffffffffff")
    assert nowhere.returncode == 1 and "no run starts with 'ffffffffffff'" in nowhere.stderr


def test_a_succeeded_run_lists_no_last_error(
    app: sessionmaker[Session], engine: sa.Engine, env: dict[str, str]
) -> None:
    """A run that failed once and then succeeded keeps its last error for the record; the
    list shows no error for it (it reads as a failure) and ``runs show`` names it an
    earlier attempt's; a failed run's error is still listed."""
    recovered = dispatch(app, "audit", {"n": 1})
    broken = dispatch(app, "audit", {"n": 2})
    for run_id, status in ((recovered, "succeeded"), (broken, "failed")):
        execute(
            engine,
            "UPDATE task_runs SET status = :s, attempts = 2, last_error_type = 'GatewayTimeout', "
            "last_error = 'upstream slow' WHERE run_id = :r",
            s=status,
            r=run_id,
        )
    listed = cli(env, "runs", "list", "--task", "audit")
    assert listed.returncode == 0
    lines = {
        run_id: line
        for line in listed.stdout.splitlines()
        for run_id in (recovered, broken)
        if str(run_id) in line
    }
    assert "GatewayTimeout" not in lines[recovered] and "succeeded" in lines[recovered]
    assert "GatewayTimeout" in lines[broken]
    shown = cli(env, "runs", "show", str(recovered))
    assert "earlier attempt's error" in shown.stdout and "GatewayTimeout: upstream slow" in shown.stdout
    assert "last error" not in cli(env, "runs", "show", str(recovered)).stdout
    assert "last error" in cli(env, "runs", "show", str(broken)).stdout


# --- dlq list and requeue ------------------------------------------------------------------


def test_dlq_list_prints_metadata_and_never_payloads(
    app: sessionmaker[Session],
    engine: sa.Engine,
    env: dict[str, str],
    ops_settings: OutboxSettings,
    sqs: Any,
    queues: dict[str, str],
) -> None:
    run_id = dispatch(app, "charge_card", {"card": SECRET}, tenant_id=3)
    relay_once(env)
    fail_into_dlq(engine, sqs, ops_settings, "critical", {run_id})
    sqs.send_message(QueueUrl=queues["default-dlq"], MessageBody=SECRET)

    document = cli_json(env, "dlq", "list")
    assert set(document) == {"letters", "scanned", "missing_queues", "truncated"}
    by_queue = {x["queue"]: x for x in document["letters"]}
    assert set(by_queue) == {"critical", "default"}
    assert set(by_queue["critical"]) == LETTER_KEYS
    critical = by_queue["critical"]
    assert (critical["run_id"], critical["task"], critical["tenant_id"]) == (str(run_id), "charge_card", 3)
    assert (critical["reason"], critical["error_type"], critical["run_status"]) == (
        "permanent-error",
        "ValueError",
        "failed",
    )
    assert by_queue["default"]["run_id"] is None and by_queue["default"]["reason"] == "no-reason"
    assert cli_json(env, "dlq", "list", "--task", "charge_card")["letters"][0]["run_id"] == str(run_id)
    assert cli_json(env, "dlq", "list", "--queue", "bulk")["letters"] == []
    for command in (("dlq", "list"), ("dlq", "requeue"), ("runs", "list")):  # an empty answer, exit 0, before
        refused = cli(env, *command, "--queue", "nope")
        assert refused.returncode == 2 and "no queue 'nope'" in refused.stderr, command
    assert cli_json(env, "dlq", "list", "--older-than", "1h")["letters"] == []

    human = cli(env, "dlq", "list")
    assert human.returncode == 0
    assert str(run_id) in human.stdout and "permanent-error" in human.stdout
    for result in (human, cli(env, "dlq", "list", "--json")):
        assert SECRET not in result.stdout and SECRET not in result.stderr
    assert visible(sqs, queues["critical-dlq"]) == 1  # still there, visible


def test_dlq_requeue_guardrails_dry_run_and_json_shape(
    app: sessionmaker[Session],
    engine: sa.Engine,
    env: dict[str, str],
    ops_settings: OutboxSettings,
    sqs: Any,
    queues: dict[str, str],
) -> None:
    fixable = dispatch(app, "audit", {"n": 1}, tenant_id=1)
    done = dispatch(app, "audit", {"n": 2}, tenant_id=1)
    keyed = dispatch(app, "charge_card", {}, tenant_id=4, idempotency_key="order-9")
    relay_once(env)
    fail_into_dlq(engine, sqs, ops_settings, "default", {fixable, done})
    fail_into_dlq(engine, sqs, ops_settings, "critical", {keyed})
    execute(engine, "UPDATE task_runs SET status = 'succeeded' WHERE run_id = :r", r=done)
    newer = dispatch(app, "charge_card", {}, tenant_id=4, idempotency_key="order-9")

    unfiltered = cli(env, "dlq", "requeue")
    assert unfiltered.returncode == 2 and "--all" in unfiltered.stderr

    dry = cli_json(env, "dlq", "requeue", "--all", "--dry-run")
    assert set(dry) == {
        "dry_run",
        "items",
        "woke",
        "missing_queues",
        "requeued",
        "skipped",
        "rebuilt_unchecked",
        "not_received",
        "unreachable",
    }
    assert (dry["dry_run"], dry["requeued"], dry["skipped"], dry["woke"]) == (True, 1, 2, False)
    assert (dry["not_received"], dry["unreachable"]) == (0, 0)
    items = {i["run_id"]: i for i in dry["items"]}
    assert set(items[str(fixable)]) == {
        "run_id",
        "task",
        "tenant_id",
        "queue",
        "action",
        "reason",
        "detail",
        "source",
        "outbox",
        "body_origin",
        "dlq_message_ids",
        "dlq_deleted",
    }
    assert (items[str(fixable)]["action"], items[str(fixable)]["outbox"]) == ("would-requeue", "reset")
    assert (items[str(done)]["action"], items[str(done)]["reason"]) == ("skipped", "not-failed")
    assert (items[str(keyed)]["reason"], str(newer) in items[str(keyed)]["detail"]) == (
        "idempotency-conflict",
        True,
    )
    assert run_row(engine, fixable).status == "failed" and outbox_row(engine, fixable).sent_at is not None
    assert len(trail(engine, fixable)) == 3
    assert visible(sqs, queues["default-dlq"]) == 2  # released, not deleted

    refused = cli_json(env, "dlq", "requeue", "--run-id", str(done), code=1)
    assert [(i["run_id"], i["action"], i["reason"]) for i in refused["items"]] == [
        (str(done), "skipped", "not-failed")
    ]
    human_refusal = cli(env, "dlq", "requeue", "--run-id", str(keyed))
    assert human_refusal.returncode == 1 and "idempotency-conflict" in human_refusal.stdout
    assert "requeued 0, skipped 1" in human_refusal.stdout
    human_done = cli(env, "dlq", "requeue", "--run-id", str(done))
    assert human_done.returncode == 1 and "not-failed" in human_done.stdout
    # nothing was requeued: no word about the relay sending "them"
    assert human_done.stdout.rstrip().endswith("requeued 0, skipped 1")

    human_dry = cli(env, "dlq", "requeue", "--task", "audit", "--dry-run")
    assert human_dry.returncode == 0 and "would requeue 1, skipped 1" in human_dry.stdout

    human = cli(env, "dlq", "requeue", "--run-id", str(fixable))
    assert human.returncode == 0, human.stderr
    assert human.stdout.rstrip().endswith("requeued 1, skipped 0 (relay woken)")


def test_requeued_run_goes_through_relay_and_worker_again_and_succeeds(
    app: sessionmaker[Session],
    engine: sa.Engine,
    env: dict[str, str],
    settings: OutboxSettings,
    sqs_endpoint: str,
    sqs: Any,
    queues: dict[str, str],
) -> None:
    # two receives allowed: the handler fails attempts 1 and 2, so the run ends failed in
    # the DLQ; the requeue gives it attempt 3, which succeeds (attempts history is kept)
    worker = start_worker(
        settings, sqs_endpoint, SQLA_OUTBOX_WORKER_RUN_RELAY="true", SQLA_OUTBOX_WORKER_MAX_RECEIVES="2"
    )
    try:
        worker.wait_for_action("worker.started")
        run_id = dispatch(app, "audit", {"mode": "fail_times", "times": 2, "card": SECRET})
        wait_for(lambda: run_row(engine, run_id).dead_lettered_at is not None, timeout=30)
        assert (status_of(engine, run_id), run_row(engine, run_id).attempts) == ("failed", 2)

        [letter] = cli_json(env, "dlq", "list", "--task", "audit")["letters"]
        assert (letter["run_id"], letter["reason"], letter["error_type"]) == (
            str(run_id),
            "retries-exhausted",
            "ConnectionError",
        )

        requeued = cli_json(env, "dlq", "requeue", "--run-id", str(run_id))
        [item] = requeued["items"]
        assert (item["action"], item["outbox"], item["dlq_deleted"], requeued["woke"]) == (
            "requeued",
            "reset",
            1,
            True,
        )

        wait_for(lambda: status_of(engine, run_id) == "succeeded", timeout=30)
    finally:
        worker.kill()
    assert run_row(engine, run_id).attempts == 3
    assert [(t.status, t.attempt) for t in trail(engine, run_id)] == [
        ("running", 1),
        ("retrying", 1),
        ("running", 2),
        ("failed", 2),
        ("failed", None),  # dead-lettered
        ("queued", 2),  # the operator's requeue
        ("running", 3),
        ("succeeded", 3),
    ]
    assert len(effects(engine, run_id)) == 1
    assert receive_all(sqs, queues["default-dlq"]) == []
    shown = cli_json(env, "runs", "show", str(run_id))
    assert shown["trail"][5]["detail"]["requeued_by"] == "operator"
    assert shown["run"]["status"] == "succeeded" and outbox_row(engine, run_id).sent_at is not None


# --- purge ---------------------------------------------------------------------------------


def _seed_purgeable(engine: sa.Engine) -> dict[str, uuid.UUID]:
    ids = {
        name: uuid.uuid4() for name in ("sent_old", "sent_new", "pending_old", "succeeded_old", "failed_old")
    }
    with engine.begin() as conn:
        for name, sent in (("sent_old", "10 days"), ("sent_new", "1 day"), ("pending_old", None)):
            conn.execute(
                sa.text(
                    "INSERT INTO platform_outbox_messages (run_id, queue, envelope, available_at, sent_at, "
                    "created_at) VALUES (:r, 'default', '{}'::jsonb, clock_timestamp() - interval '60 days', "
                    "clock_timestamp() - CAST(:sent AS interval), clock_timestamp() - interval '60 days')"
                ),
                {"r": ids[name], "sent": sent},
            )
        for name, run_status, ago in (
            ("succeeded_old", "succeeded", "8 days"),
            ("failed_old", "failed", "31 days"),
        ):
            conn.execute(
                sa.text(
                    "INSERT INTO task_runs (run_id, task, queue, status, available_at, finished_at) "
                    "VALUES (:r, 'audit', 'default', :s, clock_timestamp(), "
                    "clock_timestamp() - CAST(:ago AS interval))"
                ),
                {"r": ids[name], "s": run_status, "ago": ago},
            )
            conn.execute(
                sa.text("INSERT INTO task_run_trail (run_id, status) VALUES (:r, :s)"),
                {"r": ids[name], "s": run_status},
            )
    return ids


def test_purge_dry_run_then_purge(engine: sa.Engine, env: dict[str, str]) -> None:
    ids = _seed_purgeable(engine)

    dry = cli_json(env, "purge", "--dry-run")
    assert set(dry) == {"dry_run", "started_at", "batch_size", "counts", "stopped", "duration_ms", "deleted"}
    assert set(dry["counts"][0]) == {"category", "table", "cutoff", "deleted", "trail_rows", "batches"}
    assert {c["category"]: c["deleted"] for c in dry["counts"]} == {
        "outbox_messages": 0,
        "platform_outbox_messages": 1,
        "succeeded_runs": 1,
        "failed_runs": 1,
        "cancelled_runs": 0,
        "completed_groups": 0,
    }
    assert dry["dry_run"] is True and dry["deleted"] == 3
    assert support.count(engine, "platform_outbox_messages") == 3 and support.count(engine, "task_runs") == 2
    human_dry = cli(env, "purge", "--dry-run")
    assert human_dry.returncode == 0 and "would delete" in human_dry.stdout
    assert support.count(engine, "task_runs") == 2

    stricter = cli_json(env, "purge", "--dry-run", "--sent-after-days", "0.5", "--failed-after-days", "40")
    assert {c["category"]: c["deleted"] for c in stricter["counts"]}["platform_outbox_messages"] == 2
    assert {c["category"]: c["deleted"] for c in stricter["counts"]}["failed_runs"] == 0

    # it would delete a failed run: without a terminal to ask on, it needs --yes
    refused = cli(env, "purge", "--batch-size", "1", "--json")
    assert refused.returncode == 2 and refused.stdout == ""
    assert "this purge deletes 1 platform outbox messages, 1 succeeded runs, 1 failed runs" in refused.stderr
    assert "including 1 failed runs whose DLQ messages can then no longer be requeued" in refused.stderr
    assert "--yes" in refused.stderr and support.count(engine, "task_runs") == 2
    done = cli_json(env, "purge", "--batch-size", "1", "--yes")
    assert done["dry_run"] is False and done["deleted"] == 3
    assert {c["category"]: c["batches"] for c in done["counts"]} == {
        "outbox_messages": 1,
        "platform_outbox_messages": 2,
        "succeeded_runs": 2,
        "failed_runs": 2,
        "cancelled_runs": 1,
        "completed_groups": 1,
    }
    with engine.connect() as conn:
        left = set(conn.execute(sa.text("SELECT run_id FROM platform_outbox_messages")).scalars())
    assert left == {ids["sent_new"], ids["pending_old"]}
    assert support.count(engine, "task_runs") == 0 and support.count(engine, "task_run_trail") == 0
    human = cli(env, "purge")
    assert human.returncode == 0 and "deleted" in human.stdout


def _in_a_terminal(env: dict[str, str], answer: str, *args: str) -> tuple[int, str]:
    """Run the CLI with a pseudo-terminal as stdin and stdout; type ``answer``."""
    import os
    import pty

    primary, secondary = pty.openpty()
    process = subprocess.Popen(
        [sys.executable, "-m", "sqla_outbox", *args],
        stdin=secondary,
        stdout=secondary,
        stderr=secondary,
        env=env,
    )
    os.close(secondary)
    output = b""
    answered = False
    while True:
        try:
            chunk = os.read(primary, 4096)
        except OSError:  # the child closed the terminal
            break
        if not chunk:
            break
        output += chunk
        if not answered and b"Delete?" in output:
            os.write(primary, answer.encode() + b"\n")
            answered = True
    os.close(primary)
    return process.wait(60), output.decode(errors="replace")


def test_a_purge_below_the_default_ages_asks_on_a_terminal_and_says_what_it_deletes(
    engine: sa.Engine, env: dict[str, str]
) -> None:
    _seed_purgeable(engine)
    code, shown = _in_a_terminal(env, "n", "purge", "--sent-after-days", "0", "--failed-after-days", "40")
    assert code == 1, shown
    assert "ages below the defaults: purge_sent_after_days 0 (default 7)" in shown
    assert "2 platform outbox messages" in shown and "Delete?" in shown
    assert support.count(engine, "platform_outbox_messages") == 3
    code, shown = _in_a_terminal(env, "y", "purge", "--sent-after-days", "0", "--failed-after-days", "40")
    assert code == 0, shown
    assert support.count(engine, "platform_outbox_messages") == 1  # the pending row


@pytest.fixture
def maintenance_app(engine: sa.Engine, settings: OutboxSettings) -> Iterator[sessionmaker[Session]]:
    document = json.loads(json.dumps(support.CATALOG))
    document["tasks"]["maintenance.purge"] = {"queue": "maintenance", "scope": "platform"}
    maker = sessionmaker(engine)
    sqla_outbox.install(maker, settings, catalog=Catalog.from_dict(document))
    yield maker
    sqla_outbox.uninstall(maker)


def test_the_worker_always_has_maintenance_purge(
    maintenance_app: sessionmaker[Session],
    engine: sa.Engine,
    settings: OutboxSettings,
    sqs_endpoint: str,
    queues: dict[str, str],
) -> None:
    ids = _seed_purgeable(engine)
    # imports only the test tasks: maintenance.purge comes with the worker itself
    worker = start_worker(settings, sqs_endpoint, SQLA_OUTBOX_WORKER_RUN_RELAY="true")
    try:
        worker.wait_for_action("worker.started")
        run_id = dispatch(maintenance_app, "maintenance.purge", {})
        wait_for(lambda: status_of(engine, run_id) in ("succeeded", "failed"), timeout=30)
        assert status_of(engine, run_id) == "succeeded"
        purged = worker.wait_for_action("maintenance.purged")
    finally:
        worker.kill()
    assert purged["platform_outbox_messages"] == 1 and purged["succeeded_runs"] == 1
    with engine.connect() as conn:
        left = set(conn.execute(sa.text("SELECT run_id FROM platform_outbox_messages")).scalars())
    # the purge run's own row was sent seconds ago: kept, like every recent or pending row
    assert left == {ids["sent_new"], ids["pending_old"], run_id}
    assert {r.run_id for r in support.runs(engine)} == {run_id}


# --- user text is printed as typed ----------------------------------------------------------

KEY = "order[/7]"
ERROR = "card declined [/bold] in [asyncio] step [bold]2 :warning:"
OWNER = "web[/7]:42"


def test_brackets_in_user_and_database_text_are_printed_verbatim(
    app: sessionmaker[Session], engine: sa.Engine, env: dict[str, str], sqs: Any, queues: dict[str, str]
) -> None:
    """Idempotency keys, error messages and worker names are data, not rich markup."""
    run_id = dispatch(app, "charge_card", {}, tenant_id=2, idempotency_key=KEY)
    execute(
        engine,
        "UPDATE task_runs SET status = 'running', lease_owner = :owner, "
        "lease_expires_at = clock_timestamp() - interval '2 hours', "
        "last_error_type = 'Declined[/7]', last_error = :error WHERE run_id = :r",
        r=run_id,
        owner=OWNER,
        error=ERROR,
    )
    execute(
        engine,
        "INSERT INTO task_run_trail (run_id, status, attempt, worker_id, error_type, error_message, "
        "detail) VALUES (:r, 'retrying', 1, :owner, 'Declined[/7]', :error, "
        """CAST('{"note": "[red]not red"}' AS jsonb))""",
        r=run_id,
        owner=OWNER,
        error=ERROR,
    )
    attributes = {"run_id": str(run_id), "task": "charge_card", "reason": "permanent-error"}
    attributes["error_type"] = "[asyncio]Declined[/7]"
    sqs.send_message(
        QueueUrl=queues["critical-dlq"],
        MessageBody="{}",
        MessageAttributes={k: {"DataType": "String", "StringValue": v} for k, v in attributes.items()},
    )

    shown = cli(env, "runs", "show", str(run_id))
    assert shown.returncode == 0, shown.stderr
    for text in (KEY, f"Declined[/7]: {ERROR}", f"{OWNER} until", "note=[red]not red"):
        assert text in shown.stdout, text
    assert shown.stdout.count(ERROR) == 2  # the run's last error and the trail row

    listed = cli(env, "runs", "list")
    assert listed.returncode == 0, listed.stderr
    assert "Declined[/7]" in listed.stdout

    status = cli(env, "status", "--no-sqs")
    assert status.returncode == 0, status.stderr
    assert OWNER in status.stdout

    letters = cli(env, "dlq", "list")
    assert letters.returncode == 0, letters.stderr
    assert "[asyncio]Declined[/7]" in letters.stdout

    requeue = cli(env, "dlq", "requeue", "--all", "--dry-run", "--include-unverified")
    assert requeue.returncode == 0, requeue.stderr
    assert "not-failed" in requeue.stdout and "MarkupError" not in requeue.stderr
