"""How one setting is declared: its rule, its secrecy and how its text is read.

Each field of :class:`sqla_outbox.config.OutboxSettings` is declared once, by
:func:`setting`, with everything that concerns it::

    worker_concurrency: int = setting(8, "Handlers running at once per worker process.",
                                      minimum=1, maximum=1000)

The field's annotation is its type (``from_env`` reads the text by it, :func:`parse`); the
keywords are its :class:`Setting`: the range or allowed values that construction enforces
(:meth:`Setting.problem`), whether it is a secret (masked by ``OutboxSettings.redacted``) and
the doc text. ``docs/configuration.md`` is generated from the same declarations.

A rule here is a pure function of one value (and, for ``at_least``, the value of the field it
names): it returns what is wrong as text, or None; the settings class raises. This module
imports nothing from the package.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable
from typing import Any

UNITS_IN_MESSAGES = ("s", "ms", "bytes")
"""Units written after a bound in messages (``must be >= 1 s``). Other units (``days``) are
left to the variable's name (``SQLA_OUTBOX_PURGE_SENT_AFTER_DAYS: must be >= 0``)."""

NONE_WORDS = frozenset({"", "none", "null", "off"})
"""Text that unsets an optional (``... | None``) setting, in any case."""

TRUE_WORDS = frozenset({"1", "true", "yes", "on"})
FALSE_WORDS = frozenset({"0", "false", "no", "off", ""})


@dataclasses.dataclass(frozen=True)
class Setting:
    """The declaration of one setting, beside its field.

    Numbers (``int``/``float`` fields) declare a lower bound (``minimum``, ``above`` or
    ``at_least``) and/or ``maximum``, or ``unbounded=True``; a float must also be finite.
    Text declares ``choices``, ``pattern`` or ``min_length``; on a list (``tuple[str, ...]``)
    ``pattern`` and ``min_length`` apply to each entry. Anything a bound cannot say (URLs,
    ``name=seconds`` lists) is a ``check``. An unset optional field (None) passes every rule.

    Attributes:
        doc: Meaning, default, special values and who reads it (docs and ``--help``).
        unit: Unit of a number (``s``, ``ms``, ``bytes``, ``days``), or "".
        aliases: Bare environment names read after the ``SQLA_OUTBOX_`` one, in order.
        minimum: Smallest value allowed (inclusive).
        above: Exclusive lower bound: the value must be greater.
        maximum: Largest value allowed (inclusive).
        at_least: Name of another field of the same settings whose value is the minimum
            (``relay_backoff_max_seconds`` is at least ``relay_backoff_base_seconds``).
        unbounded: A number without a range, said explicitly (every number declares one or
            the other; ``tests/unit/test_settings_schema.py`` checks it).
        choices: The allowed values of a text, matched case-insensitively (the value is
            stored lower-case).
        pattern: Regular expression the whole text (or each list entry) must match
            (``re.fullmatch``).
        min_length: Fewest characters of the text (or of each list entry).
        shape: What a valid value is, in words (``a TCP port``); required with ``pattern``
            and ``check``; shown in messages and docs.
        source: Where the rule comes from (``SQS VisibilityTimeout``), shown after it.
        check: ``value -> problem or None`` for a rule no bound expresses; its text is the
            whole message (it must not show a secret).
        secret: The value is masked by ``OutboxSettings.redacted()`` (and so by
            ``python -m sqla_outbox config``) and never shown in a message.
        mask: How a secret is shown instead of ``***`` (``user:***``); needs ``secret``.
    """

    doc: str
    unit: str = ""
    aliases: tuple[str, ...] = ()
    minimum: float | None = None
    above: float | None = None
    maximum: float | None = None
    at_least: str | None = None
    unbounded: bool = False
    choices: tuple[str, ...] = ()
    pattern: str | None = None
    min_length: int | None = None
    shape: str = ""
    source: str = ""
    check: Callable[[Any], str | None] | None = None
    secret: bool = False
    mask: Callable[[str], str] | None = None

    def __post_init__(self) -> None:
        """Refuse a declaration that contradicts itself (raised when the module is imported).

        Raises:
            TypeError: Two lower bounds, ``unbounded`` with a bound, ``pattern`` or ``check``
                without ``shape``, ``mask`` without ``secret``, a bound that is not a number.
        """
        lower = [b for b in (self.minimum, self.above, self.at_least) if b is not None]
        problems = [
            (len(lower) > 1, "declare one lower bound (minimum, above or at_least)"),
            (self.unbounded and self.is_number, "unbounded and a bound contradict"),
            ((self.pattern or self.check) is not None and not self.shape, "pattern and check need shape"),
            (self.mask is not None and not self.secret, "mask needs secret=True"),
            (
                any(
                    not isinstance(b, (int, float))
                    for b in (self.minimum, self.above, self.maximum)
                    if b is not None
                ),
                "bounds are numbers",
            ),
        ]
        for failed, problem in problems:
            if failed:
                raise TypeError(f"setting {self.doc[:40]!r}...: {problem}")

    def normalized(self, value: Any, *, optional: bool) -> Any:
        """``value`` as the settings store it: an optional text in :data:`NONE_WORDS` is None,
        a value among ``choices`` is stripped and lower-cased; anything else unchanged."""
        if not isinstance(value, str):
            return value
        if optional and value.strip().lower() in NONE_WORDS:
            return None
        return value.strip().lower() if self.choices else value

    @property
    def is_number(self) -> bool:
        """Whether the declaration bounds a number (``unbounded`` says there is none)."""
        return any(b is not None for b in (self.minimum, self.above, self.maximum, self.at_least))

    def bounds_text(self, *, quote: str = "") -> str:
        """The declared range in words: ``1..1000``, ``>= 0``, ``> 0 and <= 300``, ``any``.

        Args:
            quote: Put around a field name given by ``at_least`` (a backtick in the docs).
        """
        low = f"{quote}{self.at_least}{quote}" if self.at_least else None
        if self.minimum is not None:
            low = _number(self.minimum)
        if low is not None:
            if self.maximum is None:
                return f">= {low}"
            return f"{low}..{_number(self.maximum)}"
        if self.above is not None:
            if self.maximum is None:
                return f"> {_number(self.above)}"
            return f"> {_number(self.above)} and <= {_number(self.maximum)}"
        return "any" if self.maximum is None else f"<= {_number(self.maximum)}"

    def describe(self, kind: str) -> str:
        """The allowed values for the docs' "values" column, e.g. ``integer, 1..1000``.

        Args:
            kind: The field's annotation as text (``int``, ``float | None``, ``tuple[str, ...]``).
        """
        cited = f" ({self.source})" if self.source else ""
        if self.choices:
            return "one of " + ", ".join(f"`{c}`" for c in self.choices)
        if kind.startswith(("int", "float")):
            bounds = self.bounds_text(quote="`")
            ranged = f"{self.shape} ({bounds})" if self.shape else bounds
            return f"{'integer' if kind.startswith('int') else 'number'}, {ranged}{cited}"
        if kind.startswith("bool"):
            return "true/false"
        listed = kind.startswith("tuple")
        each = "; each entry " if listed else ", "
        parts = ["list, comma-separated" if listed else "text"]
        if self.min_length is not None:
            length = "not empty" if self.min_length == 1 else f"at least {self.min_length} characters"
            parts.append(f"{each}{length}")
        if self.shape:
            parts.append(f"{each}{self.shape}{cited}")
        return "".join(parts)

    def problem(self, value: Any, *, floor: Any = None) -> str | None:
        """What is wrong with ``value`` under this declaration, or None if it is allowed.

        Args:
            value: The field's value (None: unset, allowed; the caller refuses None for a
                field that is not optional).
            floor: Value of the field ``at_least`` names.

        Returns:
            ``must be ...`` text; a number refused is shown (``, got -1``), a secret never.
        """
        if value is None:
            return None
        if isinstance(value, float) and not math.isfinite(value):
            return f"must be a finite number, got {value!r}"
        if self.is_number:
            return self._number_problem(value, floor)
        if self.choices and value not in self.choices:
            listed = ", ".join(self.choices)
            wanted = f"{self.shape} ({listed})" if self.shape else f"one of {listed}"
            return f"must be {wanted}, got {value!r}"
        if isinstance(value, tuple):
            entry_problems = (self._text_problem(entry, "each entry ") for entry in value)
            found = next((p for p in entry_problems if p), None)
        else:
            found = self._text_problem(value, "") if isinstance(value, str) else None
        if found is None and self.check is not None:
            return self.check(value)
        return found

    def _number_problem(self, value: float, floor: Any) -> str | None:
        too_low = (
            (self.minimum is not None and value < self.minimum)
            or (self.above is not None and value <= self.above)
            or (self.at_least is not None and floor is not None and value < floor)
        )
        if not too_low and (self.maximum is None or value <= self.maximum):
            return None
        bounds = self.bounds_text()
        ends_in_number = bounds[-1].isdigit()  # not after a field name (">= relay_backoff_base_seconds")
        unit = f" {self.unit}" if self.unit in UNITS_IN_MESSAGES and ends_in_number else ""
        if self.shape:
            wanted = f"{self.shape} ({bounds}{unit})"
        else:
            wanted = f"{'within ' if '..' in bounds else ''}{bounds}{unit}"
        cited = f" ({self.source})" if self.source else ""
        return f"must be {wanted}{cited}, got {_number(value)}"

    def _text_problem(self, text: str, subject: str) -> str | None:
        if self.min_length is not None and len(text) < self.min_length:
            if self.min_length == 1:
                return f"{subject}must not be empty"
            return f"{subject}must be at least {self.min_length} characters long"
        if self.pattern is not None and re.fullmatch(self.pattern, text) is None:
            cited = f" ({self.source})" if self.source else ""
            shown = "" if self.secret else f", got {text!r}"
            return f"{subject}must be {self.shape}{cited}{shown}"
        return None


def setting(default: Any, doc: str, **rule: Any) -> Any:
    """A dataclass field with ``default``, declared with its :class:`Setting` (``rule``: the
    keywords of :class:`Setting` after ``doc``).

    The field's metadata holds the declaration under ``"setting"`` and, for the readers of
    plain metadata (the CLI's option help), ``"doc"``, ``"unit"`` and ``"aliases"``.

    Raises:
        TypeError: An unknown keyword, or a declaration that contradicts itself.
    """
    spec = Setting(doc, **rule)
    metadata = {"setting": spec, "doc": spec.doc, "unit": spec.unit, "aliases": spec.aliases}
    return dataclasses.field(default=default, metadata=metadata)


def of(field: dataclasses.Field[Any]) -> Setting:
    """The declaration of a field made by :func:`setting`."""
    spec = field.metadata["setting"]
    assert isinstance(spec, Setting), field.name
    return spec


def is_optional(field: dataclasses.Field[Any]) -> bool:
    """Whether the field may be None (its annotation reads ``... | None``)."""
    return "None" in str(field.type)


def first_problem(settings: Any) -> tuple[str, str] | None:
    """The first field of a dataclass built with :func:`setting` whose value breaks its rule.

    Fields are checked in declaration order, so the field an ``at_least`` names (declared
    first) has passed its own rule when it is compared with. None for a field that is not
    optional is a problem (``must be set``).

    Returns:
        ``(field name, problem text)``, or None when every value is allowed.
    """
    for field in dataclasses.fields(settings):
        spec = of(field)
        value = getattr(settings, field.name)
        if value is None and not is_optional(field):
            return field.name, "must be set"
        problem = spec.problem(value, floor=getattr(settings, spec.at_least) if spec.at_least else None)
        if problem is not None:
            return field.name, problem
    return None


def reference_rows(settings_class: type, env_names: Callable[[str], tuple[str, ...]]) -> list[str]:
    """Markdown table of the declared fields: name, environment names, default, unit,
    values (:meth:`Setting.describe`), secret, meaning. ``|`` in a cell is escaped."""
    rows = [
        "| setting | environment | default | unit | values | secret | meaning |",
        "|---|---|---|---|---|---|---|",
    ]
    for field in dataclasses.fields(settings_class):
        spec = of(field)
        default = field.default
        if isinstance(default, tuple):
            shown = ",".join(default) if default else "(empty)"
        else:
            shown = "(unset)" if default is None else str(default)
        cells = [
            f"`{field.name}`",
            "<br>".join(f"`{name}`" for name in env_names(field.name)),
            f"`{shown}`",
            spec.unit,
            spec.describe(str(field.type)),
            "yes" if spec.secret else "",
            spec.doc,
        ]
        rows.append("| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |")
    return rows


def parse(field: dataclasses.Field[Any], raw: str) -> Any:
    """Read an environment variable's text by the field's type.

    ``bool``: ``1/true/yes/on`` or ``0/false/no/off`` (any case); ``int``: base 10
    (``010`` is ten); ``float``: a finite decimal number; ``tuple``: comma-separated, blanks
    dropped; ``str``: stripped. For an optional field, :data:`NONE_WORDS` read as None.

    Raises:
        ValueError: The text does not spell a value of the type; the message quotes it.
    """
    kind = str(field.type)
    text = raw.strip()
    if is_optional(field) and text.lower() in NONE_WORDS:
        return None
    if kind.startswith("bool"):
        if text.lower() in TRUE_WORDS:
            return True
        if text.lower() in FALSE_WORDS:
            return False
        raise ValueError(f"expected true/false, got {raw!r}")
    if kind.startswith("int"):
        return _parse_int(text, raw)
    if kind.startswith("float"):
        return _parse_float(text, raw)
    if kind.startswith("tuple"):
        return tuple(part.strip() for part in text.split(",") if part.strip())
    return text


_INTEGER = re.compile(r"[+-]?[0-9]+")
_DECIMAL = re.compile(r"[+-]?([0-9]+\.?[0-9]*|\.[0-9]+)([eE][+-]?[0-9]+)?")


def _parse_int(text: str, raw: str) -> int:
    """A base-10 integer (``010`` is ten; ``0x10``, ``1_000`` and ``8.0`` are refused)."""
    if _INTEGER.fullmatch(text) is None:
        raise ValueError(f"expected a whole number in base 10 (like 8), got {raw!r}")
    return int(text, 10)


def _parse_float(text: str, raw: str) -> float:
    """A finite decimal number (``2``, ``2.5``, ``1e3``); ``nan``/``inf`` and ``1_000`` are refused."""
    if _DECIMAL.fullmatch(text) is None:
        raise ValueError(f"expected a number (like 2.5), got {raw!r}")
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"expected a finite number, got {raw!r}")
    return value


def _number(value: float) -> str:
    """``-1`` for ``-1.0``, ``0.1`` for ``0.1``, ``1209600`` (no separators)."""
    return str(int(value)) if isinstance(value, float) and value.is_integer() else str(value)
