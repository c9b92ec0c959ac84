"""``python -m sqla_outbox dashboard``: serve the web dashboard with uvicorn."""

from __future__ import annotations

import ipaddress
import signal
from typing import Any

import click

from sqla_outbox import errors
from sqla_outbox.cli.options import (
    common_options,
    handle_errors,
    load_settings,
    outbox_engine,
    setting,
    setup_logging,
)
from sqla_outbox.cli.terminal import echo
from sqla_outbox.config import OutboxSettings


def is_loopback(host: str) -> bool:
    """Whether ``host`` names only this machine (``localhost``, 127.0.0.0/8, ``::1``)."""
    if host.strip().lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip().strip("[]")).is_loopback
    except ValueError:
        return False


LOOPBACK_NAMES = ("127.0.0.1", "localhost", "::1")
"""The ``Host`` names a dashboard served on a loopback address answers by default."""


def authenticates(settings: OutboxSettings) -> bool:
    """Whether the settings give the dashboard authentication of its own: a token, an
    operator with their own token, basic auth, or a reverse proxy's user header."""
    own_tokens = any(":sha256=" in entry for entry in settings.dashboard_users)
    return bool(
        settings.dashboard_token
        or own_tokens
        or settings.dashboard_basic_auth
        or settings.dashboard_proxy_user_header
    )


def served_settings(settings: OutboxSettings) -> OutboxSettings:
    """The settings the command serves with: on a loopback address without
    ``dashboard_allowed_hosts``, only the loopback names are answered (a page of another
    site whose name is made to resolve to 127.0.0.1, DNS rebinding, is refused)."""
    if settings.dashboard_allowed_hosts or not is_loopback(settings.dashboard_host):
        return settings
    return settings.replace(dashboard_allowed_hosts=LOOPBACK_NAMES)


def check_exposure(settings: OutboxSettings) -> None:
    """Refuse to serve the dashboard where it would be open to others.

    Raises:
        ConfigurationError: It listens on a non-loopback address without authentication,
            or actions are enabled without it (nobody could be named as who did them).
    """
    authenticated = authenticates(settings)
    if not authenticated and not is_loopback(settings.dashboard_host):
        raise errors.ConfigurationError(
            f"the dashboard would listen on {settings.dashboard_host} without authentication; set "
            "SQLA_OUTBOX_DASHBOARD_USERS (operators with their own tokens), "
            "SQLA_OUTBOX_DASHBOARD_TOKEN, SQLA_OUTBOX_DASHBOARD_BASIC_AUTH or "
            "SQLA_OUTBOX_DASHBOARD_PROXY_USER_HEADER, or listen on 127.0.0.1",
            option="SQLA_OUTBOX_DASHBOARD_HOST",
        )
    if settings.dashboard_actions and not authenticated:
        raise errors.ConfigurationError(
            "actions need an authenticated operator; set SQLA_OUTBOX_DASHBOARD_USERS, "
            "SQLA_OUTBOX_DASHBOARD_TOKEN, SQLA_OUTBOX_DASHBOARD_BASIC_AUTH or "
            "SQLA_OUTBOX_DASHBOARD_PROXY_USER_HEADER (or mount the dashboard in your application "
            "with identify=)",
            option="SQLA_OUTBOX_DASHBOARD_ACTIONS",
        )


@click.command("dashboard")
@common_options
@setting("dashboard_host", "--host")
@setting("dashboard_port", "--port", type=int)
@setting("dashboard_actions", "--actions/--read-only", default=None)
@setting("dashboard_show_payloads", "--show-payloads/--hide-payloads", default=None)
@setting("dashboard_secure_cookies", "--secure-cookies/--plain-cookies", default=None)
@setting("catalog_path", "--catalog")
def dashboard_command(verbose: int, log_format: str, traceback: bool, **options: Any) -> None:
    """Serve the web dashboard: overview, runs, DLQ, schedules, controls.

    Read-only unless --actions. Credentials come from the environment only
    (SQLA_OUTBOX_DASHBOARD_USERS, SQLA_OUTBOX_DASHBOARD_TOKEN,
    SQLA_OUTBOX_DASHBOARD_BASIC_AUTH), never from flags, which other users of the machine
    can read. On a loopback address it answers only the Host names 127.0.0.1, localhost and
    ::1 unless SQLA_OUTBOX_DASHBOARD_ALLOWED_HOSTS says otherwise. Stops on SIGTERM or
    Ctrl-C (exit 0) once the requests in progress are answered.
    """
    setup_logging(verbose, log_format)
    with handle_errors(traceback):
        settings = served_settings(load_settings(**options))
        check_exposure(settings)
        try:
            import uvicorn

            from sqla_outbox.dashboard import create_app
        except ImportError as exc:
            raise errors.ConfigurationError(
                f"the dashboard needs its extra ({exc.name} is missing): pip install 'sqla-outbox[dashboard]'"
            ) from None
        with outbox_engine(settings):  # the database answers and is migrated, before serving
            pass
        app = create_app(settings)
        auth = " and ".join(
            name
            for name, on in (
                ("operators' tokens", any(":sha256=" in e for e in settings.dashboard_users)),
                ("token", settings.dashboard_token),
                ("basic auth", settings.dashboard_basic_auth),
                ("proxy user header", settings.dashboard_proxy_user_header),
            )
            if on
        )
        mode = "actions enabled" if settings.dashboard_actions else "read-only"
        host = settings.dashboard_host
        shown = f"[{host}]" if ":" in host else host
        echo(
            f"dashboard on http://{shown}:{settings.dashboard_port}/ ({mode}; "
            f"{'authentication: ' + auth if auth else 'no authentication: loopback only'})",
            err=True,
        )
        # uvicorn stops on SIGTERM/SIGINT after the open requests, then raises the signal
        # again under the handlers it found: make those a no-op, so the command exits 0
        for stop_signal in (signal.SIGTERM, signal.SIGINT):
            signal.signal(stop_signal, lambda signum, frame: None)
        try:
            uvicorn.run(
                app,
                host=host,
                port=settings.dashboard_port,
                log_config=None,
                access_log=False,
                server_header=False,
                proxy_headers=False,  # the TCP peer is the client: dashboard_proxy_addresses checks it
            )
        finally:
            app.state.dashboard.close()
