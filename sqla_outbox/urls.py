"""Database, Valkey and SQS URLs: reading them for psycopg 3, and showing them safely.

:func:`sqlalchemy_url` makes any PostgreSQL URL (an application's asyncpg one included)
a psycopg 3 one; :func:`redact_url` and :func:`redact_text` are the one way sqla_outbox
shows a URL or a message that may hold one, passwords masked. Parsing and rendering are
SQLAlchemy's (``sqlalchemy.engine.make_url``).
"""

from __future__ import annotations

import re
from urllib.parse import urlsplit, urlunsplit

from sqlalchemy import exc as sqlalchemy_exc
from sqlalchemy.engine import make_url

_ASYNCPG_ONLY_OPTIONS = frozenset(
    {
        "prepared_statement_cache_size",
        "statement_cache_size",
        "max_cached_statement_lifetime",
        "max_cacheable_statement_size",
        "command_timeout",
        "timeout",
        "direct_tls",
    }
)
"""asyncpg connection options libpq does not know (asyncpg ``connect()``), dropped when an
asyncpg URL is read for psycopg; ``ssl`` is translated to libpq's ``sslmode`` instead."""

_SSL_TO_SSLMODE = {"true": "require", "false": "disable", "1": "require", "0": "disable"}


def sqlalchemy_url(url: str) -> str:
    """The URL with the psycopg 3 driver: for a bare ``postgresql://``/``postgres://`` URL,
    and for another PostgreSQL driver (``postgresql+asyncpg://``, ``+psycopg2``, ...), so an
    application's own ``DATABASE_URL`` serves sqla_outbox's engines. An asyncpg URL's query
    is made libpq's: ``ssl=require`` becomes ``sslmode=require`` and asyncpg-only options
    (``prepared_statement_cache_size``, ...) are dropped. Other URLs are returned as they
    are (and refused by the settings' validation)."""
    match = re.match(r"^(?:postgresql|postgres)(\+[A-Za-z0-9_]+)?://", url)
    if not match:
        return url
    converted = "postgresql+psycopg://" + url[match.end() :]
    if match.group(1) != "+asyncpg" or "?" not in url:
        return converted
    try:
        parsed = make_url(converted)
    except (sqlalchemy_exc.ArgumentError, ValueError):
        return converted  # refused, with the URL shown, by the settings' validation
    query = {k: v for k, v in parsed.query.items() if k not in _ASYNCPG_ONLY_OPTIONS}
    if "ssl" in query:
        ssl = query.pop("ssl")
        value = ssl[-1] if isinstance(ssl, tuple) else ssl
        query.setdefault("sslmode", _SSL_TO_SSLMODE.get(value.lower(), value))
    return parsed.set(query=query).render_as_string(hide_password=False)


def with_database(url: str, database: str) -> str:
    """``url`` naming ``database`` instead of its own, query (a Unix socket's ``host=``,
    ``sslmode``, ...) kept: ``postgresql://u@h:5432/app?sslmode=require`` →
    ``postgresql://u@h:5432/<database>?sslmode=require``."""
    parts = urlsplit(url)
    return urlunsplit((parts.scheme, parts.netloc, "/" + database, parts.query, parts.fragment))


MASK = "***"
_SECRET_QUERY_KEY = re.compile(r"pass|pwd|secret|token|credential", re.IGNORECASE)
_SECRET_QUERY_PAIR = re.compile(r"(?P<key>[^&=?]*)=(?P<value>[^&]*)")
_URL_IN_TEXT = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://[^\s\"'<>]+")
_SECRET_PAIR_IN_TEXT = re.compile(
    r"(?P<key>\b\w*(?:pass|pwd|secret|token)\w*)(?P<eq>\s*=\s*)(?P<value>'[^']*'|\"[^\"]*\"|[^\s&]+)",
    re.IGNORECASE,
)


def redact_url(url: str) -> str:
    """``url`` with every password masked as ``***``: the one function through which sqla_outbox
    shows a URL (``config``, ``migrate``, ``--check``, logs, error messages).

    Parsing and rendering are SQLAlchemy's (``make_url(...).render_as_string(hide_password=True)``),
    for any scheme (``postgresql``, ``redis``, ``unix``, ``http``), with two rules added because
    SQLAlchemy (like libpq) ends the password at the *first* ``@`` and keeps the query as given:

    * the user-info part runs to the *last* ``@`` before the query string, so the tail of a
      password holding an unescaped ``@`` (``user:p@ss@host``) is masked, not shown as part of
      the host;
    * query parameters whose name says they hold a secret (``password``, ``sslpassword``,
      ``token``, ``secret``, ...) are masked too (libpq and redis-py both read
      ``?password=``).

    Text SQLAlchemy cannot parse is masked by the same two rules without it. Over-masking is
    preferred to a leak: a URL whose query holds an ``@`` before any ``?`` may lose its host.

    Args:
        url: Any text meant to be a URL.

    Returns:
        The URL for display; never the password.
    """
    scheme, separator, rest = url.partition("://")
    if not separator:
        return redact_text(url) if "=" in url else url
    first_at = rest.find("@")
    if first_at >= 0:
        query_at = rest.find("?", first_at)
        last_at = rest.rfind("@", 0, query_at if query_at >= 0 else len(rest))
        user, colon, _ = rest[:last_at].partition(":")
        rest = f"{user}{':' + MASK if colon else ''}@{rest[last_at + 1 :]}"
    try:
        parsed = make_url(f"{scheme}://{rest}")
        query = {
            key: (MASK if _SECRET_QUERY_KEY.search(key) else value) for key, value in parsed.query.items()
        }
        shown = parsed.set(query=query).render_as_string(hide_password=True)
        return shown.replace("=%2A%2A%2A", "=" + MASK)
    except (sqlalchemy_exc.ArgumentError, ValueError, TypeError):
        base, question, query_text = rest.partition("?")
        return f"{scheme}://{base}{question}{_mask_query(query_text)}"


def _mask_query(query: str) -> str:
    return _SECRET_QUERY_PAIR.sub(
        lambda m: f"{m['key']}={MASK}" if _SECRET_QUERY_KEY.search(m["key"]) else m[0], query
    )


def redact_text(text: str) -> str:
    """``text`` (an error message, a log line) with every URL in it passed through
    :func:`redact_url` and every ``password=...``-like pair (a libpq key/value string)
    masked."""
    masked = _URL_IN_TEXT.sub(lambda m: redact_url(m[0]), text)
    return _SECRET_PAIR_IN_TEXT.sub(lambda m: f"{m['key']}{m['eq']}{MASK}", masked)
