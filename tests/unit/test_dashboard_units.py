"""The dashboard's pure parts: charts, filters, untrusted text, authentication and CSRF rules,
the action registry and the requeue form, its settings."""

from __future__ import annotations

import base64
import dataclasses
import datetime as dt
import hashlib
import uuid
from typing import Any

import pytest
from starlette.requests import Request

from sqla_outbox import errors
from sqla_outbox.cli.dashboard import check_exposure, is_loopback
from sqla_outbox.config import OutboxSettings
from sqla_outbox.dashboard import charts, views
from sqla_outbox.dashboard.actions import ActionInputError, ActionRegistry, DlqRequeue, default_actions
from sqla_outbox.dashboard.app import _safe_next
from sqla_outbox.dashboard.auth import (
    IDENTITY_KEY,
    Auth,
    Forbidden,
    Identity,
    Unauthenticated,
    clean_name,
    fingerprint,
)
from sqla_outbox.dashboard.untrusted import visible
from sqla_outbox.operators import Operator
from sqla_outbox.ops.runs import RunCursor, RunRecord, TrailEntry

TOKEN = "a-dashboard-token-of-length"
NOW = dt.datetime(2026, 11, 30, 12, 0, tzinfo=dt.UTC)


def request(
    headers: dict[str, str] | None = None, *, identity: Identity | None = None, client: str = "127.0.0.1"
) -> Request:
    """A request as a page sees it (``identity``: what the access middleware found)."""
    raw = [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
    scope: dict[str, Any] = {
        "type": "http",
        "method": "POST",
        "path": "/",
        "headers": raw,
        "client": (client, 5000),
    }
    if identity is not None:
        scope[IDENTITY_KEY] = identity
    return Request(scope)


# --- untrusted text --------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("raw", "shown"),
    [
        ("plain text, ünïcode, 日本", "plain text, ünïcode, 日本"),
        ("\x1b[31mred\x1b[0m", "\\x1b[31mred\\x1b[0m"),
        ("admin\u202etxt.exe", "admin\\u202etxt.exe"),
        ("zero\u200bwidth\ufeff", "zero\\u200bwidth\\ufeff"),
        ("nul\x00 del\x7f c1\x85", "nul\\x00 del\\x7f c1\\x85"),
        ("line\nbreak\ttab", "line\nbreak\ttab"),
    ],
)
def test_visible_spells_out_invisible_and_reordering_characters(raw: str, shown: str) -> None:
    assert visible(raw) == shown


# --- charts ----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("value", "ceiling"), [(0, 1), (0.3, 0.5), (1, 1), (7, 10), (12, 20), (21, 25), (26, 50), (4100, 5000)]
)
def test_nice_ceiling(value: float, ceiling: float) -> None:
    assert charts.nice_ceiling(value) == pytest.approx(ceiling)


def test_counts_chart_scales_from_zero_and_names_the_latest_value() -> None:
    minutes = [NOW + dt.timedelta(minutes=i) for i in range(3)]
    chart = charts.counts_chart(
        "c", minutes, [("dispatched", "s-d", [0, 40, 12]), ("failed", "s-f", [0, 0, 0])]
    )
    assert [t.label for t in chart.y_ticks] == ["0", "12.5", "25", "37.5", "50"]
    points = chart.series[0].segments[0].split()
    assert len(points) == 3 and points[0].endswith(f",{charts.TOP + chart.plot_height:.1f}")
    assert (chart.series[0].latest, chart.series[1].latest, chart.empty) == ("12", "0", False)
    assert charts.counts_chart("c", minutes, [("x", "s", [0, 0, 0])]).empty


def test_the_charts_end_on_the_last_whole_minute() -> None:
    """The current minute, still filling, read as a collapse at the end of every chart
    early in each minute: the charts stop at the last whole minute."""
    from sqla_outbox.dashboard import queries, views

    minutes = [
        queries.MinuteActivity(
            NOW + dt.timedelta(minutes=i), dispatched=n, finished=n, failed=0, latency_seconds=(0.1, 0.2, 0.3)
        )
        for i, n in enumerate([40, 40, 3])
    ]
    throughput, latency = views.activity_charts(
        queries.Activity(now=NOW + dt.timedelta(minutes=2, seconds=5), minutes=minutes)
    )
    assert throughput.series[0].latest == "40" and len(throughput.series[0].segments[0].split()) == 2
    assert len(latency.series[0].segments[0].split()) == 2


def test_latency_chart_is_logarithmic_and_breaks_lines_at_missing_minutes() -> None:
    minutes = [NOW + dt.timedelta(minutes=i) for i in range(5)]
    chart = charts.latency_chart("l", minutes, [("p50", "s-p50", [0.02, None, 0.5, 3.0, None])])
    assert [t.label for t in chart.y_ticks] == ["10 ms", "100 ms", "1 s", "10 s"]
    assert [len(s.split()) for s in chart.series[0].segments] == [1, 2]
    assert chart.series[0].latest == "3 s"
    empty = charts.latency_chart("l", minutes, [("p50", "s", [None] * 5)])
    assert empty.empty and empty.series[0].segments == []


@pytest.mark.parametrize(
    ("seconds", "text"), [(0.005, "5 ms"), (0.25, "250 ms"), (1.5, "1.5 s"), (100, "100 s"), (3600, "60 min")]
)
def test_format_seconds(seconds: float, text: str) -> None:
    assert charts.format_seconds(seconds) == text


# --- filters from URLs -----------------------------------------------------------------------
def test_runs_query_reads_every_filter() -> None:
    cursor = RunCursor(NOW, uuid.UUID(int=7))
    query = views.runs_query(
        {
            "task": " send_welcome ",
            "tenant": "platform",
            "queue": "bulk",
            "status": "failed",
            "since": "2026-11-30T10:15",
            "until": "2026-11-30T11:00:00+01:00",
            "before": cursor.encode(),
        },
        limit=51,
    )
    f = query.filters
    assert (f.tasks, f.tenant_id, f.queues, f.statuses, f.limit) == (
        ("send_welcome",),
        "platform",
        ("bulk",),
        ("failed",),
        51,
    )
    assert f.created_after == dt.datetime(2026, 11, 30, 10, 15, tzinfo=dt.UTC)
    assert f.created_before == dt.datetime(2026, 11, 30, 10, 0, tzinfo=dt.UTC)
    assert f.before == cursor and f.after is None
    assert views.runs_query({"tenant": "12"}).filters.tenant_id == 12


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ({"tenant": "0x10"}, "tenant: '0x10' is neither a tenant id nor 'platform'"),
        ({"queue": "urgent"}, "queue: 'urgent' is not one of"),
        ({"status": "done"}, "status: 'done' is not one of"),
        ({"since": "yesterday"}, "since: 'yesterday' is not a date and time"),
        ({"task": "x" * 201}, "task: at most 200 characters"),
        # trial finding: these reached PostgreSQL and came back as 503 "database unavailable"
        ({"tenant": "99999999999999999999"}, "tenant: '99999999999999999999' is outside the range"),
        ({"task": "a\x00b"}, "task: contains a NUL character"),
        ({"before": "2026-11-30T10:00:00~not-a-uuid"}, "before: not a position"),
        ({"after": "2026-11-30T10:00:00~" + str(uuid.UUID(int=1))}, "after: not a position"),  # no time zone
    ],
)
def test_runs_query_refuses_bad_filters(params: dict[str, str], message: str) -> None:
    with pytest.raises(views.FilterError, match="^" + message.replace("(", r"\(").replace(")", r"\)")):
        views.runs_query(params)


def test_run_cursor_round_trips() -> None:
    cursor = RunCursor(NOW.replace(microsecond=123456), uuid.uuid4())
    assert RunCursor.decode(cursor.encode()) == cursor
    with pytest.raises(errors.ConfigurationError):
        RunCursor.decode("garbage")


def test_dlq_query() -> None:
    query = views.dlq_query({"queue": "critical", "task": "charge_card", "older_than": "1h30m"})
    assert (query.queues, query.tasks, query.older_than) == (
        ("critical",),
        ("charge_card",),
        dt.timedelta(minutes=90),
    )
    with pytest.raises(views.FilterError, match="is not a duration"):
        views.dlq_query({"older_than": "soon"})
    with pytest.raises(views.FilterError, match="task: contains a NUL character"):
        views.dlq_query({"task": "\x00"})


# --- a run's page ----------------------------------------------------------------------------
def trail_entry(i: int, status: str, attempt: int | None, error: str | None = None) -> TrailEntry:
    return TrailEntry(
        i, NOW + dt.timedelta(seconds=i), status, attempt, attempt, "w:1", error and "E", error, None, None
    )


def test_attempts_fold_the_trail_by_attempt_number() -> None:
    trail = [
        trail_entry(1, "running", 1),
        trail_entry(2, "retrying", 1, "boom"),
        trail_entry(3, "running", 2),
        trail_entry(4, "failed", 2, "boom again"),
        trail_entry(5, "queued", None),  # an operator's requeue
        # ... as the requeue writes it: with the number of the attempt it follows
        dataclasses.replace(
            trail_entry(5, "queued", 2), worker_id="operator:root@vm", detail={"requeued_by": "operator"}
        ),
        trail_entry(6, "running", 3),
        trail_entry(7, "succeeded", 3),
    ]
    shown = [(a.number, a.outcome, a.error_message, a.started_at) for a in views.attempts(trail)]
    assert shown == [
        (1, "retrying", "boom", trail[0].at),
        (2, "failed", "boom again", trail[2].at),
        (3, "succeeded", None, trail[6].at),
    ]


def test_envelope_metadata_never_includes_the_payload() -> None:
    envelope = {
        "v": 1,
        "run_id": "r",
        "task": "t",
        "queue": "default",
        "tenant_id": 3,
        "event": None,
        "idempotency_key": "k",
        "payload": '{"card": "4242"}',
        "trace": {"traceparent": "00-abc"},
        "future_field": [1],
    }
    shown = dict(views.envelope_metadata(envelope))
    assert "payload" not in shown and "4242" not in str(shown)
    assert shown["tenant_id"] == "3" and shown["event"] == "-" and shown["trace.traceparent"] == "00-abc"
    assert shown["future_field"] == "[1]"
    assert views.payload_text(envelope) == '{\n  "card": "4242"\n}'
    assert views.payload_text({"payload": "not json"}) == "not json"


# --- authentication and CSRF -----------------------------------------------------------------
def basic(user: str, password: str) -> str:
    return "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()


def test_token_bearer_and_basic_identities() -> None:
    """Without a cookie nothing is read from the database: Bearer and Basic decide alone."""
    own = "an-operators-own-token-0123"
    auth = Auth(
        OutboxSettings(
            dashboard_token=TOKEN,
            dashboard_basic_auth="ops:a-long-password",
            dashboard_users=(f"zoe:viewer:tenants=4:sha256={hashlib.sha256(own.encode()).hexdigest()}",),
        ),
        identify=None,
        secure_cookies=False,
    )
    assert auth.required and auth.uses_login_page
    shared = auth.resolve(request({"Authorization": f"Bearer {TOKEN}"}))
    assert (shared.name, shared.method, shared.role, shared.bearer) == ("token", "token", "operator", True)
    # a typed name is not an identity: the token names its operator
    named = auth.resolve(request({"Authorization": f"Bearer {TOKEN}", "X-Operator": "carol"}))
    assert named.actor == "dashboard:token"
    zoe = auth.resolve(request({"Authorization": f"Bearer {own}"}))
    assert (zoe.name, zoe.method, zoe.role, zoe.tenants, zoe.can_act) == ("zoe", "user", "viewer", {4}, False)
    assert auth.resolve(request({"Authorization": basic("ops", "a-long-password")})).name == "ops"
    for bad in (
        f"Bearer {TOKEN}x",
        "Bearer " + hashlib.sha256(own.encode()).hexdigest(),  # the configured hash opens nothing
        basic("ops", "wrong-password"),
        basic("root", "a-long-password"),
        "Basic !!!",
    ):
        with pytest.raises(Unauthenticated):
            auth.resolve(request({"Authorization": bad}))
    with pytest.raises(Unauthenticated):
        auth.resolve(request())
    assert fingerprint("token", "token", TOKEN) != fingerprint("token", "token", TOKEN + "-rotated")
    assert TOKEN not in fingerprint("token", "token", TOKEN)


def test_without_own_authentication_the_host_hook_decides() -> None:
    hosted = Auth(OutboxSettings(), identify=lambda r: r.headers.get("x-user"), secure_cookies=False)
    erin = hosted.resolve(request({"X-User": "erin"}))
    assert (erin.actor, erin.role, hosted.needs_session(erin)) == ("dashboard:erin", "operator", True)
    with pytest.raises(Unauthenticated):
        hosted.resolve(request())
    scoped = Auth(
        OutboxSettings(), identify=lambda r: Operator("fay", "viewer", frozenset({2})), secure_cookies=False
    ).resolve(request())
    assert (scoped.role, scoped.tenants, scoped.allows_tenant(2), scoped.allows_tenant(None)) == (
        "viewer",
        {2},
        True,
        False,
    )
    anonymous = Auth(OutboxSettings(), identify=None, secure_cookies=False).resolve(request())
    assert not anonymous.authenticated and anonymous.role == "viewer" and not anonymous.can_act


def test_a_proxy_header_needs_the_proxys_address() -> None:
    with pytest.raises(errors.ConfigurationError, match="PROXY_ADDRESSES"):
        Auth(
            OutboxSettings(dashboard_proxy_user_header="X-Forwarded-User"),
            identify=None,
            secure_cookies=False,
        )
    auth = Auth(
        OutboxSettings(
            dashboard_proxy_user_header="X-Forwarded-User",
            dashboard_proxy_addresses=("10.0.3.0/24",),
            dashboard_proxy_default_role="none",
            dashboard_users=("gus:operator",),
        ),
        identify=None,
        secure_cookies=False,
    )
    assert auth.resolve(request({"X-Forwarded-User": "gus"}, client="10.0.3.7")).method == "proxy"
    for headers, client in (
        ({"X-Forwarded-User": "gus"}, "10.0.4.7"),  # not the proxy
        ({"X-Forwarded-User": "hal"}, "10.0.3.7"),  # unlisted, and the default role is none
        ({"X-Forwarded-User": "gus\nx"}, "10.0.3.7"),
    ):
        with pytest.raises(Unauthenticated):
            auth.resolve(request(headers, client=client))


def test_csrf_needs_the_sessions_token_and_a_same_site_request() -> None:
    auth = Auth(OutboxSettings(dashboard_token=TOKEN), identify=None, secure_cookies=False)
    token = "t" * 43
    signed_in = Identity("token", "token", csrf=token, session_key="k" * 43)
    auth.check_csrf(request(identity=signed_in), token)
    auth.check_csrf(request({"X-CSRF-Token": token}, identity=signed_in), None)
    for submitted, headers, identity in (
        (None, {}, signed_in),
        (token[:-1] + "x", {}, signed_in),
        (token, {}, dataclasses.replace(signed_in, csrf=None)),  # no session
        (token, {"Sec-Fetch-Site": "cross-site"}, signed_in),
        (None, {"Authorization": f"Bearer {TOKEN}", "Sec-Fetch-Site": "cross-site"}, signed_in),
    ):
        with pytest.raises(Forbidden):
            auth.check_csrf(request(headers, identity=identity), submitted)


def test_a_script_with_the_bearer_token_needs_no_csrf_token() -> None:
    """Trial finding: a script with only ``Authorization: Bearer`` got 403 on every action.
    A browser never attaches that header by itself, so it cannot be forged cross-site."""
    auth = Auth(OutboxSettings(dashboard_token=TOKEN), identify=None, secure_cookies=False)
    auth.check_csrf(request(identity=Identity("token", "token", bearer=True)), None)


@pytest.mark.parametrize(
    "entry",
    [
        "alice",
        "alice:root",
        "alice:operator:sha256=abc",
        "bad name:viewer",
        "a:viewer:tenants=x",
        "a:viewer:pw=1",
    ],
)
def test_a_bad_operator_entry_is_refused_by_the_settings(entry: str) -> None:
    with pytest.raises(errors.ConfigurationError, match="SQLA_OUTBOX_DASHBOARD_USERS"):
        OutboxSettings(dashboard_users=(entry,))
    with pytest.raises(errors.ConfigurationError, match="listed twice"):
        OutboxSettings(dashboard_users=("a:viewer", "a:operator"))


@pytest.mark.parametrize(
    ("raw", "name"),
    [("alice", "alice"), ("  bob smith ", "bob smith"), ("<b>x</b>", "_b_x__b_"), ("", "dflt")],
)
def test_operator_names_are_cleaned(raw: str, name: str) -> None:
    assert clean_name(raw, "dflt") == name
    assert len(clean_name("x" * 500, "d")) == 64


@pytest.mark.parametrize(
    ("target", "safe"),
    [
        ("/runs?status=failed", "/runs?status=failed"),
        ("//evil.example/", "/"),
        ("https://evil.example/", "/"),
        ("/\\evil", "/"),
        ("runs", "/"),
        (None, "/"),
    ],
)
def test_login_redirects_stay_on_the_site(target: str | None, safe: str) -> None:
    assert _safe_next(target, "/") == safe


# --- actions ---------------------------------------------------------------------------------
def test_the_requeue_form_needs_a_filter_and_valid_values() -> None:
    action = DlqRequeue()
    params = action.parse(
        {"run_id": [str(uuid.UUID(int=1)) + ", " + str(uuid.UUID(int=2))], "older_than": ["2h"]}
    )
    assert params.filters.run_ids == {uuid.UUID(int=1), uuid.UUID(int=2)}
    assert params.filters.older_than == dt.timedelta(hours=2)
    assert action.parse({"all": ["yes"]}).everything
    for form, message in (
        ({}, "choose the runs"),
        ({"run_id": ["nope"]}, "'nope' is not a run id"),
        ({"queue": ["urgent"]}, "unknown queue 'urgent'"),
        ({"older_than": ["soon"]}, "is not a duration"),
        ({"task": ["t" * 201]}, "at most 200 characters"),
    ):
        with pytest.raises(ActionInputError, match=message):
            action.parse(form)


def test_registry_places_actions_and_refuses_clashes() -> None:
    registry = default_actions()
    [requeue] = registry.in_place("dlq")
    run = RunRecord(
        uuid.uuid4(),
        "t",
        None,
        "default",
        None,
        "failed",
        None,
        1,
        NOW,
        NOW,
        NOW,
        None,
        NOW,
        None,
        None,
        None,
        None,
        None,
        0.0,
        False,
    )
    assert registry.for_run(run) == [requeue] and requeue.run_fields(run) == {"run_id": str(run.run_id)}
    assert registry.for_run(dataclasses.replace(run, status="succeeded")) == []
    assert [a.name for a in registry.in_place("runs")] == ["runs-cancel"]
    assert [
        [a.name for a in registry.for_run(dataclasses.replace(run, status=s))]
        for s in ("queued", "running", "retrying")
    ] == [["runs-cancel", "flow-pause"], ["runs-cancel"], ["runs-cancel", "flow-pause"]]
    assert registry.for_run(dataclasses.replace(run, status="cancelled")) == []
    assert [a.name for a in registry.in_place("controls")] == ["flow-pause", "flow-resume"]
    pause = registry.get("flow-pause")
    assert pause is not None and pause.run_fields(run) == {"scope": "task", "target": "t"}
    with pytest.raises(ValueError, match="already registered"):
        registry.register(DlqRequeue())

    class Bad(DlqRequeue):
        name = "Bad Name"

    with pytest.raises(ValueError, match="lower-case"):
        ActionRegistry([Bad()])


def test_pause_and_resume_forms_are_checked() -> None:
    registry = default_actions()
    pause, resume = registry.get("flow-pause"), registry.get("flow-resume")
    assert pause is not None and resume is not None
    parsed = pause.parse({"scope": ["tenant"], "target": ["42"], "reason": [" incident "]})
    assert (parsed.target.scope, parsed.target.target, parsed.reason) == ("tenant", "42", "incident")
    assert parsed.kwargs() == {"tenant_id": 42}
    assert resume.parse({"scope": ["queue"], "target": ["bulk"]}).kwargs() == {"queue": "bulk"}
    for form, message in (
        ({"target": ["audit"]}, "choose what to pause"),
        ({"scope": ["task"], "target": [""]}, "name the task"),
        ({"scope": ["tenant"], "target": ["acme"]}, "is not a tenant id"),
        ({"scope": ["queue"], "target": ["bad queue!"]}, "is not a queue name"),
        ({"scope": ["task"], "target": ["bad name!"]}, "task names"),
    ):
        with pytest.raises(ActionInputError, match=message):
            pause.parse(form)


# --- settings and the command's exposure checks ----------------------------------------------
def test_dashboard_settings_are_validated_and_masked() -> None:
    settings = OutboxSettings.from_env(
        {
            "SQLA_OUTBOX_DASHBOARD_TOKEN": TOKEN,
            "SQLA_OUTBOX_DASHBOARD_BASIC_AUTH": "ops:a-long-password",
            "SQLA_OUTBOX_DASHBOARD_ACTIONS": "true",
            "SQLA_OUTBOX_DASHBOARD_PORT": "9000",
        }
    )
    assert (settings.dashboard_actions, settings.dashboard_port) == (True, 9000)
    shown = settings.redacted()
    assert shown["dashboard_token"] == "***" and shown["dashboard_basic_auth"] == "ops:***"
    assert OutboxSettings.from_env({"SQLA_OUTBOX_DASHBOARD_TOKEN": "none"}).dashboard_token is None
    for env, message in (
        ({"SQLA_OUTBOX_DASHBOARD_TOKEN": "short"}, "SQLA_OUTBOX_DASHBOARD_TOKEN: must be at least 16"),
        (
            {"SQLA_OUTBOX_DASHBOARD_BASIC_AUTH": "ops"},
            "SQLA_OUTBOX_DASHBOARD_BASIC_AUTH: must be user:password",
        ),
        ({"SQLA_OUTBOX_DASHBOARD_BASIC_AUTH": "ops:short"}, "at least 12 characters"),
        ({"SQLA_OUTBOX_DASHBOARD_PORT": "70000"}, "SQLA_OUTBOX_DASHBOARD_PORT: must be a TCP port"),
        ({"SQLA_OUTBOX_DASHBOARD_REFRESH_SECONDS": "0.1"}, "must be >= 1 s"),
    ):
        with pytest.raises(errors.ConfigurationError, match=message):
            OutboxSettings.from_env(env)


@pytest.mark.parametrize(
    ("host", "loopback"),
    [
        ("127.0.0.1", True),
        ("127.8.0.1", True),
        ("localhost", True),
        ("::1", True),
        ("[::1]", True),
        ("0.0.0.0", False),
        ("10.0.0.5", False),
        ("example.org", False),
    ],
)
def test_is_loopback(host: str, loopback: bool) -> None:
    assert is_loopback(host) is loopback


def test_the_command_refuses_an_open_or_anonymous_acting_dashboard() -> None:
    check_exposure(OutboxSettings())
    check_exposure(OutboxSettings(dashboard_host="0.0.0.0", dashboard_token=TOKEN, dashboard_actions=True))
    with pytest.raises(errors.ConfigurationError, match="without authentication"):
        check_exposure(OutboxSettings(dashboard_host="0.0.0.0"))
    with pytest.raises(errors.ConfigurationError, match="actions need an authenticated operator"):
        check_exposure(OutboxSettings(dashboard_actions=True))


def test_pause_and_cancel_refuse_a_task_or_queue_the_catalog_does_not_know() -> None:
    """Trial finding: the dashboard answered "paused task no_such_task" (200)."""

    registry = default_actions(("critical", "default", "bulk", "maintenance"), frozenset({"charge_card"}))
    pause, cancel = registry.get("flow-pause"), registry.get("runs-cancel")
    assert pause is not None and cancel is not None
    assert pause.parse({"scope": ["task"], "target": ["charge_card"]}).target.target == "charge_card"
    for action, form in (
        (pause, {"scope": ["task"], "target": ["no_such_task"]}),
        (pause, {"scope": ["queue"], "target": ["critcal"]}),
        (cancel, {"task": ["no_such_task"]}),
    ):
        with pytest.raises(ActionInputError, match="check the name"):
            action.parse(form)


def test_a_waiting_run_names_the_task_limits_that_hold_it() -> None:
    """An open breaker, a full concurrency cap and a spent rate limit each say so; another
    task's limits and a Valkey that did not answer say nothing."""
    from sqla_outbox.worker.gate import BreakerState, FlowControlState, TaskLimitState
    from sqla_outbox.worker.limits import Breaker

    state = FlowControlState(
        tasks=[
            TaskLimitState("charge", 2, 2, 10, 60, 10, "payments"),
            TaskLimitState("other", 1, 1, None, None, 0, None),
        ],
        breakers=[BreakerState("payments", "open", 0, 25.0, 5.0, 0, Breaker("payments"))],
    )
    assert views._limit_reasons("charge", state) == [
        "the task's concurrency cap is full: 2 of 2 running",
        "the task's rate limit is used up: 10 of 10 in 60 s",
        "circuit breaker payments is open for 25s more",
    ]
    assert views._limit_reasons("quiet", state) == []
    assert views._limit_reasons("charge", FlowControlState(error="Valkey did not answer")) == []
