"""What text PostgreSQL and SQS can carry, and one rule per boundary for text that crosses.

Text from outside our code (exception messages and type names, tracebacks, payload text
echoed into errors, message attributes read from a queue, SQS error messages) crosses two
boundaries, and each refuses characters the other accepts:

* **PostgreSQL** ``text`` and ``jsonb`` hold valid UTF-8 without NUL: a ``text`` value
  with U+0000 fails with "invalid byte sequence for encoding UTF8: 0x00", a lone
  surrogate (U+D800..U+DFFF unpaired) cannot be encoded as UTF-8 at all, and ``jsonb``
  refuses the escapes ``\\u0000`` and unpaired ``\\ud800`` (PostgreSQL documentation,
  "JSON Types": "unsupported Unicode escape sequence").
* **SQS** message bodies and ``String`` message attribute values hold only the XML 1.0
  characters ``#x9 | #xA | #xD | #x20-#xD7FF | #xE000-#xFFFD | #x10000-#x10FFFF``; SQS
  refuses anything else with ``InvalidMessageContents`` (Amazon SQS API Reference,
  SendMessage, "MessageBody").

:func:`for_postgres` and :func:`for_sqs` apply those rules: every character the boundary
refuses is replaced by a visible escape of its code point (``\\x00``, ``\\ud800``,
``\\uffff``, as Python writes them), everything else is kept as it is, and text that
needs no change is returned unchanged (the common case costs one regular-expression
search). The escape is visible on purpose: an operator reading ``upstream said \\x00``
in ``last_error`` knows a NUL was there. :func:`jsonb_safe` applies :func:`for_postgres`
to every string (keys included) of a JSON value bound for a ``jsonb`` column.

Where each is applied (the crossings) is listed in ``docs/reliability.md``.

This module imports nothing from the package (a leaf: any layer may use it).
"""

from __future__ import annotations

import re
from typing import Any

_POSTGRES_REFUSED = re.compile("[\x00\ud800-\udfff]")
_SQS_REFUSED = re.compile("[^\t\n\r\x20-\ud7ff\ue000-\ufffd\U00010000-\U0010ffff]")


def _escape(match: re.Match[str]) -> str:
    code = ord(match.group())
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def for_postgres(text: str) -> str:
    """``text`` as PostgreSQL ``text`` can store it: NUL and lone surrogates escaped.

    Args:
        text: Any Python string.

    Returns:
        The same string when it holds neither; otherwise a copy with each NUL written
        ``\\x00`` and each lone surrogate ``\\udXXX``.
    """
    if _POSTGRES_REFUSED.search(text) is None:
        return text
    return _POSTGRES_REFUSED.sub(_escape, text)


def for_sqs(text: str) -> str:
    """``text`` as an SQS message body or String attribute value can carry it.

    Every character outside ``#x9 | #xA | #xD | #x20-#xD7FF | #xE000-#xFFFD |
    #x10000-#x10FFFF`` (SQS SendMessage, "MessageBody") is written as ``\\xNN`` (below
    U+0100) or ``\\uNNNN``: control characters, lone surrogates, U+FFFE and U+FFFF.
    The result is also valid for PostgreSQL (it holds neither NUL nor lone surrogates).

    Args:
        text: Any Python string.

    Returns:
        The same string when every character is allowed; otherwise an escaped copy.
    """
    if _SQS_REFUSED.search(text) is None:
        return text
    return _SQS_REFUSED.sub(_escape, text)


def storable(text: str) -> bool:
    """Whether PostgreSQL ``text`` can hold ``text`` unchanged (no NUL, no lone surrogate)."""
    return _POSTGRES_REFUSED.search(text) is None


def sqs_allowed(text: str) -> bool:
    """Whether SQS accepts ``text`` unchanged as a message body or String attribute value."""
    return _SQS_REFUSED.search(text) is None


def jsonb_safe(value: Any) -> Any:
    """A JSON value whose strings (keys and values, at any depth) pass :func:`for_postgres`.

    ``json.dumps`` writes NUL as ``\\u0000`` and a lone surrogate as ``\\ud800``, and
    ``jsonb`` refuses both escapes, so every string bound for a ``jsonb`` column goes
    through this first. Numbers, booleans and None are returned as they are.
    """
    if isinstance(value, str):
        return for_postgres(value)
    if isinstance(value, dict):
        return {for_postgres(str(k)): jsonb_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonb_safe(v) for v in value]
    return value
