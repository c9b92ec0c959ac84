"""The dashboard over HTTP (uvicorn) against real PostgreSQL, Redis and moto SQS.

Failed runs come from the worker's own permanent path (``fail_into_dlq``); pages are read
as a browser reads them (HTML over HTTP), and actions change real rows and messages. The
browser-driven flows (live refresh, clicking through) are in
``tests/e2e/test_dashboard_browser.py``.
"""

from __future__ import annotations

import base64
import contextlib
import datetime as dt
import hashlib
import html
import json
import re
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest
import sqlalchemy as sa
from sqlalchemy.orm import Session, sessionmaker

from sqla_outbox import Dispatch, Group
from sqla_outbox.catalog import Catalog
from sqla_outbox.config import OutboxSettings
from sqla_outbox.dashboard import create_app, queries
from sqla_outbox.relay import Relay
from sqla_outbox.relay.schedule import Scheduler, latest_slot, next_slot, slot_run_id
from tests.integration.test_ops import fail_into_dlq, outbox_row
from tests.support import csrf_token, outbox_rows, receive_all, serve_asgi, status_of, trail

TOKEN = "t0ken-for-the-dashboard-tests"
SECRET = "s3cr3t-card-4242"
ALICE, BOB, VIC = "alice-own-token-0123456789", "bob-own-token-0123456789", "vic-own-token-0123456789"


def sha256(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


USERS = (
    f"alice:operator:sha256={sha256(ALICE)}",
    f"bob:operator:sha256={sha256(BOB)}",
    f"vic:viewer:sha256={sha256(VIC)}",
)
"""Three operators with their own tokens: alice and bob act, vic only reads."""


@pytest.fixture
def ops_settings(settings: OutboxSettings, sqs_endpoint: str, queues: dict[str, str]) -> OutboxSettings:
    return settings.replace(sqs_endpoint_url=sqs_endpoint)


@pytest.fixture
def serve(ops_settings: OutboxSettings) -> Iterator[Callable[..., Any]]:
    """``serve(**setting_changes, **create_app_kwargs)`` → a context manager yielding an
    httpx client on a running dashboard."""
    apps: list[Any] = []

    @contextlib.contextmanager
    def start(app_kwargs: dict[str, Any] | None = None, **changes: Any) -> Iterator[httpx.Client]:
        app = create_app(ops_settings.replace(**changes), **(app_kwargs or {}))
        apps.append(app)
        with serve_asgi(app) as base, httpx.Client(base_url=base, timeout=30) as client:
            yield client

    yield start
    for app in apps:
        app.state.dashboard.close()


def dispatch(app: sessionmaker[Session], task: str, payload: dict[str, Any], **options: Any) -> uuid.UUID:
    with app() as session, session.begin():
        item = Dispatch(task, payload, **options)
        session.add(item)
    assert item.resolved_run_id is not None
    return item.resolved_run_id


def execute(engine: sa.Engine, sql: str, **params: Any) -> None:
    with engine.begin() as conn:
        conn.execute(sa.text(sql), params)


def failed_runs(
    app: sessionmaker[Session], engine: sa.Engine, sqs: Any, settings: OutboxSettings, n: int = 1
) -> list[uuid.UUID]:
    """``n`` charge_card runs (critical queue) failed the worker's way, in the DLQ."""
    run_ids = [dispatch(app, "charge_card", {"card": SECRET}, tenant_id=3) for _ in range(n)]
    relay = Relay(settings, engine=engine)
    relay.run_once()
    relay.sender.close()
    fail_into_dlq(engine, sqs, settings, "critical", set(run_ids))
    return run_ids


def cells(page: str, row_attribute: str) -> dict[str, str]:
    """``{attribute value: the row's text}`` for rows carrying ``row_attribute``."""
    rows = re.findall(rf'<tr {row_attribute}="([^"]*)"[^>]*>(.*?)</tr>', page, re.S)
    return {key: re.sub(r"\s+", " ", re.sub(r"<[^>]+>", " ", body)).strip() for key, body in rows}


def logged_fields(record: Any) -> dict[str, Any]:
    """The structured fields of a log record (``log_extra``)."""
    from sqla_outbox import logging as outbox_logging

    return dict(getattr(record, outbox_logging._EXTRA_KEY, {}) or {})


def logged_in(client: httpx.Client, token: str = ALICE) -> str:
    """Sign in through the login page with ``token``; return the session's CSRF token."""
    login = client.get("/login")
    response = client.post(
        "/login", data={"csrf_token": csrf_token(login.text), "token": token, "next": "/dlq"}
    )
    assert response.status_code == 303 and response.headers["location"] == "/dlq"
    return csrf_token(client.get("/runs").text)


# --- pages ---------------------------------------------------------------------------------


def test_a_waiting_runs_page_says_why_it_waits_and_offers_no_pause_for_a_paused_task(
    app: sessionmaker[Session], engine: sa.Engine, serve: Callable[..., Any]
) -> None:
    """A queued run's page never said why it waited, and offered "Pause…" for a task that
    was already paused."""
    from sqla_outbox import flow, presence

    paused_run = dispatch(app, "audit", {})
    free_run = dispatch(app, "charge_card", {}, tenant_id=3)
    sent = dispatch(app, "charge_card", {}, tenant_id=3)
    with engine.begin() as conn:
        flow.pause(conn, task="audit", by="test", reason="incident")
        presence.register(conn, worker_id="w:1", tasks=["audit"], queues=["default"])
    with serve(dashboard_users=USERS, dashboard_actions=True) as client:
        logged_in(client, ALICE)
        held = client.get(f"/runs/{paused_run}").text
        free = client.get(f"/runs/{free_run}").text
    assert 'id="why-waiting"' in held and "paused: task audit" in held
    assert 'data-action="flow-pause"' not in held and 'data-action="runs-cancel"' in held
    assert "no live worker implements charge_card on the critical queue" in free
    assert "rate limit" not in free  # no tenant limit in force
    execute(engine, "UPDATE outbox_messages SET sent_at = clock_timestamp() WHERE run_id = :r", r=sent)
    with serve(tenant_rate_limit_per_minute=1) as client:
        limited = client.get(f"/runs/{free_run}").text
    assert "tenant 3&#39;s rate limit is used up: 1 of 1 sent in the last minute" in limited
    assert "paused" not in re.sub(r"<[^>]+>", "", free.split('id="why-waiting"')[1].split("</div>")[0])
    assert 'data-action="flow-pause"' in free


def test_runs_are_found_by_their_id_or_its_first_digits(
    app: sessionmaker[Session], engine: sa.Engine, serve: Callable[..., Any]
) -> None:
    """Search by run id: a whole id opens the run's page; its first hex digits list the runs
    that start with them (a range of the primary key); anything else is refused."""
    run_ids = [dispatch(app, "audit", {"n": n}) for n in range(8)]
    target = run_ids[3]
    prefix = str(target)[:6]
    with serve() as client:
        whole = client.get("/runs", params={"run": str(target)}, follow_redirects=False)
        upper = client.get("/runs", params={"run": str(target).upper()}, follow_redirects=False)
        started = client.get("/runs", params={"run": prefix}).text
        nothing = client.get("/runs", params={"run": "ffffffffffff"}).text
        bad = client.get("/runs", params={"run": "not-hex"})
    assert whole.status_code == 303 and whole.headers["location"] == f"/runs/{target}"
    assert upper.status_code == 303
    listed = set(cells(started, "data-run-id"))
    assert str(target) in listed and all(r.startswith(prefix) for r in listed)
    assert listed == {str(r) for r in run_ids if str(r).startswith(prefix)}
    assert cells(nothing, "data-run-id") == {} and "No run matches." in nothing  # 2^-48 odds otherwise
    assert bad.status_code == 400 and "run: &#39;not-hex&#39; is not the start of a run id" in bad.text
    # the task filters suggest the catalog's task names as one types (a datalist)
    suggested = re.findall(
        r'<option value="([^"]+)">', started.split('<datalist id="task-names">')[1].split("</datalist>")[0]
    )
    assert {"audit", "charge_card", "send_welcome"} <= set(suggested) and 'list="task-names"' in started


def test_the_liveness_page_shows_relays_workers_and_what_holds_work(
    app: sessionmaker[Session],
    engine: sa.Engine,
    queues: dict[str, str],
    serve: Callable[..., Any],
) -> None:
    """No page showed relays and workers, runs waiting for a worker that implements their
    task, stale ``running`` runs, or SQS and DLQ depths; ``status`` knew all of it."""
    from sqla_outbox import presence

    waiting = dispatch(app, "charge_card", {}, tenant_id=3)
    stale = dispatch(app, "audit", {})
    execute(
        engine,
        "UPDATE task_runs SET status = 'running', attempts = 1, lease_owner = 'w:gone', "
        "lease_expires_at = clock_timestamp() - interval '1 hour' WHERE run_id = :r",
        r=stale,
    )
    with engine.begin() as conn:
        presence.register(conn, worker_id="w:7", tasks=["audit"], queues=["default", "maintenance"])
    with app() as session, session.begin():
        group = Group(
            [Dispatch("audit", {"n": 1}), Dispatch("audit", {"n": 2})], on_complete=Dispatch("audit", {})
        )
        session.add(group)
    with serve() as client:
        page = client.get("/liveness").text
    [in_progress] = cells(page, "data-group").values()
    assert "0 of 2" in in_progress and "audit" in in_progress
    assert 'id="no-relay"' in page  # nothing holds the relay's lock in this test
    workers = cells(page, "data-worker")
    assert set(workers) == {"w:7"} and "default, maintenance" in workers["w:7"]
    assert 'data-waiting-task="charge_card"' in page and "charge_card on critical: 1 waiting" in page
    assert 'id="stale-count">1<' in page and str(stale) in page
    depths = cells(page, "data-queue-depth")
    assert {"critical", "critical-dlq", "default", "default-dlq"} <= set(depths)
    assert waiting  # dispatched: its row is what waits


def test_the_overview_lists_a_paused_tenant_among_the_most_behind(
    app: sessionmaker[Session], engine: sa.Engine, serve: Callable[..., Any]
) -> None:
    """A paused tenant's rows are held (``available_at`` pushed forward), so none is due and
    it ranked below every tenant with due work: with 21 tenants due, a paused tenant whose
    oldest row waited 48 minutes was not listed at all. It is listed, marked paused."""
    from sqla_outbox import flow
    from sqla_outbox.dashboard.queries import TENANTS_SHOWN

    execute(engine, "INSERT INTO tenants SELECT g, 'tenant ' || g FROM generate_series(100, 140) AS g")
    for tenant in range(100, 100 + TENANTS_SHOWN + 1):
        dispatch(app, "charge_card", {}, tenant_id=tenant)
    held = [dispatch(app, "charge_card", {}, tenant_id=140) for _ in range(3)]
    with engine.begin() as conn:
        flow.pause(conn, tenant_id=140, by="test", reason="incident")
    execute(
        engine,
        "UPDATE outbox_messages SET created_at = clock_timestamp() - interval '48 minutes', "
        "available_at = clock_timestamp() + interval '1 minute' WHERE run_id = ANY(:runs)",
        runs=held,
    )
    with serve() as client:
        page = client.get("/").text
    tenants = cells(page, "data-tenant")
    assert len(tenants) == TENANTS_SHOWN + 1
    assert tenants["140"].startswith("140 paused 3 0 48m")
    assert 'data-tenant="140" data-paused="yes"' in page and "and the paused ones" in page


def test_overview_shows_pending_rows_by_queue_and_tenant_runs_by_status_and_the_last_hour(
    app: sessionmaker[Session], engine: sa.Engine, serve: Callable[..., Any]
) -> None:
    for tenant in (2, 2, 5):
        dispatch(app, "charge_card", {}, tenant_id=tenant)
    dispatch(app, "rebuild_cache", {})
    done, failed = (
        dispatch(app, "send_welcome", {}, tenant_id=7),
        dispatch(app, "send_welcome", {}, tenant_id=7),
    )
    execute(
        engine,
        "UPDATE outbox_messages SET sent_at = clock_timestamp() WHERE run_id IN (:a, :b)",
        a=done,
        b=failed,
    )
    execute(
        engine,
        "UPDATE task_runs SET status = CASE WHEN run_id = :a THEN 'succeeded' ELSE 'failed' END, "
        "finished_at = created_at + interval '250 milliseconds' WHERE run_id IN (:a, :b)",
        a=done,
        b=failed,
    )

    with serve() as client:
        page = client.get("/").text
        live = client.get("/overview/live")
        charts = client.get("/overview/charts")
        again = client.get("/overview/charts")

    assert live.status_code == 200 and live.text.lstrip().startswith('<div id="live"')
    assert 'hx-get="/overview/charts" hx-trigger="load"' in page and 'hx-preserve="true"' in page
    assert charts.status_code == 200 and charts.text.lstrip().startswith('<div id="charts"')
    by_queue = cells(page, "data-queue")
    assert set(by_queue) == {"critical", "maintenance"}
    assert by_queue["critical"].startswith("outbox_messages critical 3 3 ")
    assert by_queue["maintenance"].startswith("platform_outbox_messages maintenance 1 1 ")
    tenants = cells(page, "data-tenant")
    assert set(tenants) == {"2", "5"} and tenants["2"].startswith("2 2 2 ")
    counts = dict(re.findall(r'data-status-count="(\w+)" data-count="(\d+)"', page))
    assert counts == {
        "queued": "4",
        "running": "0",
        "retrying": "0",
        "succeeded": "1",
        "failed": "1",
        "cancelled": "0",
    }
    assert 'id="pending-total" data-count="4"' in page
    minute = re.search(r'<tr data-minute="[^"]+">(.*?)</tr>', charts.text, re.S)
    assert minute is not None
    assert re.findall(r'data-(dispatched|finished|failed)="(\d+)"', minute.group(1)) == [
        ("dispatched", "6"),
        ("finished", "2"),
        ("failed", "1"),
    ]
    assert "0.250 s" in minute.group(1)  # p50 of the one succeeded run's commit → finish
    assert charts.text.count("<polyline") >= 3 and again.text.count("<polyline") >= 3


def test_status_counts_switch_to_the_planner_estimate_above_the_cap(
    app: sessionmaker[Session], engine: sa.Engine
) -> None:
    for _ in range(5):
        dispatch(app, "send_welcome", {})
    execute(engine, "ANALYZE task_runs")
    with engine.connect() as conn:
        capped = {c.status: c for c in queries.status_counts(conn, cap=3)}
        exact = {c.status: c for c in queries.status_counts(conn)}
    assert capped["queued"].estimated and capped["queued"].count == 5  # ANALYZE saw all 5 rows
    assert not capped["failed"].estimated and capped["failed"].count == 0
    assert not exact["queued"].estimated and exact["queued"].count == 5


def test_runs_list_filters_and_keyset_pages_reach_every_run_once(
    app: sessionmaker[Session], engine: sa.Engine, serve: Callable[..., Any]
) -> None:
    with app() as session, session.begin():
        for i in range(57):
            session.add(Dispatch("send_welcome", {"i": i}, tenant_id=4 if i % 3 else 9))
        session.add(Dispatch("audit", {}, tenant_id=9))
    everything = [
        str(r.run_id)
        for r in engine.connect().execute(
            sa.text("SELECT run_id FROM task_runs ORDER BY created_at DESC, run_id DESC")
        )
    ]

    def ids(page: str) -> list[str]:
        return re.findall(r'<tr data-run-id="([^"]+)"', page)

    def link(page: str, name: str) -> str | None:
        found = re.search(rf'id="{name}" href="([^"]+)"', page)
        return html.unescape(found.group(1)) if found else None

    with serve() as client:
        first = client.get("/runs").text
        older = link(first, "older")
        assert ids(first) == everything[:50] and link(first, "newer") is None and older
        second = client.get(older).text
        assert ids(second) == everything[50:] and link(second, "older") is None
        # the first page refreshes itself (htmx, the overview's interval); a later page stays put
        assert 'id="runs" hx-get="/runs" hx-select="#runs"' in first and 'id="runs" hx-get' not in second
        newer = link(second, "newer")
        assert newer and ids(client.get(newer).text) == everything[:50]
        # oldest first: the same runs the other way round, paged the same way
        oldest = client.get("/runs", params={"sort": "oldest"}).text
        assert ids(oldest) == everything[::-1][:50] and link(oldest, "newer") is None
        rest = client.get(link(oldest, "older") or "").text
        assert ids(rest) == everything[::-1][50:] and link(rest, "older") is None
        back = client.get(link(rest, "newer") or "").text
        assert ids(back) == everything[::-1][:50]
        assert client.get("/runs", params={"sort": "sideways"}).status_code == 400

        tenant_9 = client.get("/runs", params={"tenant": "9"}).text
        assert len(ids(tenant_9)) == 20  # i = 0, 3, ..., 54, and the audit run
        assert set(ids(client.get("/runs", params={"task": "audit"}).text)) == {everything[0]}
        since = (dt.datetime.now(dt.UTC) + dt.timedelta(hours=1)).strftime("%Y-%m-%dT%H:%M")
        assert ids(client.get("/runs", params={"since": since}).text) == []
        assert len(ids(client.get("/runs", params={"status": "queued", "queue": "default"}).text)) == 50
        bad = client.get("/runs", params={"tenant": "nine", "status": "done"})
    assert (
        bad.status_code == 400
        and "tenant: &#39;nine&#39; is neither a tenant id nor &#39;platform&#39;" in bad.text
    )


BAD_REQUESTS = (
    ("GET", "/runs", {"tenant": "abc"}, 400, "tenant: &#39;abc&#39; is neither a tenant id"),
    ("GET", "/runs", {"since": "yesterday"}, 400, "since: &#39;yesterday&#39; is not a date and time"),
    ("GET", "/runs", {"status": "done"}, 400, "status: &#39;done&#39; is not one of"),
    ("GET", "/runs", {"queue": "nowhere"}, 400, "queue: &#39;nowhere&#39; is not one of"),
    ("GET", "/runs", {"before": "not-a-cursor"}, 400, "before: not a position in the run list"),
    ("GET", "/runs", {"task": "x" * 300}, 400, "task: at most"),
    ("GET", "/dlq", {"older_than": "soon"}, 400, "is not a duration"),
    (
        "GET",
        "/dlq",
        {"older_than": "99999999w"},
        400,
        "is not a duration",
    ),  # answered 503 (a timestamp overflow)
    ("GET", "/dlq", {"queue": "nowhere"}, 400, "queue: &#39;nowhere&#39; is not one of"),
    ("GET", "/runs/not-a-run-id", {}, 404, "no such run"),
    ("GET", f"/runs/{uuid.UUID(int=7)}", {}, 404, f"no run {uuid.UUID(int=7)}"),
    ("GET", "/no-such-page", {}, 404, "Not Found"),
    ("GET", "/logout", {}, 405, "Method Not Allowed"),
)
"""Every page's refused input: (method, path, query, status, what the page says)."""


@pytest.mark.parametrize("mode", ["read-only", "actions"])
@pytest.mark.parametrize(("method", "path", "params", "status", "says"), BAD_REQUESTS)
def test_every_pages_error_path_renders_in_both_modes(
    serve: Callable[..., Any],
    mode: str,
    method: str,
    path: str,
    params: dict[str, str],
    status: int,
    says: str,
) -> None:
    """A refused filter or an unknown page answers its own status with the whole page
    (navigation, the message), never a bare 500, whether actions are enabled or not: with
    actions enabled an invalid Runs filter once answered 500 (an undefined template name)."""
    changes = {"dashboard_token": TOKEN, "dashboard_actions": True} if mode == "actions" else {}
    headers = {"Authorization": f"Bearer {TOKEN}"} if mode == "actions" else {}
    with serve(**changes) as client:
        answer = client.request(method, path, params=params, headers=headers)
    assert answer.status_code == status, answer.text[:500]
    assert says in answer.text
    assert 'href="/runs"' in answer.text  # the navigation: a whole page, not a bare error
    if mode == "actions" and path == "/runs":
        assert 'data-action="runs-cancel"' not in answer.text  # nothing offered on refused filters


def test_an_unknown_action_answers_404_as_a_page_with_actions_enabled(serve: Callable[..., Any]) -> None:
    bearer = {"Authorization": f"Bearer {TOKEN}"}
    with serve(dashboard_token=TOKEN, dashboard_actions=True) as client:
        preview = client.post("/actions/no-such-action/preview", data={}, headers=bearer)
        perform = client.post("/actions/no-such-action", data={"confirmed": "yes"}, headers=bearer)
    for answer in (preview, perform):
        assert answer.status_code == 404 and "no such action" in answer.text
        assert 'href="/runs"' in answer.text


def test_run_page_shows_the_envelope_attempts_and_trail_and_hides_the_payload(
    app: sessionmaker[Session],
    engine: sa.Engine,
    sqs: Any,
    ops_settings: OutboxSettings,
    serve: Callable[..., Any],
) -> None:
    [run_id] = failed_runs(app, engine, sqs, ops_settings)
    with serve() as client:
        page = client.get(f"/runs/{run_id}").text
        missing = client.get(f"/runs/{uuid.uuid4()}")
        garbage = client.get("/runs/not-a-run")
    assert SECRET not in page and 'id="payload-hidden"' in page
    assert f'<td class="mono">{run_id}</td>' in page  # envelope run_id
    assert "charge_card" in page and "order 7 has no lines" in page and "ValueError" in page
    assert re.findall(r'data-trail-status="(\w+)"', page) == ["running", "failed", "failed"]
    assert re.findall(r'<tr data-attempt="(\d+)"', page) == ["1"]
    assert 'id="result-none"' in page and "No result recorded." in page
    assert missing.status_code == 404 and garbage.status_code == 404

    with serve(dashboard_show_payloads=True, dashboard_users=USERS) as client:
        logged_in(client, ALICE)  # an operator: a viewer never sees payloads
        shown = client.get(f"/runs/{run_id}").text
    assert 'id="payload"' in shown and SECRET in shown


def test_a_succeeded_run_lists_no_error_and_names_its_earlier_one(
    engine: sa.Engine, serve: Callable[..., Any]
) -> None:
    """A run that failed once and then succeeded: the Runs list shows no error for it (it
    read as a failure); its page keeps the error, headed as an earlier attempt's."""
    recovered, broken = uuid.uuid4(), uuid.uuid4()
    for run_id, status in ((recovered, "succeeded"), (broken, "failed")):
        execute(
            engine,
            "INSERT INTO task_runs (run_id, task, queue, status, attempts, available_at, last_error_type, "
            "last_error) VALUES (:r, 'audit', 'default', :s, 2, clock_timestamp(), 'GatewayTimeout', 'slow')",
            r=run_id,
            s=status,
        )
    with serve() as client:
        listed = client.get("/runs").text
        recovered_page = client.get(f"/runs/{recovered}").text
        broken_page = client.get(f"/runs/{broken}").text
    rows = dict(re.findall(r'<tr data-run-id="([0-9a-f-]+)">(.*?)</tr>', listed, re.S))
    assert "GatewayTimeout" not in rows[str(recovered)] and "GatewayTimeout" in rows[str(broken)]
    assert "<h2>An earlier attempt's error</h2>" in recovered_page and "GatewayTimeout" in recovered_page
    assert "<h2>Last error</h2>" in broken_page


def test_untrusted_text_is_escaped_and_its_invisible_characters_shown(
    engine: sa.Engine, sqs: Any, queues: dict[str, str], serve: Callable[..., Any]
) -> None:
    run_id = uuid.uuid4()
    hostile_task = "<script>alert(1)</script>"
    hostile_error = "<img src=x onerror=alert(2)> \x1b[31mred\u202eevil"
    execute(
        engine,
        "INSERT INTO task_runs (run_id, task, queue, tenant_id, status, available_at, last_error_type, "
        "last_error) VALUES (:r, :t, 'default', 3, 'failed', clock_timestamp(), '<b>Err</b>', :e)",
        r=run_id,
        t=hostile_task,
        e=hostile_error,
    )
    execute(
        engine,
        "INSERT INTO task_run_trail (run_id, status, worker_id, error_message, detail) "
        "VALUES (:r, 'failed', '<i>w</i>', :e, CAST(:d AS jsonb))",
        r=run_id,
        e=hostile_error,
        d=json.dumps({"note": "</pre><script>alert(3)</script>"}),
    )
    sqs.send_message(
        QueueUrl=queues["default-dlq"],
        MessageBody="{}",
        MessageAttributes={
            "run_id": {"DataType": "String", "StringValue": str(run_id)},
            "task": {"DataType": "String", "StringValue": "<svg onload=alert(4)>"},
            "reason": {"DataType": "String", "StringValue": "<b>permanent</b>"},
        },
    )
    with serve() as client:
        pages = [
            client.get("/runs").text,
            client.get(f"/runs/{run_id}").text,
            client.get("/dlq", params={"messages": "yes"}).text,
            client.get("/runs", params={"task": hostile_task}).text,
        ]
    for page in pages:
        assert "<script>alert" not in page and "<img src=x" not in page and "<svg onload" not in page
        assert "<b>" not in page and "<i>w" not in page
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in pages[0]
    assert "&lt;img src=x onerror=alert(2)&gt; \\x1b[31mred\\u202eevil" in pages[1]
    assert "&lt;/pre&gt;&lt;script&gt;alert(3)" in pages[1]
    assert "&lt;svg onload=alert(4)&gt;" in pages[2] and "&lt;b&gt;permanent&lt;/b&gt;" in pages[2]


def test_dlq_page_lists_messages_with_reason_and_error_and_leaves_them_in_the_queue(
    app: sessionmaker[Session],
    engine: sa.Engine,
    sqs: Any,
    ops_settings: OutboxSettings,
    queues: dict[str, str],
    serve: Callable[..., Any],
) -> None:
    run_ids = failed_runs(app, engine, sqs, ops_settings, n=2)
    with serve() as client:
        page = client.get("/dlq", params={"messages": "yes"}).text
        filtered = client.get("/dlq", params={"messages": "yes", "queue": "bulk"}).text
        bad = client.get("/dlq", params={"messages": "yes", "older_than": "soon"})
    rows = cells(page, "data-run-id")
    assert set(rows) == {str(r) for r in run_ids}
    for text in rows.values():
        assert "critical" in text and "charge_card" in text and "permanent-error" in text
        assert "ValueError : order 7 has no lines" in text and "failed" in text
    assert SECRET not in page
    assert 'data-action="dlq-requeue"' not in page  # read-only by default
    assert cells(filtered, "data-run-id") == {}
    assert bad.status_code == 400 and "is not a duration" in bad.text
    assert len(receive_all(sqs, queues["critical-dlq"], expect=2, timeout=10)) == 2  # nothing deleted


def test_the_dlq_page_lists_the_ledger_so_two_readers_see_the_same(
    app: sessionmaker[Session],
    engine: sa.Engine,
    sqs: Any,
    ops_settings: OutboxSettings,
    queues: dict[str, str],
    serve: Callable[..., Any],
) -> None:
    """Reading a DLQ receives its messages and hides them from every other reader: two
    people looking at the DLQ saw about half of it each. The page lists the dead-lettered
    runs from the database, grouped by task and error with totals, beside each DLQ's depth
    as SQS counts it, and receives nothing; the messages view still shows only what it
    could receive."""
    run_ids = failed_runs(app, engine, sqs, ops_settings, n=4)
    held = sqs.receive_message(QueueUrl=queues["critical-dlq"], MaxNumberOfMessages=2, VisibilityTimeout=600)
    assert len(held["Messages"]) == 2  # a colleague's read, holding half of them
    sqs.send_message(QueueUrl=queues["critical-dlq"], MessageBody="{}")  # no worker verdict
    with serve(dashboard_users=USERS, dashboard_actions=True) as client:
        logged_in(client, ALICE)
        first, second = client.get("/dlq").text, client.get("/dlq").text
        by_task = client.get("/dlq", params={"task": "audit"}).text
        messages = client.get("/dlq", params={"messages": "yes"}).text
    for page in (first, second):
        assert set(cells(page, "data-run-id")) == {str(r) for r in run_ids}
        assert 'id="ledger-total">4 dead-lettered runs<' in page
        [group] = cells(page, "data-task").values()
        assert group.split()[:5] == ["critical", "charge_card", "permanent-error", "ValueError", "4"]
        depth = cells(page, "data-queue")["critical"]
        assert depth.startswith("critical 5 4 1 message no worker verdict explains")
        assert 'data-action="dlq-requeue"' in page and 'id="requeue-matching"' in page
        assert SECRET not in page
    assert cells(by_task, "data-run-id") == {} and "No dead-lettered run matches." in by_task
    assert len([k for k in cells(messages, "data-run-id") if k in {str(r) for r in run_ids}]) == 2
    # the ledger's pages received nothing: the messages the colleague does not hold are all visible
    visible = receive_all(sqs, queues["critical-dlq"], expect=3, timeout=10)
    assert len(visible) == 3


def test_schedules_page_shows_each_schedules_latest_and_next_slot(
    engine: sa.Engine, tmp_path: Any, serve: Callable[..., Any]
) -> None:
    schedule = {"every_seconds": 3600}
    catalog = Catalog.from_dict(
        {
            "version": 1,
            "tasks": {
                "hourly_report": {"queue": "maintenance", "scope": "platform", "schedule": schedule},
                "nightly": {"queue": "bulk", "scope": "platform", "schedule": {"cron": "17 3 * * *"}},
                "plain": {"queue": "default"},
            },
            "events": {},
        }
    )
    path = tmp_path / "scheduled.json"
    path.write_text(catalog.to_json())
    with engine.connect() as conn:
        Scheduler(catalog).tick(conn)
        now = queries.database_now(conn)
    slot = latest_slot(schedule, now)
    with serve(catalog_path=str(path)) as client:
        page = client.get("/schedules").text
    rows = cells(page, "data-task")
    assert set(rows) == {"hourly_report", "nightly"}
    assert slot.strftime("%Y-%m-%d %H:%M:%SZ") in rows["hourly_report"]
    assert next_slot(schedule, now).strftime("%Y-%m-%d %H:%M:%SZ") in rows["hourly_report"]
    assert (
        str(slot_run_id("hourly_report", slot))[:8] in rows["hourly_report"]
        and "queued" in rows["hourly_report"]
    )
    assert 'data-slot-status="queued"' in page and "every 3600 s" in page and "cron 17 3 * * *" in page
    # no server path shown to viewers: the catalog's file name only, also in its error
    assert str(tmp_path) not in page and '<span class="mono" id="catalog-name">scheduled.json</span>' in page
    path.write_text("{not json")
    with serve(catalog_path=str(path)) as client:
        broken = client.get("/schedules").text
    assert "The catalog cannot be read" in broken and str(tmp_path) not in broken


def test_database_errors_are_one_line_with_the_password_masked(
    ops_settings: OutboxSettings, pg_url: str, serve: Callable[..., Any]
) -> None:
    empty = f"t_empty_{uuid.uuid4().hex[:8]}"
    from tests import support

    support.create_database(pg_url, empty)
    try:
        url = support.database_url(pg_url, empty).replace("postgres@", "postgres:hunter2@")
        with serve(database_url=url) as client:
            unmigrated = client.get("/runs")
        with serve(database_url=url.replace(empty, empty + "_gone")) as client:
            gone = client.get("/")
    finally:
        support.drop_database(pg_url, empty)
    assert unmigrated.status_code == 503 and "python -m sqla_outbox migrate" in unmigrated.text
    assert gone.status_code == 503 and "cannot read the outbox database" in gone.text
    assert "hunter2" not in unmigrated.text + gone.text


# --- authentication ------------------------------------------------------------------------


def test_the_token_opens_the_login_page_session_and_bearer_requests(serve: Callable[..., Any]) -> None:
    with serve(dashboard_token=TOKEN) as client:
        redirect = client.get("/runs?status=failed")
        assert redirect.status_code == 303
        assert redirect.headers["location"] == "/login?next=%2Fruns%3Fstatus%3Dfailed"
        assert client.get("/overview/live", headers={"HX-Request": "true"}).status_code == 401
        assert client.get("/", headers={"Authorization": f"Bearer {TOKEN}"}).status_code == 200
        # a script's wrong token is refused, not sent to a login page it cannot use
        assert client.get("/", headers={"Authorization": "Bearer wrong-token-wrong-token"}).status_code == 401

        login = client.get("/login")
        wrong = client.post("/login", data={"csrf_token": csrf_token(login.text), "token": "nope"})
        assert wrong.status_code == 401 and "does not open the dashboard" in wrong.text
        no_csrf = client.post("/login", data={"token": TOKEN})
        assert no_csrf.status_code == 403
        evil = client.post(
            "/login",
            data={"csrf_token": csrf_token(login.text), "token": TOKEN, "next": "//evil.example/"},
        )
        assert evil.status_code == 303 and evil.headers["location"] == "/"
        page = client.get("/").text
        assert 'data-method="token" data-role="operator">token' in page  # the token names itself
        client.post("/logout", data={"csrf_token": csrf_token(page)})
        assert client.get("/").status_code == 303


def test_basic_auth_asks_the_browser_and_names_the_operator(serve: Callable[..., Any]) -> None:
    def basic(user: str, password: str) -> dict[str, str]:
        return {"Authorization": "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()}

    with serve(dashboard_basic_auth="ops:correct-horse-battery") as client:
        challenge = client.get("/")
        assert challenge.status_code == 401
        assert challenge.headers["www-authenticate"] == 'Basic realm="sqla_outbox dashboard"'
        assert client.get("/", headers=basic("ops", "wrong-password!")).status_code == 401
        page = client.get("/", headers=basic("ops", "correct-horse-battery"))
    assert page.status_code == 200 and 'data-method="basic" data-role="operator">ops' in page.text
    assert page.headers["content-security-policy"].startswith("default-src 'self'")
    assert page.headers["x-frame-options"] == "DENY"
    cookie = page.headers["set-cookie"].lower()
    assert "httponly" in cookie and "samesite=strict" in cookie


# --- actions -------------------------------------------------------------------------------


def test_requeue_from_the_dashboard_confirms_then_requeues_and_records_the_operator(
    app: sessionmaker[Session],
    engine: sa.Engine,
    sqs: Any,
    ops_settings: OutboxSettings,
    queues: dict[str, str],
    serve: Callable[..., Any],
    caplog: pytest.LogCaptureFixture,
) -> None:
    run_id, other = failed_runs(app, engine, sqs, ops_settings, n=2)
    with serve(dashboard_users=USERS, dashboard_actions=True) as client:
        csrf = logged_in(client, ALICE)
        dlq_page = client.get("/dlq", params={"messages": "yes"}).text
        assert dlq_page.count('data-action="dlq-requeue"') == 3  # one per row, and "matching these filters"

        preview = client.post(
            "/actions/dlq-requeue/preview", data={"csrf_token": csrf, "run_id": str(run_id)}
        )
        assert preview.status_code == 200 and "would requeue 1, skipped 0" in preview.text
        assert status_of(engine, run_id) == "failed" and outbox_row(engine, run_id).sent_at is not None

        with caplog.at_level("INFO", logger="sqla_outbox.dashboard.app"):
            done = client.post(
                "/actions/dlq-requeue", data={"csrf_token": csrf, "run_id": str(run_id), "confirmed": "yes"}
            )
    assert done.status_code == 200 and "requeued 1, skipped 0 (relay woken)" in done.text
    assert status_of(engine, run_id) == "queued" and outbox_row(engine, run_id).sent_at is None
    last = trail(engine, run_id)[-1]
    assert (last.status, last.worker_id) == ("queued", "dashboard:alice")
    assert last.detail["requeued_by"] == "operator" and last.detail["source"] == "dlq"
    assert status_of(engine, other) == "failed"
    left = receive_all(sqs, queues["critical-dlq"], expect=1, timeout=10)
    assert [m["MessageAttributes"]["run_id"]["StringValue"] for m in left] == [str(other)]
    [entry] = [f for f in (logged_fields(r) for r in caplog.records) if f.get("action") == "dashboard.action"]
    assert (entry["name"], entry["operator"], entry["changed"]) == ("dlq-requeue", "dashboard:alice", 1)
    assert json.loads(entry["fields"]) == {"run_id": [str(run_id)]}


def test_requeue_keeps_the_clis_guardrails(
    app: sessionmaker[Session],
    engine: sa.Engine,
    sqs: Any,
    ops_settings: OutboxSettings,
    serve: Callable[..., Any],
) -> None:
    [failed] = failed_runs(app, engine, sqs, ops_settings)
    queued = dispatch(app, "send_welcome", {})
    with serve(dashboard_users=USERS, dashboard_actions=True) as client:
        csrf = logged_in(client)
        nothing = client.post("/actions/dlq-requeue/preview", data={"csrf_token": csrf})
        bad = client.post("/actions/dlq-requeue/preview", data={"csrf_token": csrf, "queue": "urgent"})
        unconfirmed = client.post("/actions/dlq-requeue", data={"csrf_token": csrf, "run_id": str(failed)})
        not_failed = client.post(
            "/actions/dlq-requeue", data={"csrf_token": csrf, "run_id": str(queued), "confirmed": "yes"}
        )
        unknown = client.post("/actions/pause-everything/preview", data={"csrf_token": csrf})
    assert nothing.status_code == 400 and "choose the runs" in nothing.text
    assert bad.status_code == 400 and "unknown queue" in bad.text
    assert unconfirmed.status_code == 400 and "confirm the action" in unconfirmed.text
    assert not_failed.status_code == 200 and "requeued 0, skipped 1" in not_failed.text
    assert "not-failed: run is queued with a live copy" in not_failed.text  # its row is pending
    assert unknown.status_code == 404
    assert status_of(engine, failed) == "failed" and status_of(engine, queued) == "queued"


def test_actions_are_refused_without_the_token_the_csrf_token_or_when_disabled(
    app: sessionmaker[Session],
    engine: sa.Engine,
    sqs: Any,
    ops_settings: OutboxSettings,
    queues: dict[str, str],
    serve: Callable[..., Any],
) -> None:
    [run_id] = failed_runs(app, engine, sqs, ops_settings)
    form = {"run_id": str(run_id), "confirmed": "yes"}
    bearer = {"Authorization": f"Bearer {TOKEN}"}
    with serve(dashboard_token=TOKEN, dashboard_actions=True) as client:
        assert client.post("/actions/dlq-requeue", data=form).status_code == 401  # no token
        wrong_token = client.post(
            "/actions/dlq-requeue", data=form, headers={"Authorization": "Bearer wrong-token-wrong"}
        )
        assert wrong_token.status_code == 401
        login = client.get("/login")
        signed_in = client.post("/login", data={"csrf_token": csrf_token(login.text), "token": TOKEN})
        assert signed_in.status_code == 303
        assert client.post("/actions/dlq-requeue", data=form).status_code == 403  # session, no CSRF
        csrf = csrf_token(client.get("/").text)
        wrong = client.post("/actions/dlq-requeue", data={**form, "csrf_token": csrf[::-1]})
        assert wrong.status_code == 403 and "CSRF" in wrong.text
        cross = client.post(
            "/actions/dlq-requeue",
            data={**form, "csrf_token": csrf},
            headers={**bearer, "Sec-Fetch-Site": "cross-site"},
        )
        assert cross.status_code == 403
        assert client.post("/logout", data={"csrf_token": csrf}).status_code == 303
    with serve(dashboard_token=TOKEN) as client:  # actions off
        off = client.post("/actions/dlq-requeue", data=form, headers=bearer)
        assert off.status_code == 403 and "read-only" in off.text
    with serve(dashboard_actions=True) as client:  # no authentication: an anonymous viewer
        anonymous = client.post("/actions/dlq-requeue", data=form)
        assert anonymous.status_code == 403 and "authenticated operator" in anonymous.text
    assert status_of(engine, run_id) == "failed" and outbox_row(engine, run_id).sent_at is not None
    assert len(receive_all(sqs, queues["critical-dlq"], expect=1, timeout=10)) == 1


@pytest.mark.parametrize("action", ["flow-pause", "flow-resume"])
def test_pause_and_resume_are_refused_without_the_token_the_csrf_token_or_when_disabled(
    engine: sa.Engine, serve: Callable[..., Any], action: str
) -> None:
    from sqla_outbox import flow

    if action == "flow-resume":
        with engine.begin() as conn:
            flow.pause(conn, queue="bulk", by="test")
    form = {"scope": "queue", "target": "bulk", "confirmed": "yes"}
    bearer = {"Authorization": f"Bearer {TOKEN}"}
    with serve(dashboard_token=TOKEN, dashboard_actions=True) as client:
        assert client.post(f"/actions/{action}", data=form).status_code == 401  # no token
        wrong_token = client.post(
            f"/actions/{action}", data=form, headers={"Authorization": "Bearer wrong-token-wrong"}
        )
        assert wrong_token.status_code == 401
        login = client.get("/login")
        signed_in = client.post("/login", data={"csrf_token": csrf_token(login.text), "token": TOKEN})
        assert signed_in.status_code == 303
        assert client.post(f"/actions/{action}", data=form).status_code == 403  # session, no CSRF
        csrf = csrf_token(client.get("/").text)
        wrong = client.post(f"/actions/{action}", data={**form, "csrf_token": csrf[::-1]})
        assert wrong.status_code == 403 and "CSRF" in wrong.text
        cross = client.post(
            f"/actions/{action}",
            data={**form, "csrf_token": csrf},
            headers={**bearer, "Sec-Fetch-Site": "cross-site"},
        )
        assert cross.status_code == 403
        unconfirmed = client.post(
            f"/actions/{action}", data={"scope": "queue", "target": "bulk", "csrf_token": csrf}
        )
        assert unconfirmed.status_code == 400 and "confirm the action" in unconfirmed.text
    with serve(dashboard_token=TOKEN) as client:  # actions off
        off = client.post(f"/actions/{action}", data=form, headers=bearer)
        assert off.status_code == 403
    with engine.connect() as conn:
        pauses = [(p.scope, p.target) for p in flow.list_pauses(conn)]
    assert pauses == ([] if action == "flow-pause" else [("queue", "bulk")])  # nothing changed


def test_the_controls_page_shows_pauses_and_throttled_tenants(
    app: sessionmaker[Session], engine: sa.Engine, serve: Callable[..., Any]
) -> None:
    from sqla_outbox import Dispatch, flow

    with engine.begin() as conn:
        flow.pause(conn, task="audit", by="dashboard:alice", reason="<script>x</script>")
        flow.set_tenant(conn, 7, rate_limit_per_minute=1)
    with app() as session, session.begin():
        session.add_all([Dispatch("send_welcome", {}, tenant_id=7) for _ in range(3)])
    with engine.begin() as conn:  # one sent within the minute: the tenant is at its limit
        conn.execute(
            sa.text(
                "UPDATE outbox_messages SET sent_at = clock_timestamp() "
                "WHERE id = (SELECT min(id) FROM outbox_messages)"
            )
        )
    with serve(dashboard_token=TOKEN, dashboard_actions=True) as client:
        page = client.get("/controls", headers={"Authorization": f"Bearer {TOKEN}"}).text
    assert 'data-pause="task:audit"' in page and "dashboard:alice" in page
    assert "<script>x</script>" not in page and "&lt;script&gt;" in page
    assert 'data-tenant="7"' in page


# --- mounted in an application -------------------------------------------------------------


def test_a_script_acts_with_the_bearer_token_alone(
    app: sessionmaker[Session],
    engine: sa.Engine,
    sqs: Any,
    ops_settings: OutboxSettings,
    queues: dict[str, str],
    serve: Callable[..., Any],
) -> None:
    """Trial finding: a script with only ``Authorization: Bearer`` got 403 (no CSRF token)
    and had to keep a cookie jar; the header cannot be forged cross-site, so it suffices."""
    [run_id] = failed_runs(app, engine, sqs, ops_settings)
    with serve(dashboard_users=USERS, dashboard_actions=True) as client:
        client.cookies.clear()
        done = client.post(
            "/actions/dlq-requeue",
            data={"run_id": str(run_id), "confirmed": "yes"},
            # the token names its operator; a typed name is not an identity
            headers={"Authorization": f"Bearer {BOB}", "X-Operator": "mallory"},
        )
        assert done.status_code == 200, done.text
    assert status_of(engine, run_id) == "queued"
    assert trail(engine, run_id)[-1].worker_id == "dashboard:bob"


def test_mounted_in_fastapi_behind_the_applications_own_authentication(
    app: sessionmaker[Session],
    engine: sa.Engine,
    sqs: Any,
    ops_settings: OutboxSettings,
) -> None:
    from examples.dashboard_fastapi import create_app as create_shop

    [run_id] = failed_runs(app, engine, sqs, ops_settings)
    shop = create_shop(
        ops_settings.replace(dashboard_actions=True), staff_keys={"key-of-bob-0123456789": "bob"}
    )
    staff = {"Authorization": "Bearer key-of-bob-0123456789"}
    with serve_asgi(shop) as base, httpx.Client(base_url=base, timeout=30) as client:
        assert client.get("/health").json() == {"status": "ok"}
        assert client.get("/outbox/").status_code == 401
        assert client.get("/outbox/", headers={"Authorization": "Bearer guess"}).status_code == 401
        page = client.get("/outbox/runs", headers=staff).text
        assert 'href="/outbox/static/dashboard.css"' in page and f'href="/outbox/runs/{run_id}"' in page
        assert client.get("/outbox/static/htmx.min.js", headers=staff).status_code == 200
        done = client.post(
            "/outbox/actions/dlq-requeue",
            data={"csrf_token": csrf_token(page), "run_id": str(run_id), "confirmed": "yes"},
            headers=staff,
        )
    assert done.status_code == 200 and "requeued 1" in done.text
    assert trail(engine, run_id)[-1].worker_id == "dashboard:bob"


# --- cancel and results (issue 14) ----------------------------------------------------------


def test_cancel_from_the_run_page_confirms_then_cancels_and_records_the_operator(
    app: sessionmaker[Session], engine: sa.Engine, serve: Callable[..., Any]
) -> None:
    run_id = dispatch(app, "charge_card", {}, tenant_id=3, delay=600)
    done_run = dispatch(app, "charge_card", {}, tenant_id=3)
    execute(engine, "UPDATE task_runs SET status = 'succeeded' WHERE run_id = :r", r=done_run)
    with serve(dashboard_users=USERS, dashboard_actions=True) as client:
        csrf = logged_in(client, ALICE)
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
    with serve(dashboard_users=USERS, dashboard_actions=True) as client:
        csrf = logged_in(client, BOB)
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


def confirmation_form(page: str) -> dict[str, str]:
    """The hidden fields of a confirmation page's form, as the browser submits them."""
    form = re.search(r'<form[^>]*id="confirm".*?</form>', page, re.S)
    assert form, "no confirmation form on the page"
    return {
        html.unescape(name): html.unescape(value)
        for name, value in re.findall(r'<input type="hidden" name="([^"]+)" value="([^"]*)">', form.group(0))
    }


def test_a_filtered_cancel_acts_on_exactly_the_runs_previewed(
    app: sessionmaker[Session], engine: sa.Engine, serve: Callable[..., Any]
) -> None:
    """Runs that match the filters after the preview are not cancelled by its confirmation
    (it once re-selected at confirmation: previewed 11, cancelled 16)."""
    previewed = [dispatch(app, "charge_card", {}, tenant_id=5) for _ in range(3)]
    with serve(dashboard_users=USERS, dashboard_actions=True) as client:
        csrf = logged_in(client, BOB)
        preview = client.post(
            "/actions/runs-cancel/preview", data={"csrf_token": csrf, "task": "charge_card", "tenant": "5"}
        )
        assert preview.status_code == 200 and "3 run(s) would be cancelled" in preview.text
        form = confirmation_form(preview.text)
        later = [dispatch(app, "charge_card", {}, tenant_id=5) for _ in range(2)]
        done = client.post("/actions/runs-cancel", data=form)
        empty = client.post(
            "/actions/runs-cancel/preview", data={"csrf_token": csrf, "task": "charge_card", "tenant": "8"}
        )
    assert done.status_code == 200 and "3 run(s) were cancelled" in done.text, done.text[:800]
    assert {status_of(engine, r) for r in previewed} == {"cancelled"}
    assert {status_of(engine, r) for r in later} == {"queued"}
    assert "exactly the 3 run(s)" in preview.text
    assert empty.status_code == 200 and 'id="nothing-to-confirm"' in empty.text
    assert 'id="confirm"' not in empty.text


def test_a_filtered_requeue_acts_on_exactly_the_runs_previewed(
    app: sessionmaker[Session],
    engine: sa.Engine,
    sqs: Any,
    ops_settings: OutboxSettings,
    serve: Callable[..., Any],
) -> None:
    previewed = failed_runs(app, engine, sqs, ops_settings, n=2)
    with serve(dashboard_users=USERS, dashboard_actions=True) as client:
        csrf = logged_in(client, ALICE)
        preview = client.post(
            "/actions/dlq-requeue/preview", data={"csrf_token": csrf, "task": "charge_card"}
        )
        assert preview.status_code == 200 and "would requeue 2, skipped 0" in preview.text
        form = confirmation_form(preview.text)
        assert set(form["run_id"].split(",")) == {str(r) for r in previewed}
        [later] = failed_runs(app, engine, sqs, ops_settings)
        done = client.post("/actions/dlq-requeue", data=form)
    assert done.status_code == 200 and "requeued 2, skipped 0" in done.text, done.text[:800]
    assert {status_of(engine, r) for r in previewed} == {"queued"}
    assert status_of(engine, later) == "failed"


def test_cancel_is_refused_without_actions_or_a_token(
    app: sessionmaker[Session], engine: sa.Engine, serve: Callable[..., Any]
) -> None:
    run_id = dispatch(app, "audit", {})
    with serve(dashboard_users=USERS) as client:  # read-only
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
    with serve(dashboard_users=USERS) as client:
        logged_in(client)
        hidden = client.get(f"/runs/{run_id}").text
    assert 'id="result-hidden"' in hidden and "12500" not in hidden
    with serve(dashboard_users=USERS, dashboard_show_payloads=True) as client:
        logged_in(client)
        shown = client.get(f"/runs/{run_id}").text
    assert "12500" in shown and "<script>alert(1)</script>" not in shown
    assert "&lt;script&gt;" in shown
