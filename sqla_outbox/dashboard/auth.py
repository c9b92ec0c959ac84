"""Who is looking, what they may do, and whether a form really came from the dashboard.

**Authentication.** Each request is authenticated once, before any page runs, by the
application's access middleware (:meth:`Auth.resolve`, in a thread: it may read the
session table), which stores the :class:`Identity` in the request's scope; every page and
action reads it through :meth:`Auth.identity`. A request may carry:

* ``Authorization: Bearer <token>``: an operator's own token (``dashboard_users`` entries
  with ``sha256=``) or the shared ``dashboard_token`` (the operator named ``token``);
* ``Authorization: Basic ...`` (``dashboard_basic_auth``): the user name is the operator's;
* the session cookie set by the login page, where the operator types their token;
* a reverse proxy's user header (``dashboard_proxy_user_header``), trusted only from
  ``dashboard_proxy_addresses`` (the request's TCP peer);
* for an application that mounts the dashboard behind its own authentication and
  configures none of the above: its ``identify`` hook, which returns the operator's name
  (role ``operator``), an :class:`~sqla_outbox.operators.Operator` (name, role,
  tenants), or None to refuse the request (401).

Without any of them (``python -m sqla_outbox dashboard`` on a loopback address) every
viewer is ``anonymous``, a viewer. Secrets are compared in constant time
(:func:`hmac.compare_digest`); tokens are matched by their SHA-256.

**Roles** (:data:`sqla_outbox.operators.ROLES`): a ``viewer`` reads, never sees payloads
or handler results, never acts; an ``operator`` acts (when actions are enabled) and sees
payloads when ``dashboard_show_payloads`` is on. An identity restricted to tenants sees
only the pages that apply the restriction (:meth:`Auth.allow_tenant_scoped` lists them:
a page added without it refuses such an identity, 403) and acts only through actions that
apply it (:attr:`~sqla_outbox.dashboard.actions.Action.tenant_scoped`).

**Sessions** (:mod:`sqla_outbox.dashboard.sessions`) live in PostgreSQL; the cookie
(``sqla_outbox_dashboard``, ``HttpOnly``, ``SameSite=Strict``, ``Secure`` with
``dashboard_secure_cookies``) holds a random key and nothing else. A session opened by a
token is valid while its row is (server-side expiry, deleted by signing out) and while
the credential that opened it is still configured (its fingerprint, an HMAC-SHA256 of
the credential, is compared at every request: rotating the token ends its sessions).
Browsers authenticated per request (basic auth, a proxy, the host application) get a
session too, on their first page, to carry their CSRF token; it is valid only together
with the same identity.

**CSRF.** Every state-changing request (a POST) must carry the session's CSRF token, in
the form field ``csrf_token`` or the ``X-CSRF-Token`` header (the synchronizer token
pattern, OWASP CSRF Prevention Cheat Sheet), and must not come from another site
(``Sec-Fetch-Site: cross-site`` is refused). The login form, before any session exists,
carries a token that must equal the one in its own cookie (``sqla_outbox_login``: a
double-submit cookie). A forged form on another site has neither the token nor, with
``SameSite=Strict``, the cookies; basic-auth credentials that the browser would send along
are not enough. A request authenticated by ``Authorization: Bearer`` needs no CSRF token: a
browser never attaches that header by itself, so another site cannot make one.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import hashlib
import hmac
import ipaddress
import logging
import re
from collections.abc import Callable
from typing import Any

from sqlalchemy.engine import Engine
from starlette.requests import Request
from starlette.responses import Response

from sqla_outbox import errors, operators
from sqla_outbox.config import OutboxSettings
from sqla_outbox.dashboard import sessions
from sqla_outbox.logging import log_extra
from sqla_outbox.operators import Operator

logger = logging.getLogger(__name__)

SESSION_COOKIE = "sqla_outbox_dashboard"
LOGIN_COOKIE = "sqla_outbox_login"
CSRF_FIELD = "csrf_token"
CSRF_HEADER = "x-csrf-token"
IDENTITY_KEY = "sqla_outbox.identity"
"""Where the access middleware leaves the request's :class:`Identity` (ASGI scope)."""
NAME_MAX_CHARS = 64

Identify = Callable[[Request], "str | Operator | None"]
"""A host application's hook: the operator (a name, or an :class:`Operator` with a role and
tenants) for a request, or None to refuse it."""

_FINGERPRINT_LABEL = b"sqla_outbox dashboard session"
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
    """Who is making a request, and what they may do.

    Attributes:
        name: The operator's name as shown and recorded.
        method: ``token`` (the shared token), ``user`` (their own token), ``basic``,
            ``proxy``, ``host`` (the mounting application named them) or ``anonymous``.
        role: ``viewer`` or ``operator``.
        tenants: The tenants they are restricted to; None: every tenant.
        csrf: The CSRF token of their session (None without one).
        session_key: The key of their session cookie (never shown).
        bearer: Authenticated by ``Authorization: Bearer`` (no CSRF token needed).
        credential: Fingerprint of the credential that authenticated them (never shown).
    """

    name: str
    method: str
    role: str = "operator"
    tenants: frozenset[int] | None = None
    csrf: str | None = dataclasses.field(default=None, repr=False)
    session_key: str | None = dataclasses.field(default=None, repr=False)
    bearer: bool = False
    credential: str = dataclasses.field(default="", repr=False)

    @property
    def authenticated(self) -> bool:
        return self.method != "anonymous"

    @property
    def can_act(self) -> bool:
        """An authenticated operator (actions must also be enabled)."""
        return self.authenticated and self.role == "operator"

    def sees_payloads(self, settings: OutboxSettings) -> bool:
        """Payloads, results and receivers' answers are shown: operators only, and only
        with ``dashboard_show_payloads``."""
        return self.can_act and settings.dashboard_show_payloads

    def allows_tenant(self, tenant_id: int | None) -> bool:
        """Whether this identity may see runs of ``tenant_id`` (None: platform runs, which
        no identity restricted to tenants sees)."""
        return self.tenants is None or (tenant_id is not None and tenant_id in self.tenants)

    @property
    def actor(self) -> str:
        """What the run trail records as the ``worker_id`` of an action: ``dashboard:<name>``."""
        return f"dashboard:{self.name}"


ANONYMOUS = Identity("anonymous", "anonymous", role="viewer")


def fingerprint(method: str, name: str, secret: str) -> str:
    """The fingerprint of a credential stored with a session: HMAC-SHA256 keyed by the
    credential (the token, the password, a token's hash) over the method and name. It
    reveals nothing of the credential and changes when the credential does."""
    message = _FINGERPRINT_LABEL + b"\n" + method.encode() + b"\n" + name.encode("utf-8", "surrogatepass")
    return hmac.new(secret.encode("utf-8", "surrogatepass"), message, hashlib.sha256).hexdigest()


class Auth:
    """The dashboard's authentication, roles and CSRF rules for one application.

    Args:
        settings: ``dashboard_token``, ``dashboard_users``, ``dashboard_basic_auth``,
            ``dashboard_proxy_*``, ``dashboard_session_max_age_seconds``,
            ``dashboard_secure_cookies``.
        identify: Host application's hook naming the operator, used only when the
            settings configure no authentication of the dashboard's own.
        secure_cookies: Mark cookies ``Secure`` (also when ``dashboard_secure_cookies``).

    Raises:
        ConfigurationError: ``dashboard_proxy_user_header`` without
            ``dashboard_proxy_addresses``.
    """

    def __init__(self, settings: OutboxSettings, *, identify: Identify | None, secure_cookies: bool) -> None:
        self.settings = settings
        self.token = settings.dashboard_token
        self.basic: tuple[str, str] | None = None
        if settings.dashboard_basic_auth:
            user, _, password = settings.dashboard_basic_auth.partition(":")
            self.basic = (user, password)
        self.operators = {o.name: o for o in map(operators.parse_operator, settings.dashboard_users)}
        self.proxy_header = (settings.dashboard_proxy_user_header or "").lower() or None
        self.proxy_networks = [
            ipaddress.ip_network(n.strip(), strict=False) for n in settings.dashboard_proxy_addresses
        ]
        if self.proxy_header and not self.proxy_networks:
            raise errors.ConfigurationError(
                "a proxy user header is trusted only from the proxy's addresses: set "
                "SQLA_OUTBOX_DASHBOARD_PROXY_ADDRESSES (e.g. 127.0.0.1)",
                option="SQLA_OUTBOX_DASHBOARD_PROXY_USER_HEADER",
            )
        self.identify = identify
        self.secure_cookies = secure_cookies or settings.dashboard_secure_cookies
        self.max_age = settings.dashboard_session_max_age_seconds
        self.read_engine: Callable[[], Engine] | None = None
        self.write_engine: Callable[[], Engine] | None = None
        self.tenant_pages: set[Any] = set()

    def bind(self, *, read: Callable[[], Engine], write: Callable[[], Engine]) -> None:
        """The engines sessions are read and written with (the dashboard's)."""
        self.read_engine, self.write_engine = read, write

    def allow_tenant_scoped(self, *endpoints: Any) -> None:
        """Declare pages that apply an identity's tenant restriction themselves; any other
        page refuses an identity restricted to tenants (403)."""
        self.tenant_pages.update(endpoints)

    @property
    def required(self) -> bool:
        """The dashboard checks credentials itself (any of its own methods is configured)."""
        return bool(self.token or self.basic or self.proxy_header or self._token_operators())

    @property
    def uses_login_page(self) -> bool:
        """A token (shared or an operator's) can be typed on the login page."""
        return self.token is not None or bool(self._token_operators())

    def _token_operators(self) -> list[Operator]:
        return [o for o in self.operators.values() if o.token_sha256 is not None]

    # --- the identity of a request -------------------------------------------------------
    def identity(self, request: Request) -> Identity:
        """Who makes ``request``, as the access middleware found (every page calls this).

        Raises:
            Unauthenticated: The dashboard requires credentials and none valid came.
            Forbidden: The identity is restricted to tenants and this page does not apply
                the restriction.
            sqlalchemy.exc.DBAPIError: The session table could not be read.
        """
        found = request.scope.get(IDENTITY_KEY)
        if isinstance(found, BaseException):
            raise found
        if not isinstance(found, Identity):
            raise Unauthenticated  # not seen by the access middleware: refuse
        endpoint = request.scope.get("endpoint")
        if found.tenants is not None and endpoint is not None and endpoint not in self.tenant_pages:
            raise Forbidden(
                "this page shows every tenant's work; an operator restricted to tenants "
                f"({', '.join(str(t) for t in sorted(found.tenants))}) sees the Runs and DLQ pages"
            )
        return found

    def resolve(self, request: Request) -> Identity:
        """Authenticate ``request`` (blocking: may read the session table; the access
        middleware calls it in a thread).

        Returns:
            The :class:`Identity`; ``needs_session`` (:meth:`needs_session`) tells the
            caller to open a session for it.

        Raises:
            Unauthenticated: The dashboard requires credentials and none valid came (a
                wrong Bearer or Basic credential, an expired or revoked session, a proxy
                header from an address that is not the proxy's).
        """
        header = request.headers.get("authorization", "")
        scheme, _, value = header.partition(" ")
        scheme = scheme.lower()
        if scheme == "bearer" and self.required:
            found = self._by_token(value.strip())
            if found is None:
                raise Unauthenticated
            return dataclasses.replace(found, bearer=True)
        per_request: Identity | None = None
        if scheme == "basic" and self.basic is not None:
            user, password = _basic_credentials(value)
            if user is None or not (_same(user, self.basic[0]) & _same(password or "", self.basic[1])):
                raise Unauthenticated
            name = clean_name(user, "basic")
            per_request = Identity(name, "basic", credential=fingerprint("basic", name, self.basic[1]))
        elif self.proxy_header is not None and request.headers.get(self.proxy_header) is not None:
            per_request = self._by_proxy(request)
        elif not self.required and self.identify is not None:
            per_request = self._by_hook(request)
        key = request.cookies.get(SESSION_COOKIE, "")
        sessions_used = self.required or self.identify is not None  # anonymous mode has none
        stored = self._session(key) if key and sessions_used else None
        if per_request is not None:  # a session only carries its CSRF token
            if stored is not None and (stored.method, stored.operator, stored.credential) == (
                per_request.method,
                per_request.name,
                per_request.credential,
            ):
                return dataclasses.replace(per_request, csrf=stored.csrf_token, session_key=key)
            return per_request
        if stored is not None:
            signed_in = self._signed_in(stored)
            if signed_in is not None:
                return dataclasses.replace(signed_in, csrf=stored.csrf_token, session_key=key)
        if self.required or self.identify is not None:
            raise Unauthenticated
        return ANONYMOUS

    def needs_session(self, identity: Identity) -> bool:
        """A browser authenticated per request (basic, proxy, host) without a session yet:
        it needs one for its CSRF token."""
        return identity.method in ("basic", "proxy", "host") and identity.session_key is None

    def _by_token(self, token: str) -> Identity | None:
        if not token:
            return None
        if self.token is not None and _same(token, self.token):
            return Identity("token", "token", credential=fingerprint("token", "token", self.token))
        for operator in self._token_operators():
            if operator.token_matches(token):
                assert operator.token_sha256 is not None
                return Identity(
                    operator.name,
                    "user",
                    operator.role,
                    operator.tenants,
                    credential=fingerprint("user", operator.name, operator.token_sha256),
                )
        return None

    def _by_proxy(self, request: Request) -> Identity:
        peer = request.client.host if request.client else ""
        try:
            address = ipaddress.ip_address(peer)
        except ValueError:
            address = None
        if address is None or not any(
            address.version == n.version and address in n for n in self.proxy_networks
        ):
            logger.warning(
                "proxy user header from an address that is not the proxy's: refused",
                extra=log_extra(action="dashboard.proxy_refused", peer=peer[:64]),
            )
            raise Unauthenticated
        assert self.proxy_header is not None
        name = request.headers.get(self.proxy_header, "").strip()
        if not name or len(name) > NAME_MAX_CHARS or any(ord(c) < 32 for c in name):
            raise Unauthenticated
        listed = self.operators.get(name)
        if listed is not None and listed.token_sha256 is None:
            return Identity(
                name, "proxy", listed.role, listed.tenants, credential=fingerprint("proxy", name, "")
            )
        role = self.settings.dashboard_proxy_default_role
        if listed is not None or role == "none":  # a token user is not named by the proxy
            raise Unauthenticated
        return Identity(name, "proxy", role, credential=fingerprint("proxy", name, ""))

    def _by_hook(self, request: Request) -> Identity:
        assert self.identify is not None
        named = self.identify(request)
        if not named:
            raise Unauthenticated
        if isinstance(named, Operator):
            name, role, tenants = named.name, named.role, named.tenants
        else:
            name, role, tenants = str(named), "operator", None
        name = clean_name(name, "operator")
        return Identity(name, "host", role, tenants, credential=fingerprint("host", name, role))

    def _session(self, key: str) -> sessions.Session | None:
        assert self.read_engine is not None, "Auth.bind() was not called"
        with self.read_engine().connect() as connection:
            return sessions.find(connection, key)

    def _signed_in(self, stored: sessions.Session) -> Identity | None:
        """The identity of a session opened on the login page, if its credential is still
        the configured one."""
        if stored.method == "token" and self.token is not None:
            current = fingerprint("token", "token", self.token)
            if _same(current, stored.credential):
                return Identity("token", "token", credential=current)
        if stored.method == "user":
            operator = self.operators.get(stored.operator)
            if operator is not None and operator.token_sha256 is not None:
                current = fingerprint("user", operator.name, operator.token_sha256)
                if _same(current, stored.credential):
                    return Identity(
                        operator.name, "user", operator.role, operator.tenants, credential=current
                    )
        return None

    # --- sessions ------------------------------------------------------------------------
    def start_session(self, identity: Identity) -> Identity:
        """Open a session for ``identity`` (blocking: writes ``dashboard_sessions``)."""
        assert self.write_engine is not None, "Auth.bind() was not called"
        key, csrf = sessions.create(
            self.write_engine(),
            operator=identity.name,
            method=identity.method,
            credential=identity.credential,
            max_age_seconds=self.max_age,
        )
        return dataclasses.replace(identity, csrf=csrf, session_key=key)

    def log_in(self, token: str) -> Identity | None:
        """Check a token from the login form; on success open a session (blocking).

        Returns:
            The signed-in identity (with its session), or None for a wrong token.
        """
        found = self._by_token(token)
        if found is None:
            return None
        return self.start_session(found)

    def log_out(self, identity: Identity) -> None:
        """End the identity's session (blocking: deletes its row)."""
        if identity.session_key:
            assert self.write_engine is not None, "Auth.bind() was not called"
            sessions.end(self.write_engine(), identity.session_key)

    def set_session_cookie(self, response: Response, request: Request, key: str) -> None:
        response.set_cookie(
            SESSION_COOKIE,
            key,
            max_age=self.max_age,
            path=_cookie_path(request),
            secure=self.secure_cookies,
            httponly=True,
            samesite="strict",
        )

    def clear_session_cookie(self, response: Response, request: Request) -> None:
        response.delete_cookie(
            SESSION_COOKIE,
            path=_cookie_path(request),
            secure=self.secure_cookies,
            httponly=True,
            samesite="strict",
        )

    # --- CSRF ----------------------------------------------------------------------------
    def csrf_token(self, request: Request) -> str:
        """The CSRF token for this page's forms: the session's, else the login form's (from
        its cookie; :meth:`login_csrf` sets one), else "" (nothing to post)."""
        found = request.scope.get(IDENTITY_KEY)
        if isinstance(found, Identity) and found.csrf:
            return found.csrf
        return request.scope.get("sqla_outbox.login_csrf") or request.cookies.get(LOGIN_COOKIE, "")

    def login_csrf(self, request: Request, response: Response) -> None:
        """Give the login form its double-submit token (cookie and field agree)."""
        token = request.scope.get("sqla_outbox.login_csrf")
        if token:
            response.set_cookie(
                LOGIN_COOKIE,
                token,
                max_age=3600,
                path=_cookie_path(request),
                secure=self.secure_cookies,
                httponly=True,
                samesite="strict",
            )

    def prepare_login_csrf(self, request: Request) -> str:
        """The login form's token: the cookie's when it has a usable one, else a new one
        (then set by :meth:`login_csrf`)."""
        current = request.cookies.get(LOGIN_COOKIE, "")
        if len(current) >= 32:
            return current
        fresh = sessions.new_csrf_token()
        request.scope["sqla_outbox.login_csrf"] = fresh
        return fresh

    def check_login_csrf(self, request: Request, submitted: str | None) -> None:
        """Refuse a login form that lacks the token of its own cookie, or comes from
        another site.

        Raises:
            Forbidden: Cross-site, or the field and the cookie do not match.
        """
        _refuse_cross_site(request)
        expected = request.cookies.get(LOGIN_COOKIE, "")
        if len(expected) < 32 or not submitted or not _same(submitted, expected):
            raise Forbidden("missing or invalid CSRF token; reload the page and try again")

    def check_csrf(self, request: Request, submitted: str | None) -> None:
        """Refuse a state-changing request that lacks the session's CSRF token.

        Raises:
            Forbidden: No or a wrong token, no session, or a cross-site request.
        """
        _refuse_cross_site(request)
        identity = self.identity(request)
        if identity.bearer:
            return
        given = submitted or request.headers.get(CSRF_HEADER)
        if not identity.csrf or not given or not _same(given, identity.csrf):
            raise Forbidden("missing or invalid CSRF token; reload the page and try again")


def clean_name(raw: str | None, default: str) -> str:
    """An operator name safe to record: disallowed characters become ``_``, at most
    :data:`NAME_MAX_CHARS`; ``default`` when nothing is left."""
    name = _NAME.sub("_", (raw or "").strip())[:NAME_MAX_CHARS].strip()
    return name or default


def _refuse_cross_site(request: Request) -> None:
    if request.headers.get("sec-fetch-site", "").lower() == "cross-site":
        raise Forbidden("cross-site request refused")


def _cookie_path(request: Request) -> str:
    return str(request.scope.get("root_path", "")).rstrip("/") + "/"


def _same(given: str, expected: str) -> bool:
    return hmac.compare_digest(
        given.encode("utf-8", "surrogatepass"), expected.encode("utf-8", "surrogatepass")
    )


def _basic_credentials(value: str) -> tuple[str | None, str | None]:
    try:
        decoded = base64.b64decode(value.strip(), validate=True).decode()
    except (binascii.Error, UnicodeDecodeError):
        return None, None
    user, colon, password = decoded.partition(":")
    return (user, password) if colon else (None, None)
