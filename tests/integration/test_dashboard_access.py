"""Who may look at and act on the dashboard: server-side sessions, roles, tenant scopes, a
reverse proxy's user, the Host check, and what the DLQ page lets an operator requeue.

Real PostgreSQL (the ``dashboard_sessions`` table), real HTTP (uvicorn), moto SQS; each
test plays the attacker of a finding: a cookie seen once, a session past its end, a
viewer who tries to act, an operator of one tenant who asks for another's runs, a header
sent from outside the proxy, a page of another site reached through DNS rebinding.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import re
from collections.abc import Callable
from typing import Any

import itsdangerous
import sqlalchemy as sa
from sqlalchemy.orm import Session, sessionmaker

from sqla_outbox import envelope
from sqla_outbox.config import OutboxSettings
from sqla_outbox.dashboard.auth import SESSION_COOKIE
from sqla_outbox.relay import Relay
from tests.integration.test_dashboard import (  # noqa: F401 - fixtures
    ALICE,
    BOB,
    SECRET,
    TOKEN,
    USERS,
    VIC,
    cells,
    dispatch,
    failed_runs,
    logged_in,
    ops_settings,
    serve,
    sha256,
)
from tests.integration.test_ops import fail_into_dlq
from tests.support import csrf_token, receive_all, status_of, trail

TOM = "tom-own-token-0123456789"
SCOPED = (*USERS, f"tom:operator:tenants=3:sha256={sha256(TOM)}")
"""USERS plus tom, an operator of tenant 3 only."""


def sessions_table(engine: sa.Engine) -> list[Any]:
    with engine.connect() as conn:
        return list(conn.execute(sa.text("SELECT * FROM dashboard_sessions ORDER BY created_at")))


def old_style_cookie(token: str, name: str) -> str:
    """What one seen cookie let anyone mint before: a Starlette session signed with a key
    derived from the token, naming any operator."""
    key = hmac.new(token.encode(), b"sqla_outbox dashboard session", hashlib.sha256).hexdigest()
    data = {"identity": {"name": name, "token": key}, "csrf": "c" * 43}
    payload = base64.b64encode(json.dumps(data).encode())
    return itsdangerous.TimestampSigner(key).sign(payload).decode()


# --- sessions -------------------------------------------------------------------------------


def test_the_cookie_holds_a_random_key_only_and_a_minted_session_opens_nothing(
    engine: sa.Engine,
    serve: Callable[..., Any],  # noqa: F811
) -> None:
    with serve(dashboard_token=TOKEN, dashboard_actions=True) as client:
        logged_in(client, TOKEN)
        key = client.cookies[SESSION_COOKIE]
        [row] = sessions_table(engine)
        assert re.fullmatch(r"[A-Za-z0-9_-]{43}", key)  # 32 random bytes, nothing else
        assert row.id == hashlib.sha256(key.encode()).hexdigest()  # the key itself is stored nowhere
        assert key not in json.dumps([str(v) for v in row]) and TOKEN not in json.dumps([str(v) for v in row])
        assert row.operator == "token"
        client.cookies.clear()
        # the finding: a cookie minted with the key derived from the token, under any name
        client.cookies.set(SESSION_COOKIE, old_style_cookie(TOKEN, "mallory"))
        assert client.get("/runs").status_code == 303  # to the login page
        client.cookies.set(SESSION_COOKIE, "A" * 43)
        assert client.get("/runs").status_code == 303


def test_a_session_ends_at_its_expiry_on_the_server_at_logout_and_when_its_token_rotates(
    engine: sa.Engine,
    serve: Callable[..., Any],  # noqa: F811
) -> None:
    with serve(dashboard_users=USERS, dashboard_token=TOKEN) as client:
        logged_in(client, ALICE)
        assert client.get("/runs").status_code == 200
        with engine.begin() as conn:  # the cookie's own Max-Age says nothing: the row decides
            conn.execute(sa.text("UPDATE dashboard_sessions SET expires_at = clock_timestamp()"))
        assert client.get("/runs").status_code == 303

        csrf = logged_in(client, ALICE)
        kept = client.cookies[SESSION_COOKIE]
        assert client.post("/logout", data={"csrf_token": csrf}).status_code == 303
        client.cookies.clear()
        client.cookies.set(SESSION_COOKIE, kept)  # a copy of the cookie, kept from before
        assert client.get("/runs").status_code == 303

        client.cookies.clear()
        logged_in(client, TOKEN)
        shared = client.cookies[SESSION_COOKIE]
        client.cookies.clear()
        logged_in(client, BOB)
        bobs = client.cookies[SESSION_COOKIE]
    rotated = (USERS[0], f"bob:operator:sha256={sha256('bob-new-token-0123456789')}", USERS[2])
    with serve(dashboard_users=rotated, dashboard_token=TOKEN + "-rotated") as client:
        for cookie in (shared, bobs):  # both rotated away: their sessions end
            client.cookies.clear()
            client.cookies.set(SESSION_COOKIE, cookie)
            assert client.get("/runs").status_code == 303
        client.cookies.clear()
        logged_in(client, ALICE)  # alice's token did not change
        assert client.get("/runs").status_code == 200


def test_cookies_are_secure_when_asked_and_the_login_form_needs_its_own_token(
    serve: Callable[..., Any],  # noqa: F811
) -> None:
    with serve(dashboard_users=USERS, dashboard_secure_cookies=True) as client:
        login = client.get("/login")
        set_cookie = login.headers["set-cookie"]
        assert "secure" in set_cookie.lower()  # the login form's own cookie
        # (over plain HTTP, as here, a browser would not send it back: Secure means HTTPS only)
        form_cookie = {"Cookie": set_cookie.split(";", 1)[0]}
        forged = client.post("/login", data={"csrf_token": "x" * 43, "token": ALICE}, headers=form_cookie)
        assert forged.status_code == 403
        without_cookie = client.post("/login", data={"csrf_token": csrf_token(login.text), "token": ALICE})
        assert without_cookie.status_code == 403
        signed_in = client.post(
            "/login", data={"csrf_token": csrf_token(login.text), "token": ALICE}, headers=form_cookie
        )
        assert signed_in.status_code == 303
        cookie = signed_in.headers["set-cookie"].lower()
        assert "secure" in cookie and "httponly" in cookie and "samesite=strict" in cookie


# --- roles and tenants ----------------------------------------------------------------------


def test_a_viewer_reads_without_payloads_and_never_acts(
    app: sessionmaker[Session],
    engine: sa.Engine,
    sqs: Any,
    ops_settings: OutboxSettings,  # noqa: F811
    serve: Callable[..., Any],  # noqa: F811
) -> None:
    [run_id] = failed_runs(app, engine, sqs, ops_settings)
    with serve(dashboard_users=USERS, dashboard_actions=True, dashboard_show_payloads=True) as client:
        csrf = logged_in(client, VIC)
        page = client.get(f"/runs/{run_id}").text
        assert 'data-role="viewer">vic' in page
        assert 'id="payload-hidden"' in page and SECRET not in page
        assert (
            'data-action="dlq-requeue"' not in page
            and 'data-action="dlq-requeue"' not in client.get("/dlq", params={"messages": "yes"}).text
        )
        refused = client.post(
            "/actions/dlq-requeue", data={"csrf_token": csrf, "run_id": str(run_id), "confirmed": "yes"}
        )
        assert refused.status_code == 403 and "viewer" in refused.text
        scripted = client.post(  # the same with the viewer's token as a script's Bearer
            "/actions/dlq-requeue",
            data={"run_id": str(run_id), "confirmed": "yes"},
            headers={"Authorization": f"Bearer {VIC}"},
        )
        assert scripted.status_code == 403
    assert status_of(engine, run_id) == "failed"


def test_an_operator_restricted_to_a_tenant_sees_and_acts_on_that_tenants_runs_only(
    app: sessionmaker[Session],
    engine: sa.Engine,
    sqs: Any,
    ops_settings: OutboxSettings,  # noqa: F811
    serve: Callable[..., Any],  # noqa: F811
) -> None:
    mine = dispatch(app, "charge_card", {"card": SECRET}, tenant_id=3)
    theirs = dispatch(app, "charge_card", {"card": SECRET}, tenant_id=5)
    platform = dispatch(app, "rebuild_cache", {})
    relay = Relay(ops_settings, engine=engine)
    relay.run_once()
    relay.sender.close()
    fail_into_dlq(engine, sqs, ops_settings, "critical", {mine, theirs})
    with serve(dashboard_users=SCOPED, dashboard_actions=True) as client:
        csrf = logged_in(client, TOM)
        assert client.get("/").status_code == 303  # the overview counts every tenant: to the runs
        listed = cells(client.get("/runs").text, "data-run-id")
        assert set(listed) == {str(mine)}
        assert set(cells(client.get("/runs", params={"tenant": "5"}).text, "data-run-id")) == set()
        assert client.get(f"/runs/{theirs}").status_code == 404
        assert client.get(f"/runs/{platform}").status_code == 404
        assert client.get("/controls").status_code == 403 and client.get("/schedules").status_code == 403
        assert client.get("/liveness").status_code == 403  # every tenant's work and the fleet
        assert set(cells(client.get("/dlq", params={"messages": "yes"}).text, "data-run-id")) == {str(mine)}
        ledger = client.get("/dlq").text  # the ledger's view: only their tenant's runs and counts
        assert (
            set(cells(ledger, "data-run-id")) == {str(mine)}
            and 'id="ledger-total">1 dead-lettered run<' in ledger
        )
        every = client.post(  # "every failed run": only tenant 3's
            "/actions/dlq-requeue", data={"csrf_token": csrf, "all": "yes", "confirmed": "yes"}
        )
        assert every.status_code == 200 and "requeued 1" in every.text
        by_id = client.post(
            "/actions/dlq-requeue", data={"csrf_token": csrf, "run_id": str(theirs), "confirmed": "yes"}
        )
        assert "requeued 0" in by_id.text
        cancel = client.post(
            "/actions/runs-cancel", data={"csrf_token": csrf, "tenant": "5", "confirmed": "yes"}
        )
        assert cancel.status_code == 400 and "your tenants" in cancel.text
        pause = client.post(
            "/actions/flow-pause",
            data={"csrf_token": csrf, "scope": "queue", "target": "bulk", "confirmed": "yes"},
        )
        assert pause.status_code == 403
    assert status_of(engine, mine) == "queued"
    assert status_of(engine, theirs) == "failed" and trail(engine, mine)[-1].worker_id == "dashboard:tom"


# --- a reverse proxy's user -----------------------------------------------------------------


def test_the_proxy_user_header_is_trusted_from_the_proxys_address_only(
    app: sessionmaker[Session],
    engine: sa.Engine,
    sqs: Any,
    ops_settings: OutboxSettings,  # noqa: F811
    serve: Callable[..., Any],  # noqa: F811
) -> None:
    [run_id] = failed_runs(app, engine, sqs, ops_settings)
    proxy = {"dashboard_proxy_user_header": "X-Forwarded-User", "dashboard_actions": True}
    users = ("carol@example.com:operator",)
    with serve(dashboard_proxy_addresses=("127.0.0.1",), dashboard_users=users, **proxy) as client:
        assert client.get("/runs").status_code == 401  # no header: nobody
        page = client.get("/dlq", headers={"X-Forwarded-User": "carol@example.com"})
        assert (
            page.status_code == 200
            and 'data-method="proxy" data-role="operator">carol@example.com' in page.text
        )
        done = client.post(
            "/actions/dlq-requeue",
            data={"csrf_token": csrf_token(page.text), "run_id": str(run_id), "confirmed": "yes"},
            headers={"X-Forwarded-User": "carol@example.com"},
        )
        assert done.status_code == 200 and "requeued 1" in done.text
        other = client.get("/runs", headers={"X-Forwarded-User": "dave"})  # not listed: a viewer
        assert other.status_code == 200 and 'data-role="viewer">dave' in other.text
        # the session carries carol's CSRF token only together with carol
        forged = client.post(
            "/actions/dlq-requeue",
            data={"csrf_token": csrf_token(page.text), "run_id": str(run_id), "confirmed": "yes"},
            headers={"X-Forwarded-User": "dave"},
        )
        assert forged.status_code == 403
    assert trail(engine, run_id)[-1].worker_id == "dashboard:carol@example.com"
    with serve(dashboard_proxy_addresses=("10.9.9.9",), **proxy) as client:  # we are not the proxy
        assert client.get("/runs", headers={"X-Forwarded-User": "carol@example.com"}).status_code == 401


def test_the_host_check_refuses_a_name_pointed_at_the_dashboard(
    serve: Callable[..., Any],  # noqa: F811
) -> None:
    """DNS rebinding: a page of rebind.example whose name now resolves to the dashboard's
    address reads it as its own origin; the anonymous loopback mode answered it."""
    with serve(dashboard_allowed_hosts=("127.0.0.1", "localhost")) as client:
        assert client.get("/runs").status_code == 200
        assert client.get("/runs", headers={"Host": "rebind.example:8089"}).status_code == 400
        assert client.get("/static/dashboard.css", headers={"Host": "rebind.example"}).status_code == 400


# --- what the pages show of untrusted answers and DLQ attributes ------------------------------


def test_a_receivers_answer_is_hidden_in_the_trail_unless_payloads_are_shown(
    app: sessionmaker[Session],
    engine: sa.Engine,
    serve: Callable[..., Any],  # noqa: F811
) -> None:
    run_id = dispatch(app, "send_welcome", {}, tenant_id=3)
    detail = {
        "webhook": {
            "response": {"status": 200, "content_type": "text/plain", "body": "token=internal-s3cret"}
        }
    }
    with engine.begin() as conn:
        conn.execute(
            sa.text(
                "INSERT INTO task_run_trail (run_id, status, attempt, receive_count, worker_id, detail) "
                "VALUES (:r, 'succeeded', 1, 1, 'w', CAST(:d AS jsonb))"
            ),
            {"r": run_id, "d": json.dumps(detail)},
        )
    with serve(dashboard_users=USERS) as client:
        logged_in(client, ALICE)
        hidden = client.get(f"/runs/{run_id}").text
    assert (
        "internal-s3cret" not in hidden
        and "hidden: a receiver" in hidden
        and "&#34;status&#34;: 200" in hidden
    )
    with serve(dashboard_users=USERS, dashboard_show_payloads=True) as client:
        logged_in(client, ALICE)
        assert "internal-s3cret" in client.get(f"/runs/{run_id}").text
        logged_in(client, VIC)  # a viewer: never
        assert "internal-s3cret" not in client.get(f"/runs/{run_id}").text


def test_the_dlq_page_shows_origins_and_its_filtered_requeue_reads_each_runs_row(
    app: sessionmaker[Session],
    engine: sa.Engine,
    sqs: Any,
    ops_settings: OutboxSettings,  # noqa: F811
    queues: dict[str, str],
    serve: Callable[..., Any],  # noqa: F811
) -> None:
    """Without signing: copies of a failed charge run relabelled ``task=audit`` (the exact
    envelope, and a forged one) neither join a requeue filtered on ``audit`` nor offer a
    requeue when nothing vouches for them."""
    charge = dispatch(app, "charge_card", {"amount": 10}, tenant_id=3)
    relay = Relay(ops_settings, engine=engine)
    relay.run_once()
    relay.sender.close()
    genuine = fail_into_dlq(engine, sqs, ops_settings, "critical", {charge})[charge]
    relabelled = {
        **envelope.message_attributes(charge, "audit", 3),
        "reason": {"DataType": "String", "StringValue": "permanent-error"},
    }
    forged = {**json.loads(genuine["Body"]), "payload": json.dumps({"amount": 1_000_000})}
    sqs.send_message(
        QueueUrl=queues["critical-dlq"], MessageBody=json.dumps(forged), MessageAttributes=relabelled
    )
    with serve(dashboard_users=USERS, dashboard_actions=True) as client:
        csrf = logged_in(client, ALICE)
        page = client.get("/dlq", params={"messages": "yes"}).text
        origins = re.findall(r'<td class="origin-(\w+)">', page)
        assert sorted(origins) == ["ledger", "unverified"]
        assert "claims task audit" in page
        assert page.count('data-action="dlq-requeue"') == 2  # the ledger copy's button, and "matching"
        assert (
            cells(client.get("/dlq", params={"messages": "yes", "task": "audit"}).text, "data-run-id") == {}
        )
        audit = client.post(
            "/actions/dlq-requeue", data={"csrf_token": csrf, "task": "audit", "confirmed": "yes"}
        )
        assert "no dead-lettered run matches" in audit.text and status_of(engine, charge) == "failed"
        opted = client.get("/dlq", params={"messages": "yes", "include_unverified": "yes"}).text
        assert opted.count('data-action="dlq-requeue"') == 3  # the unverified copy too, on request
    assert len(receive_all(sqs, queues["critical-dlq"], expect=2, timeout=10)) == 2
