"""The dashboard in a real browser: Debian's Chromium driven by Playwright, against
``python -m sqla_outbox dashboard`` and real relay and worker processes, PostgreSQL, Redis
and moto.

An operator signs in, watches runs flow on the overview (refreshed live, without reloading
the page), finds a failed run, reads its error and trail, requeues it from the DLQ page
after a confirmation step, and sees it succeed; a browser without the token, or a form
without its CSRF token, changes nothing. Every page is saved as a screenshot in
``tests/artifacts/dashboard/``. (Pause and resume come with flow control.)
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import sqlalchemy as sa
from sqlalchemy.orm import Session, sessionmaker

from sqla_outbox import Dispatch, flow
from sqla_outbox.catalog import Catalog
from sqla_outbox.config import OutboxSettings
from tests import support
from tests.e2e.browser import chromium, screenshot
from tests.integration.test_ops import fail_into_dlq
from tests.support import ServiceProcess, service_env, start_relay, start_worker, status_of, trail, wait_for

pytestmark = pytest.mark.e2e

TOKEN = "browser-test-token-0123456789"
TOKENS = {"alice": "alice-browser-token-0123456789", "mallory": "mallory-browser-token-0123456789"}
"""Each operator's own token (the login page asks for the token only: it names them)."""
USERS = ",".join(
    f"{name}:operator:sha256={hashlib.sha256(t.encode()).hexdigest()}" for name, t in TOKENS.items()
)


@pytest.fixture
def scheduled_catalog(tmp_path: Path, catalog: Catalog, settings: OutboxSettings) -> OutboxSettings:
    """The test catalog with ``audit`` scheduled hourly (the relay dispatches its latest slot)."""
    document = json.loads(catalog.to_json())
    document["tasks"]["audit"]["schedule"] = {"every_seconds": 3600}
    path = tmp_path / "scheduled-tasks.json"
    path.write_text(json.dumps(document))
    return settings.replace(catalog_path=str(path))


def start_dashboard(settings: OutboxSettings, endpoint: str, **extra: str) -> tuple[ServiceProcess, str]:
    port = support.free_port()
    env = service_env(
        settings,
        endpoint,
        SQLA_OUTBOX_DASHBOARD_PORT=str(port),
        SQLA_OUTBOX_DASHBOARD_TOKEN=TOKEN,
        SQLA_OUTBOX_DASHBOARD_USERS=USERS,
        SQLA_OUTBOX_DASHBOARD_ACTIONS="true",
        SQLA_OUTBOX_DASHBOARD_REFRESH_SECONDS="1",
        **extra,
    )
    process = ServiceProcess(
        [sys.executable, "-m", "sqla_outbox", "dashboard", "--log-format", "json"], env, "dashboard"
    )
    base = f"http://127.0.0.1:{port}"

    def answers() -> bool:
        if process.process.poll() is not None:
            raise AssertionError("dashboard exited:\n" + process.output())
        try:
            return httpx.get(base + "/login", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    wait_for(answers, timeout=30, interval=0.2)
    return process, base


@pytest.fixture
def services(
    scheduled_catalog: OutboxSettings, sqs_endpoint: str, queues: dict[str, str]
) -> Iterator[tuple[ServiceProcess, ServiceProcess, ServiceProcess, str]]:
    relay = start_relay(scheduled_catalog, sqs_endpoint)
    worker = start_worker(scheduled_catalog, sqs_endpoint)
    dashboard, base = start_dashboard(scheduled_catalog, sqs_endpoint)
    try:
        yield relay, worker, dashboard, base
    finally:
        for process in (dashboard, worker, relay):
            process.terminate()


def dispatch(app: sessionmaker[Session], task: str, payload: dict[str, Any], **options: Any) -> uuid.UUID:
    with app() as session, session.begin():
        item = Dispatch(task, payload, **options)
        session.add(item)
    assert item.resolved_run_id is not None
    return item.resolved_run_id


def sign_in(page: Any, base: str, name: str = "alice") -> None:
    page.goto(base + "/")
    assert "/login" in page.url  # redirected: the dashboard needs the token
    screenshot(page, "login")
    page.fill("#token", TOKENS[name])
    page.click("#login button[type=submit]")
    page.wait_for_selector("#live")


def test_an_operator_watches_runs_flow_then_requeues_a_failed_run_that_succeeds(
    app: sessionmaker[Session],
    engine: sa.Engine,
    services: tuple[ServiceProcess, ServiceProcess, ServiceProcess, str],
    tmp_path: Path,
) -> None:
    _relay, worker, _dashboard, base = services
    worker.wait_for_action("worker.started", timeout=30)
    fixed = tmp_path / "order-service-fixed"
    with chromium(tmp_path / "profile") as browser:
        page = browser.new_page()
        errors: list[str] = []
        page.on("pageerror", lambda exc: errors.append(str(exc)))
        page.on("console", lambda msg: errors.append(msg.text) if msg.type == "error" else None)
        sign_in(page, base)
        assert page.inner_text("#operator").split()[0] == "alice"

        # runs flow: the overview refreshes itself (htmx), the page is never reloaded
        page.evaluate("window.__not_reloaded = true")
        before = int(page.get_attribute('[data-status-count="succeeded"]', "data-count") or 0)
        flowing = [dispatch(app, "send_welcome", {"mode": "ok"}, tenant_id=t) for t in (1, 2, 3, 2, 1)]
        failing = dispatch(app, "audit", {"mode": "permanent_until_fixed", "fixed": str(fixed)})
        page.wait_for_function(
            f"""() => Number(document.querySelector('[data-status-count="succeeded"]')
                .getAttribute('data-count')) >= {before + len(flowing)}""",
            timeout=60_000,
        )
        page.wait_for_function(
            """() => Number(document.querySelector('[data-status-count="failed"]')
                .getAttribute('data-count')) >= 1""",
            timeout=60_000,
        )
        assert page.evaluate("window.__not_reloaded") is True
        page.wait_for_function(
            """() => [...document.querySelectorAll('#activity [data-finished]')]
                .some(cell => Number(cell.getAttribute('data-finished')) >= 1)""",
            timeout=30_000,
        )
        assert page.locator("#chart-throughput polyline").count() >= 3
        # the numbers refresh around the charts, which stay (hx-preserve) and refresh themselves
        page.evaluate("document.getElementById('chart-throughput').dataset.seen = 'yes'")
        shown = page.inner_text("#db-time")
        page.wait_for_function(f"() => document.getElementById('db-time').innerText !== {json.dumps(shown)}")
        assert page.locator("#charts-box").count() == 1
        page.wait_for_function(
            "() => !document.getElementById('chart-throughput').dataset.seen", timeout=10_000
        )
        screenshot(page, "overview")

        # the Runs list follows new runs without a reload
        page.click("nav >> text=Runs")
        page.locator("#runs tr[data-run-id]").first.wait_for()
        page.evaluate("window.__same_page = true")
        arrived = dispatch(app, "audit", {"n": "late"})
        page.locator(f'#runs tr[data-run-id="{arrived}"]').wait_for(timeout=15_000)
        assert page.evaluate("window.__same_page") is True

        # a failed run: find it with the filters, open it, read its error and trail
        page.click("nav >> text=Runs")
        page.select_option("#run-filters select[name=status]", "failed")
        page.click("#run-filters button[type=submit]")
        row = page.locator(f'tr[data-run-id="{failing}"]')
        row.wait_for()
        screenshot(page, "runs")
        row.locator("a").first.click()
        page.wait_for_selector("#run-id")
        assert page.inner_text("#run-id") == str(failing)
        assert "the <b>order service</b> refused order 7" in page.inner_text("#last-error")
        assert page.locator("#last-error b").count() == 0  # shown as text, never as markup
        assert page.locator('#trail [data-trail-status="failed"]').count() >= 1
        assert page.locator("#payload-hidden").is_visible()
        screenshot(page, "run-failed")

        # the DLQ page lists it with its reason and error; requeue it, after confirming
        page.click("nav >> text=DLQ")
        letter = page.locator(f'#dead-lettered-runs tr[data-run-id="{failing}"]')
        letter.wait_for()
        assert "permanent-error" in letter.inner_text() and "order service" in letter.inner_text()
        screenshot(page, "dlq")
        letter.locator('button[data-action="dlq-requeue"]').click()
        page.wait_for_selector("#preview-summary")
        assert "would requeue 1, skipped 0" in page.inner_text("#preview-summary")
        assert status_of(engine, failing) == "failed"  # the preview changed nothing
        screenshot(page, "requeue-confirm")
        fixed.write_text("deployed the fix")
        page.click("#confirm button[type=submit]")
        page.wait_for_selector("#result-summary")
        assert "requeued 1, skipped 0" in page.inner_text("#result-summary")
        screenshot(page, "requeue-result")

        # ... and it succeeds
        wait_for(lambda: status_of(engine, failing) == "succeeded", timeout=60, interval=0.2)
        page.goto(f"{base}/runs/{failing}")
        assert page.get_attribute("h1 [data-status]", "data-status") == "succeeded"
        assert page.locator('#trail [data-worker="dashboard:alice"]').count() == 1
        screenshot(page, "run-succeeded")

        # who is running: the relay and the worker of this test, and the queues' depths
        page.click("nav >> text=Liveness")
        page.locator("#relays tr[data-relay]").first.wait_for()
        assert page.locator("#workers tr[data-worker]").count() >= 1
        assert page.locator('#queue-depths tr[data-queue-depth="critical-dlq"]').count() == 1
        screenshot(page, "liveness")

        # at phone width, in the system's dark mode: nothing wider than the screen, dark page
        page.set_viewport_size({"width": 390, "height": 844})
        page.emulate_media(color_scheme="dark")
        for path in ("/", "/runs", "/dlq", "/liveness"):
            page.goto(base + path)
            assert page.evaluate("document.documentElement.scrollWidth <= window.innerWidth + 1"), path
            background = page.evaluate("getComputedStyle(document.body).backgroundColor")
            assert background == "rgb(15, 19, 27)", (path, background)
        screenshot(page, "phone-dark-liveness")
        page.set_viewport_size({"width": 1280, "height": 900})
        page.emulate_media(color_scheme="light")

        # the schedules the relay runs, and the controls page
        page.click("nav >> text=Schedules")
        audit = page.locator('#schedules tr[data-task="audit"]')
        audit.wait_for()
        wait_for(
            lambda: page.reload() or "not dispatched" not in audit.inner_text(), timeout=30, interval=0.5
        )
        screenshot(page, "schedules")
        page.click("nav >> text=Controls")
        assert page.locator('[data-control="flow-pause"]').is_visible()
        assert page.locator("#no-pauses").is_visible()
        assert page.locator("#flow-control #breakers").is_visible()  # read-only breaker states
        assert errors == []
    assert [row.worker_id for row in trail(engine, failing) if row.status == "queued"][
        -1
    ] == "dashboard:alice"


def test_an_operator_cancels_a_running_run_from_its_page(
    app: sessionmaker[Session],
    engine: sa.Engine,
    services: tuple[ServiceProcess, ServiceProcess, ServiceProcess, str],
    tmp_path: Path,
) -> None:
    """Issue 14 on the dashboard: Cancel on a running run's page, confirmed after its dry
    run; the handler sees the cancellation, the run ends cancelled, the trail names alice."""
    _relay, worker, _dashboard, base = services
    worker.wait_for_action("worker.started", timeout=30)
    marker = tmp_path / "marker"
    run_id = dispatch(app, "audit", {"mode": "wait_for_cancel", "marker": str(marker), "seconds": 60})
    wait_for(lambda: marker.exists() and "started" in marker.read_text(), timeout=30)
    with chromium(tmp_path / "profile") as browser:
        page = browser.new_page()
        sign_in(page, base)
        page.goto(f"{base}/runs/{run_id}")
        assert page.get_attribute("h1 [data-status]", "data-status") == "running"
        page.click('button[data-action="runs-cancel"]')
        page.wait_for_selector("#preview-summary")
        assert "1 running run(s) would be asked to stop" in page.inner_text("#preview-summary")
        assert status_of(engine, run_id) == "running"  # the preview changed nothing
        screenshot(page, "cancel-confirm")
        page.click("#confirm button[type=submit]")
        page.wait_for_selector("#result-summary")
        assert "1 running run(s) were asked to stop" in page.inner_text("#result-summary")
        wait_for(lambda: status_of(engine, run_id) == "cancelled", timeout=30, interval=0.2)
        page.goto(f"{base}/runs/{run_id}")
        assert page.get_attribute("h1 [data-status]", "data-status") == "cancelled"
        assert page.locator('#trail [data-worker="dashboard:alice"]').count() == 1
        assert page.locator('button[data-action="runs-cancel"]').count() == 0
        screenshot(page, "run-cancelled")
    assert "saw-cancel" in marker.read_text()
    assert [t.status for t in trail(engine, run_id)] == ["running", "running", "cancelled"]


def test_pause_a_task_and_resume_it(
    app: sessionmaker[Session],
    engine: sa.Engine,
    services: tuple[ServiceProcess, ServiceProcess, ServiceProcess, str],
    tmp_path: Path,
) -> None:
    _relay, worker, _dashboard, base = services
    worker.wait_for_action("worker.started", timeout=30)
    with chromium(tmp_path / "profile") as browser:
        page = browser.new_page()
        errors: list[str] = []
        page.on("pageerror", lambda exc: errors.append(str(exc)))
        sign_in(page, base)
        page.click("nav >> text=Controls")
        form = page.locator("#pause-form")
        form.locator("select[name=scope]").select_option("task")
        form.locator("input[name=target]").fill("audit")
        form.locator("input[name=reason]").fill("<b>provider</b> incident")
        form.locator('button[data-action="flow-pause"]').click()
        page.wait_for_selector("#preview-summary")
        assert "would pause task audit" in page.inner_text("#preview-summary")
        with engine.connect() as conn:
            assert flow.list_pauses(conn) == []  # the preview changed nothing
        screenshot(page, "pause-confirm")
        page.click("#confirm button[type=submit]")
        page.wait_for_selector("#result-summary")
        assert "paused task audit" in page.inner_text("#result-summary")
        with engine.connect() as conn:
            [pause] = flow.list_pauses(conn)
        assert (pause.scope, pause.target, pause.paused_by) == ("task", "audit", "dashboard:alice")
        assert pause.reason == "<b>provider</b> incident"

        # the task's runs wait in the outbox; another task's run goes through
        waiting = [dispatch(app, "audit", {"mode": "ok"}, tenant_id=t) for t in (1, 2, 3)]
        other = dispatch(app, "send_welcome", {"mode": "ok"}, tenant_id=1)
        wait_for(lambda: status_of(engine, other) == "succeeded", timeout=30, interval=0.2)
        time.sleep(2)
        assert {status_of(engine, run_id) for run_id in waiting} == {"queued"}
        page.click("nav >> text=Controls")
        row = page.locator('#pauses tr[data-pause="task:audit"]')
        row.wait_for()
        assert "<b>provider</b> incident" in row.inner_text()  # shown as text
        assert row.locator("b").count() == 0
        screenshot(page, "controls")

        # resume: the held runs leave at once and succeed
        row.locator('button[data-action="flow-resume"]').click()
        page.wait_for_selector("#preview-summary")
        assert "would resume task audit" in page.inner_text("#preview-summary")
        page.click("#confirm button[type=submit]")
        page.wait_for_selector("#result-summary")
        assert "resumed task audit" in page.inner_text("#result-summary")
        screenshot(page, "resume-result")
        wait_for(
            lambda: {status_of(engine, run_id) for run_id in waiting} == {"succeeded"},
            timeout=30,
            interval=0.2,
        )
        with engine.connect() as conn:
            assert flow.list_pauses(conn) == []
            attempts = conn.execute(
                sa.text("SELECT max(attempts) FROM task_runs WHERE run_id = ANY(:ids)"), {"ids": waiting}
            ).scalar_one()
        assert attempts == 1

        # a tenant over its rate limit shows on the Controls page, with how long it waits
        with engine.begin() as conn:
            flow.set_tenant(conn, 5, rate_limit_per_minute=2, by="test")
        time.sleep(1.5)  # a new limit applies within flow_refresh_seconds (1 s)
        limited = [dispatch(app, "send_welcome", {"mode": "ok"}, tenant_id=5) for _ in range(6)]
        wait_for(lambda: sum(status_of(engine, run_id) == "succeeded" for run_id in limited) == 2, timeout=30)
        throttled = page.locator('#throttled tr[data-tenant="5"]')
        wait_for(lambda: page.goto(base + "/controls") and throttled.count() == 1, timeout=30, interval=0.5)
        assert "4" in throttled.locator("td").nth(3).inner_text()  # due runs waiting
        screenshot(page, "controls-throttled")
        assert errors == []


def test_without_the_token_or_the_csrf_token_the_browser_changes_nothing(
    app: sessionmaker[Session],
    engine: sa.Engine,
    sqs: Any,
    settings: OutboxSettings,
    sqs_endpoint: str,
    queues: dict[str, str],
    tmp_path: Path,
) -> None:
    ops_settings = settings.replace(sqs_endpoint_url=sqs_endpoint)
    run_id = dispatch(app, "charge_card", {}, tenant_id=3)
    relay = start_relay(ops_settings, sqs_endpoint)
    try:
        wait_for(lambda: support.outbox_rows(engine)[0].sent_at is not None, timeout=30)
    finally:
        relay.terminate()
    fail_into_dlq(engine, sqs, ops_settings, "critical", {run_id})
    dashboard, base = start_dashboard(ops_settings, sqs_endpoint)
    form = {"run_id": str(run_id), "confirmed": "yes"}
    try:
        with chromium(tmp_path / "stranger") as stranger:
            page = stranger.new_page()
            page.goto(base + "/dlq")
            assert "/login" in page.url
            page.fill("#token", "a-guessed-token-0000000")
            page.click("#login button[type=submit]")
            assert "does not open the dashboard" in page.inner_text("#login-error")
            response = stranger.request.post(base + "/actions/dlq-requeue", form=form)
            assert response.status == 401

        with chromium(tmp_path / "operator") as browser:
            page = browser.new_page()
            sign_in(page, base, "mallory")
            page.goto(base + "/dlq")
            row = page.locator(f'#dead-lettered-runs tr[data-run-id="{run_id}"]')
            row.wait_for()
            page.evaluate("document.querySelectorAll('input[name=csrf_token]').forEach(e => e.remove())")
            row.locator('button[data-action="dlq-requeue"]').click()
            page.wait_for_selector("#error-message")
            assert "CSRF" in page.inner_text("#error-message") and "Refused" in page.inner_text("h1")
            screenshot(page, "refused")
            forged = browser.request.post(
                base + "/actions/dlq-requeue", form={**form, "csrf_token": "forged"}
            )
            assert forged.status == 403
            no_csrf = browser.request.post(base + "/actions/dlq-requeue", form=form)
            assert no_csrf.status == 403
    finally:
        dashboard.terminate()
    assert status_of(engine, run_id) == "failed"
    assert [row.status for row in trail(engine, run_id)][-1] == "failed"
    assert len(support.receive_all(sqs, queues["critical-dlq"], expect=1, timeout=10)) == 1
    assert dashboard.process.returncode == 0


def test_the_dashboard_command_refuses_to_serve_open_or_anonymous_actions(
    settings: OutboxSettings, sqs_endpoint: str
) -> None:
    env = service_env(settings, sqs_endpoint)
    for extra, message in (
        ({"SQLA_OUTBOX_DASHBOARD_HOST": "0.0.0.0"}, "without authentication"),
        ({"SQLA_OUTBOX_DASHBOARD_ACTIONS": "true"}, "actions need an authenticated operator"),
        ({"SQLA_OUTBOX_DASHBOARD_TOKEN": "short"}, "SQLA_OUTBOX_DASHBOARD_TOKEN: must be at least 16"),
    ):
        result = subprocess.run(
            [sys.executable, "-m", "sqla_outbox", "dashboard"],
            env={**env, **extra},
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert result.returncode == 2, result.stderr
        assert message in result.stderr and result.stderr.startswith("error: ")
    started = time.monotonic()
    dashboard, base = start_dashboard(settings, sqs_endpoint)
    try:
        assert (
            "dashboard on http://127.0.0.1:" in dashboard.output()
            and "(actions enabled; authentication: operators' tokens and token)" in dashboard.output()
        )
        assert httpx.get(base + "/", timeout=10).status_code == 303
        # on loopback it answers the loopback names only: a rebound name is refused
        rebound = httpx.get(
            base + "/login", headers={"Host": f"rebind.example:{base.rsplit(':', 1)[1]}"}, timeout=10
        )
        assert rebound.status_code == 400
        assert (
            httpx.get(base + "/", headers={"Authorization": f"Bearer {TOKEN}"}, timeout=10).status_code == 200
        )
    finally:
        assert dashboard.terminate() == 0
    assert time.monotonic() - started < 60
