"""The dashboard's sessions, kept in PostgreSQL (``dashboard_sessions``, sqlaob_0009).

A session is a row; the browser holds only a random key in its cookie (32 bytes from
``secrets.token_urlsafe``: OWASP Session Management Cheat Sheet, at least 64 bits of
entropy). The row is found by the key's SHA-256, so neither a reader of the table nor of
the cookie can make a session of their own, and nothing derived from a credential or a
signing key ever reaches the browser. What the row holds (who, how they signed in, the
fingerprint of the credential, the CSRF token, the expiry) is read back at every request:

* **expiry** is checked on the server against the database clock (``expires_at >
  clock_timestamp()``), whatever the cookie's own ``Max-Age`` says;
* **signing out** deletes the row (the cookie is then worth nothing);
* **rotating the credential** ends the sessions it opened: the caller compares the
  row's ``credential`` with the fingerprint of the credential configured now.

Creating a session also deletes rows that expired (at most :data:`CLEANUP_BATCH` per
sign-in, through the ``expires_at`` index), so the table holds live sessions only.
"""

from __future__ import annotations

import dataclasses
import hashlib
import secrets

from sqlalchemy import Integer, bindparam, text
from sqlalchemy.engine import Connection, Engine

COOKIE_BYTES = 32
"""Random bytes of a session key."""

CLEANUP_BATCH = 1000
"""Most expired rows deleted per session created."""

_CREATE = text(
    """
INSERT INTO dashboard_sessions (id, operator, method, credential, csrf_token, expires_at)
VALUES (:id, :operator, :method, :credential, :csrf, clock_timestamp() + make_interval(secs => :max_age))
"""
).bindparams(bindparam("max_age", type_=Integer))
_CLEANUP = text(
    """
DELETE FROM dashboard_sessions WHERE id IN (
    SELECT id FROM dashboard_sessions WHERE expires_at <= clock_timestamp() LIMIT :batch
)
"""
).bindparams(bindparam("batch", type_=Integer))
_FIND = text(
    "SELECT operator, method, credential, csrf_token FROM dashboard_sessions "
    "WHERE id = :id AND expires_at > clock_timestamp()"
)
_DELETE = text("DELETE FROM dashboard_sessions WHERE id = :id")


@dataclasses.dataclass(frozen=True)
class Session:
    """A live session row.

    Attributes:
        operator: The operator's name. method: How they signed in (``token``, ``user``,
            ``basic``, ``proxy``, ``host``). credential: Fingerprint of the credential
            that opened it. csrf_token: The session's CSRF token.
    """

    operator: str
    method: str
    credential: str
    csrf_token: str


def key_id(key: str) -> str:
    """The row id of a session key: its SHA-256, hex."""
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).hexdigest()


def create(
    engine: Engine, *, operator: str, method: str, credential: str, max_age_seconds: int
) -> tuple[str, str]:
    """Start a session; returns ``(key for the cookie, CSRF token)``.

    Args:
        engine: The outbox database (a connection that may write ``dashboard_sessions``).
        operator / method / credential: Stored in the row (see :class:`Session`).
        max_age_seconds: Lifetime, from now on the database clock.
    """
    key, csrf = secrets.token_urlsafe(COOKIE_BYTES), secrets.token_urlsafe(COOKIE_BYTES)
    with engine.begin() as connection:
        connection.execute(_CLEANUP, {"batch": CLEANUP_BATCH})
        connection.execute(
            _CREATE,
            {
                "id": key_id(key),
                "operator": operator,
                "method": method,
                "credential": credential,
                "csrf": csrf,
                "max_age": max_age_seconds,
            },
        )
    return key, csrf


def find(connection: Connection, key: str) -> Session | None:
    """The live session of ``key`` (not expired, on the database clock), or None."""
    if not key or len(key) > 200:
        return None
    row = connection.execute(_FIND, {"id": key_id(key)}).one_or_none()
    return None if row is None else Session(row.operator, row.method, row.credential, row.csrf_token)


def end(engine: Engine, key: str) -> None:
    """Delete the session of ``key`` (signing out); nothing when there is none."""
    if key and len(key) <= 200:
        with engine.begin() as connection:
            connection.execute(_DELETE, {"id": key_id(key)})


def new_csrf_token() -> str:
    """A CSRF token for a browser before it signs in (the login form's)."""
    return secrets.token_urlsafe(COOKIE_BYTES)
