"""Dashboard operators a setting names: who, with which role, for which tenants, by which token.

``dashboard_users`` lists one entry per operator, comma-separated; each entry is the
operator's name and role, then options::

    alice:operator:sha256=9f86d081884c7d65...          # signs in with her own token
    bob:viewer:tenants=3+7:sha256=2c26b46b68ffc68f...   # reads tenants 3 and 7 only
    carol@example.com:operator                          # named by the reverse proxy

* **role** ``viewer`` reads every page it may see, with payloads and handler results
  hidden, and never acts; ``operator`` also acts (when actions are enabled) and sees
  payloads when ``dashboard_show_payloads`` is on.
* **tenants=** restricts the operator to those tenants' runs, DLQ messages and actions
  (pages about every tenant, such as the overview, are not shown to them).
* **sha256=** is the SHA-256 (hex) of the operator's own token: the token opens the
  login page and ``Authorization: Bearer``. The token is 32 random bytes
  (``secrets.token_urlsafe(32)``), so a fast hash is as strong as a password hash (a slow
  hash protects guessable passwords; nothing guesses 256 random bits): only the hash is
  configured. An entry without it names an operator authenticated by a reverse proxy
  (``dashboard_proxy_user_header``).

Pure functions of text (a leaf module): the settings check each entry, the dashboard
matches requests against them.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import re

ROLES = ("viewer", "operator")
"""Dashboard roles, least first."""

NAME_PATTERN = r"[A-Za-z0-9_.@+-]{1,64}"
"""An operator name: what the trail records as ``dashboard:<name>``."""

ENTRY_SHAPE = "name:role[:tenants=3+7][:sha256=<64 hex digits>]"
"""What a ``dashboard_users`` entry looks like, for messages and docs."""

_NAME = re.compile(NAME_PATTERN)
_HASH = re.compile(r"[0-9a-f]{64}")
_TENANT = re.compile(r"-?\d{1,19}")


@dataclasses.dataclass(frozen=True)
class Operator:
    """One ``dashboard_users`` entry, parsed.

    Attributes:
        name: The operator's name (:data:`NAME_PATTERN`).
        role: ``viewer`` or ``operator``.
        tenants: The tenants they are restricted to; None: every tenant.
        token_sha256: SHA-256 of their token, lowercase hex; None for an operator named
            by a reverse proxy.
    """

    name: str
    role: str
    tenants: frozenset[int] | None = None
    token_sha256: str | None = None

    def token_matches(self, token: str) -> bool:
        """Whether ``token`` is this operator's (its SHA-256 compared in constant time)."""
        if self.token_sha256 is None:
            return False
        given = hashlib.sha256(token.encode("utf-8", "surrogatepass")).hexdigest()
        return hmac.compare_digest(given, self.token_sha256)


def parse_operator(text: str) -> Operator:
    """Parse one ``dashboard_users`` entry (see the module docstring).

    Raises:
        ValueError: Not :data:`ENTRY_SHAPE`: a bad name, an unknown role or option, a
            tenant that is not an integer, a hash that is not 64 hex digits.
    """
    parts = text.strip().split(":")
    if len(parts) < 2:
        raise ValueError(f"{_shown(text)!r} is not name:role (viewer or operator), then options")
    name, role, options = parts[0], parts[1].strip().lower(), parts[2:]
    if not _NAME.fullmatch(name):
        raise ValueError(f"operator name {name!r} is not 1..64 letters, digits and _ . @ + -")
    if role not in ROLES:
        raise ValueError(f"operator {name!r}: role {role!r} is not viewer or operator")
    tenants: frozenset[int] | None = None
    token: str | None = None
    for option in options:
        key, equals, value = option.partition("=")
        if key == "tenants" and equals:
            ids = value.split("+")
            if not all(_TENANT.fullmatch(i) for i in ids):
                raise ValueError(f"operator {name!r}: tenants are integer ids joined by '+' (tenants=3+7)")
            tenants = frozenset(int(i) for i in ids)
        elif key == "sha256" and equals:
            if not _HASH.fullmatch(value.lower()):
                raise ValueError(f"operator {name!r}: sha256= takes the 64 hex digits of the token's SHA-256")
            token = value.lower()
        else:
            raise ValueError(f"operator {name!r}: unknown option {key!r} (tenants=..., sha256=...)")
    return Operator(name, role, tenants, token)


def operators_problem(entries: tuple[str, ...]) -> str | None:
    """``dashboard_users``: the first entry that does not parse (or a name given twice),
    and why; None when all do. Never shows a hash."""
    seen: set[str] = set()
    for entry in entries:
        try:
            operator = parse_operator(entry)
        except ValueError as exc:
            return f"each entry must be {ENTRY_SHAPE}: {exc}"
        if operator.name in seen:
            return f"operator {operator.name!r} is listed twice"
        seen.add(operator.name)
    return None


def _shown(text: str) -> str:
    """An entry as an error message shows it: the token's hash masked."""
    return re.sub(r"sha256=[0-9A-Fa-f]*", "sha256=***", text)[:80]
