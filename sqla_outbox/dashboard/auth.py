"""Who is looking, and whether a form really came from the dashboard (CSRF).

**Authentication.** When the settings give a token (``SQLA_OUTBOX_DASHBOARD_TOKEN``) or
basic credentials (``SQLA_OUTBOX_DASHBOARD_BASIC_AUTH``), every request must carry one
of them:

* ``Authorization: Bearer <token>`` (scripts, probes);
* ``Authorization: Basic ...`` (the browser asks for it when basic auth is the only
  method); the user name is the operator's name;
* the session cookie set by the login page, where the operator types the token and the
  name recorded for their actions.

Secrets are compared in constant time (:func:`hmac.compare_digest`). Without either
setting the dashboard has no authentication of its own. An application that mounts it
behind its own passes an ``identify`` hook: it returns the operator's name for a request
(from ``request.scope["user"]``, its session, ...) or None, which refuses the request
(401). Without a hook either, every viewer is anonymous: that is for ``python -m
sqla_outbox dashboard`` on a loopback address. An anonymous viewer can read but never
act: an action needs a name to record.

**Sessions** are Starlette's signed cookies (``SessionMiddleware``, itsdangerous), named
``sqla_outbox_dashboard``, ``SameSite=Strict``, HTTP-only. Their signing key is the
application's ``secret_key``, or one derived from the configured token/credentials
(HMAC-SHA256), so replicas agree and rotating the token ends every session; with
neither, a random key per process.

**CSRF.** Every state-changing request (a POST) must carry the session's CSRF token, in
the form field ``csrf_token`` or the ``X-CSRF-Token`` header, and must not come from
another site (``Sec-Fetch-Site: cross-site`` is refused). A forged form on another site
has neither the token nor, with ``SameSite=Strict``, the session cookie; basic-auth
credentials that the browser would send along are not enough. A request authenticated by
``Authorization: Bearer <token>`` needs no CSRF token: a browser never attaches that header
by itself, so another site cannot make one (scripts act with the header alone).
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import hashlib
import hmac
import re
import secrets
from collections.abc import Callable

from starlette.requests import Request

from sqla_outbox.config import OutboxSettings

SESSION_COOKIE = "sqla_outbox_dashboard"
CSRF_FIELD = "csrf_token"
CSRF_HEADER = "x-csrf-token"
NAME_MAX_CHARS = 64

Identify = Callable[[Request], str | None]
"""A host application's hook: the operator's name for a request, or None (anonymous)."""

_NAME = re.compile(r"[^\w .@+\-]")


class Unauthenticated(Exception):
    """The request carries no valid credentials (401, or the login page)."""


class Forbidden(Exception):
    """The request is authenticated but may not do this (403).

    Attributes:
        reason: Shown to the operator.
    """

    def __init__(self, reason: str) -> None:
        self.reason = reason
        super().__init__(reason)


@dataclasses.dataclass(frozen=True)
class Identity:
    """Who is making a request.

    Attributes:
        name: The operator's name as shown and recorded (at most 64 characters of
            letters, digits, space and ``. @ + - _``).
        method: ``token``, ``basic``, ``host`` (the mounting application named them) or
            ``anonymous``.
    """

    name: str
    method: str

    @property
    def authenticated(self) -> bool:
        return self.method != "anonymous"

    @property
    def actor(self) -> str:
        """What the run trail records as the ``worker_id`` of an action: ``dashboard:<name>``."""
        return f"dashboard:{self.name}"


ANONYMOUS = Identity("anonymous", "anonymous")


def clean_name(raw: str | None, default: str) -> str:
    """An operator name safe to record: disallowed characters become ``_``, at most
    :data:`NAME_MAX_CHARS`; ``default`` when nothing is left."""
    name = _NAME.sub("_", (raw or "").strip())[:NAME_MAX_CHARS].strip()
    return name or default


def _fingerprint(secret: str) -> str:
    return hmac.new(secret.encode(), b"sqla_outbox dashboard session", hashlib.sha256).hexdigest()


class Auth:
    """The dashboard's authentication and CSRF rules for one application.

    Args:
        settings: ``dashboard_token`` and ``dashboard_basic_auth``.
        identify: Host application's hook naming the operator (None refuses the
            request), used only when the settings configure no authentication of the
            dashboard's own.
        secret_key: Session signing key; default derived from the credentials (see the
            module docstring).
    """

    def __init__(
        self, settings: OutboxSettings, *, identify: Identify | None, secret_key: str | None
    ) -> None:
        self.token = settings.dashboard_token
        self.basic: tuple[str, str] | None = None
        if settings.dashboard_basic_auth:
            user, _, password = settings.dashboard_basic_auth.partition(":")
            self.basic = (user, password)
        self.identify = identify
        credentials = "\n".join(x for x in (self.token, settings.dashboard_basic_auth) if x)
        if secret_key:
            self.secret_key = secret_key
        elif credentials:
            self.secret_key = _fingerprint(credentials)
        else:
            self.secret_key = secrets.token_urlsafe(32)
        self._token_fingerprint = _fingerprint(self.token) if self.token else None

    @property
    def required(self) -> bool:
        """The dashboard checks credentials itself (a token or basic auth is configured)."""
        return self.token is not None or self.basic is not None

    @property
    def uses_login_page(self) -> bool:
        return self.token is not None

    # --- identity ------------------------------------------------------------------------
    def identity(self, request: Request) -> Identity:
        """Who makes ``request``.

        Raises:
            Unauthenticated: The dashboard requires credentials and none valid came.
        """
        header = request.headers.get("authorization", "")
        scheme, _, value = header.partition(" ")
        if self.required:
            scheme = scheme.lower()
            if scheme == "bearer" and self.token is not None and _same(value.strip(), self.token):
                return Identity(clean_name(request.headers.get("x-operator"), "token"), "token")
            if scheme == "basic" and self.basic is not None:
                user, password = _basic_credentials(value)
                if user is not None and _same(user, self.basic[0]) & _same(password or "", self.basic[1]):
                    return Identity(clean_name(user, "basic"), "basic")
            session = request.session.get("identity")
            if (
                isinstance(session, dict)
                and self._token_fingerprint is not None
                and _same(str(session.get("token", "")), self._token_fingerprint)
            ):
                return Identity(clean_name(str(session.get("name", "")), "token"), "token")
            raise Unauthenticated
        if self.identify is not None:
            name = self.identify(request)
            if not name:
                raise Unauthenticated
            return Identity(clean_name(name, "operator"), "host")
        return ANONYMOUS

    def log_in(self, request: Request, token: str, name: str) -> bool:
        """Check ``token`` from the login form; on success remember the operator in the session."""
        if self.token is None or self._token_fingerprint is None or not _same(token, self.token):
            return False
        request.session["identity"] = {"name": clean_name(name, "token"), "token": self._token_fingerprint}
        request.session.pop("csrf", None)  # a new CSRF token once signed in (no fixation)
        return True

    @staticmethod
    def log_out(request: Request) -> None:
        request.session.pop("identity", None)

    # --- CSRF ----------------------------------------------------------------------------
    @staticmethod
    def csrf_token(request: Request) -> str:
        """The session's CSRF token (created on first use)."""
        token = request.session.get("csrf")
        if not isinstance(token, str) or len(token) < 32:
            token = secrets.token_urlsafe(32)
            request.session["csrf"] = token
        return token

    def _bearer(self, request: Request) -> bool:
        """The request carries ``Authorization: Bearer`` with the configured token."""
        scheme, _, value = request.headers.get("authorization", "").partition(" ")
        return scheme.lower() == "bearer" and self.token is not None and _same(value.strip(), self.token)

    def check_csrf(self, request: Request, submitted: str | None) -> None:
        """Refuse a state-changing request that lacks the session's CSRF token.

        Raises:
            Forbidden: No or a wrong token, no session, or a cross-site request.
        """
        if request.headers.get("sec-fetch-site", "").lower() == "cross-site":
            raise Forbidden("cross-site request refused")
        if self._bearer(request):
            return
        expected = request.session.get("csrf")
        given = submitted or request.headers.get(CSRF_HEADER)
        if not isinstance(expected, str) or not given or not _same(given, expected):
            raise Forbidden("missing or invalid CSRF token; reload the page and try again")


def _same(given: str, expected: str) -> bool:
    return hmac.compare_digest(given.encode(), expected.encode())


def _basic_credentials(value: str) -> tuple[str | None, str | None]:
    try:
        decoded = base64.b64decode(value.strip(), validate=True).decode()
    except (binascii.Error, UnicodeDecodeError):
        return None, None
    user, colon, password = decoded.partition(":")
    return (user, password) if colon else (None, None)
