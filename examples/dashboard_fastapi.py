"""The sqla_outbox dashboard mounted inside a FastAPI application, behind the application's
own authentication (``docs/dashboard.md``; tested by ``tests/integration/test_dashboard.py``).

Run it::

    SQLA_OUTBOX_DATABASE_URL=postgresql://... SQLA_OUTBOX_DASHBOARD_ACTIONS=true \\
    SHOP_STAFF_KEYS=alice:a-long-random-key uvicorn --factory examples.dashboard_fastapi:create_app

then open http://127.0.0.1:8000/outbox/ with ``Authorization: Bearer a-long-random-key``.

The authentication here is a stand-in (API keys from an environment variable); use your
application's own: a session cookie from its login page, an OAuth/OIDC middleware, or the
user header of an authenticating proxy. Whatever it is, it sets ``request.scope["user"]``
(Starlette's ``AuthenticationMiddleware`` does) and grants the ``outbox:operate`` scope to
the people who may act on the dashboard (``outbox:read`` to those who may only look);
:func:`operator` turns that into the dashboard's operator (name and role: the name is
recorded with each action), or None to refuse the request (401).
"""

from __future__ import annotations

import contextlib
import hmac
import os
from collections.abc import AsyncIterator

from fastapi import FastAPI
from starlette.authentication import AuthCredentials, AuthenticationBackend, BaseUser, SimpleUser
from starlette.middleware.authentication import AuthenticationMiddleware
from starlette.requests import HTTPConnection, Request

import sqla_outbox.dashboard
from sqla_outbox import OutboxSettings
from sqla_outbox.operators import Operator


class StaffKeys(AuthenticationBackend):
    """``Authorization: Bearer <key>`` → the staff member that key belongs to."""

    def __init__(self, keys: dict[str, str]) -> None:
        self.keys = keys  # key -> user name

    async def authenticate(self, conn: HTTPConnection) -> tuple[AuthCredentials, BaseUser] | None:
        scheme, _, key = conn.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer":
            return None
        for known, user in self.keys.items():
            if hmac.compare_digest(key.encode(), known.encode()):
                return AuthCredentials(["authenticated", "outbox:operate"]), SimpleUser(user)
        return None


def operator(request: Request) -> Operator | None:
    """The dashboard's ``identify`` hook: who is asking and their role, or None to refuse (401).
    (Returning a plain name makes them an ``operator``; ``Operator(..., tenants=...)`` would
    restrict them to some tenants.)"""
    user = request.scope.get("user")
    if user is None or not user.is_authenticated:
        return None
    if "outbox:operate" in request.auth.scopes:
        return Operator(str(user.display_name), "operator")
    if "outbox:read" in request.auth.scopes:
        return Operator(str(user.display_name), "viewer")
    return None


def staff_keys_from_env() -> dict[str, str]:
    """``SHOP_STAFF_KEYS=alice:key1,bob:key2`` → ``{"key1": "alice", "key2": "bob"}``."""
    pairs = (item.partition(":") for item in os.environ.get("SHOP_STAFF_KEYS", "").split(",") if item)
    return {key: user for user, _, key in pairs if user and key}


def create_app(settings: OutboxSettings | None = None, staff_keys: dict[str, str] | None = None) -> FastAPI:
    """The application: its own routes, and the dashboard under ``/outbox``."""
    settings = settings or OutboxSettings.from_env()
    dashboard = sqla_outbox.dashboard.create_app(
        settings,
        identify=operator,  # the application's authentication decides; the dashboard records the name
    )

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        dashboard.state.dashboard.close()  # a mounted app gets no lifespan events of its own

    app = FastAPI(lifespan=lifespan)
    app.add_middleware(AuthenticationMiddleware, backend=StaffKeys(staff_keys or staff_keys_from_env()))

    @app.get("/health")
    def health() -> dict[str, str]:
        return {"status": "ok"}

    app.mount("/outbox", dashboard)
    return app
