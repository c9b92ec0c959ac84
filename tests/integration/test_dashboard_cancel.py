"""The dashboard's cancel action (run page and filtered run list) and the result on the run page."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import sqlalchemy as sa
from sqlalchemy.orm import Session, sessionmaker

from tests.integration.test_dashboard import TOKEN, dispatch, execute, logged_in, ops_settings, serve  # noqa: F401
from tests.support import outbox_rows, status_of, trail


def test_cancel_from_the_run_page_confirms_then_cancels_and_records_the_operator(
    app: sessionmaker[Session], engine: sa.Engine, serve: Callable[..., Any]
) -> None:
    run_id = dispatch(app, "charge_card", {}, tenant_id=3, delay=600)
    done_run = dispatch(app, "charge_card", {}, tenant_id=3)
    execute(engine, "UPDATE task_runs SET status = 'succeeded' WHERE run_id = :r", r=done_run)
    with serve(dashboard_token=TOKEN, dashboard_actions=True) as client:
        csrf = logged_in(client, "alice")
        page = client.get(f"/runs/{run_id}").text
        assert 'data-action="runs-cancel"' in page
        assert 'data-action="runs-cancel"' not in client.get(f"/runs/{done_run}").text  # finished: no button

        preview = client.post(
            "/actions/runs-cancel/preview", data={"csrf_token": csrf, "run_id": str(run_id)}
        )
        assert preview.status_code == 200 and "1 run(s) would be cancelled" in preview.text
        assert status_of(engine, run_id) == "queued" and len(outbox_rows(engine)) == 2  # dry run rolled back

        unconfirmed = client.post("/actions/runs-cancel", data={"csrf_token": csrf, "run_id": str(run_id)})
        assert status_of(engine, run_id) == "queued", unconfirmed.status_code
        done = client.post(
            "/actions/runs-cancel", data={"csrf_token": csrf, "run_id": str(run_id), "confirmed": "yes"}
        )
        assert done.status_code == 200 and "1 run(s) were cancelled" in done.text
        assert "cancelled" in client.get(f"/runs/{run_id}").text
    assert status_of(engine, run_id) == "cancelled"
    [step] = trail(engine, run_id)
    assert (step.status, step.worker_id, step.detail["cancelled_by"]) == (
        "cancelled",
        "dashboard:alice",
        "dashboard:alice",
    )
    assert [r.run_id for r in outbox_rows(engine)] == [done_run]


def test_cancel_a_filtered_set_from_the_run_list_and_refusals(
    app: sessionmaker[Session], engine: sa.Engine, serve: Callable[..., Any]
) -> None:
    mine = [dispatch(app, "charge_card", {}, tenant_id=5) for _ in range(3)]
    other = dispatch(app, "charge_card", {}, tenant_id=6)
    with serve(dashboard_token=TOKEN, dashboard_actions=True) as client:
        csrf = logged_in(client, "bob")
        listed = client.get("/runs", params={"task": "charge_card", "tenant": "5"}).text
        assert 'id="runs-cancel-matching"' in listed
        assert 'id="runs-cancel-matching"' not in client.get("/runs").text  # no filter: no mass cancel
        assert (
            'id="runs-cancel-matching"'
            not in client.get("/runs", params={"tenant": "5", "queue": "bulk"}).text
        )
        form = {"csrf_token": csrf, "task": "charge_card", "tenant": "5", "confirmed": "yes"}
        done = client.post("/actions/runs-cancel", data=form)
        assert done.status_code == 200 and "3 run(s) were cancelled" in done.text
        nothing = client.post("/actions/runs-cancel/preview", data={"csrf_token": csrf})
        finished = client.post(
            "/actions/runs-cancel/preview", data={"csrf_token": csrf, "task": "audit", "status": "succeeded"}
        )
        no_csrf = client.post("/actions/runs-cancel", data={"task": "charge_card", "confirmed": "yes"})
    assert nothing.status_code == 400 and finished.status_code == 400
    assert no_csrf.status_code == 403
    assert {status_of(engine, r) for r in mine} == {"cancelled"}
    assert status_of(engine, other) == "queued"
    assert {trail(engine, r)[0].worker_id for r in mine} == {"dashboard:bob"}


def test_cancel_is_refused_without_actions_or_a_token(
    app: sessionmaker[Session], engine: sa.Engine, serve: Callable[..., Any]
) -> None:
    run_id = dispatch(app, "audit", {})
    with serve(dashboard_token=TOKEN) as client:  # read-only
        csrf = logged_in(client)
        refused = client.post(
            "/actions/runs-cancel", data={"csrf_token": csrf, "run_id": str(run_id), "confirmed": "yes"}
        )
    assert refused.status_code == 403 and status_of(engine, run_id) == "queued"


def test_run_page_shows_the_result_escaped_only_when_payloads_are_shown(
    app: sessionmaker[Session], engine: sa.Engine, serve: Callable[..., Any]
) -> None:
    run_id = dispatch(app, "audit", {})
    quote = {"price_cents": 12500, "note": "<script>alert(1)</script>"}
    execute(
        engine,
        "UPDATE task_runs SET status = 'succeeded', result = CAST(:q AS jsonb) WHERE run_id = :r",
        r=run_id,
        q=json.dumps(quote),
    )
    with serve(dashboard_token=TOKEN) as client:
        logged_in(client)
        hidden = client.get(f"/runs/{run_id}").text
    assert 'id="result-hidden"' in hidden and "12500" not in hidden
    with serve(dashboard_token=TOKEN, dashboard_show_payloads=True) as client:
        logged_in(client)
        shown = client.get(f"/runs/{run_id}").text
    assert "12500" in shown and "<script>alert(1)</script>" not in shown
    assert "&lt;script&gt;" in shown
