"""Untrusted text made visible before the template escapes it.

Task names, error messages, trail details, DLQ attributes and tenant text come from
applications, handlers and queues: anything. Jinja2's autoescape makes them inert HTML;
:func:`visible` also shows the characters a browser would render invisibly or that
would reorder the text around them (C0/C1 control characters, the Unicode bidirectional
overrides and isolates, zero-width marks), as ``\\x1b`` or ``\\u202e``, so an error that
spoofs another task's name through a right-to-left override reads as what it is.

The template environment applies it to every string it prints (``finalize``), so no
page can forget it. Newlines and tabs stay: tracebacks keep their shape in ``<pre>``.
The rule is the package's one rule for untrusted text shown to people
(:func:`sqla_outbox.logging.printable`, which the terminal output uses too).
"""

from __future__ import annotations

from sqla_outbox.logging import printable


def visible(value: str) -> str:
    """``value`` with control, bidirectional and zero-width characters spelled out
    (``"\\x1b[31m"``, ``"\\u202e"``); newlines, tabs and other text unchanged."""
    return printable(value, multiline=True)
