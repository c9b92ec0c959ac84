"""Untrusted text made visible before the template escapes it.

Task names, error messages, trail details, DLQ attributes and tenant text come from
applications, handlers and queues: anything. Jinja2's autoescape makes them inert HTML;
:func:`visible` also shows the characters a browser would render invisibly or that
would reorder the text around them (C0/C1 control characters, the Unicode bidirectional
overrides and isolates, zero-width marks), as ``\\x1b`` or ``\\u202e``, so an error that
spoofs another task's name through a right-to-left override reads as what it is.

The template environment applies it to every string it prints (``finalize``), so no
page can forget it. Newlines and tabs stay: tracebacks keep their shape in ``<pre>``.
It is the one place the dashboard decides what is invisible: should the package gain a
shared rule for terminal output, this function is the one to replace with it.
"""

from __future__ import annotations

import re

_INVISIBLE = re.compile(
    "[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f\u061c\u200b-\u200f\u2028\u2029\u202a-\u202e\u2060-\u2064"
    "\u2066-\u2069\ufeff]"
)


def _escape(match: re.Match[str]) -> str:
    code = ord(match.group())
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def visible(value: str) -> str:
    """``value`` with control, bidirectional and zero-width characters spelled out
    (``"\\x1b[31m"``, ``"\\u202e"``); other text unchanged."""
    return _INVISIBLE.sub(_escape, value)
