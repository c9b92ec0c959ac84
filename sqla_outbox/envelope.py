"""The envelope: the versioned JSON body of every SQS message, carrying the ``run_id``.

Version 1 is a JSON object::

    {"v": 1, "run_id": "<uuid>", "task": "send_receipt", "queue": "critical",
     "tenant_id": 3, "event": "order.placed", "idempotency_key": null,
     "payload": "{\\"order_id\\":7}", "trace": {"traceparent": "00-..."}}

``payload`` is the task payload as JSON *text*, not as a nested object. The outbox column
is ``jsonb``, which reorders keys, drops duplicate keys, rewrites numbers (``1e16`` comes
back as ``10000000000000000``, an int) and refuses ``\\u0000``. Keeping the payload as a
string makes what the handler receives exactly what the application encoded.

Both texts are UTF-8 JSON (``ensure_ascii=False``): a character costs what UTF-8 makes it
cost (``中`` 3 bytes, an emoji 4), which is what SQS counts against its size limit
(docs/decisions/0001-payload-as-json-text.md). Characters neither SQS nor PostgreSQL
may carry are kept as JSON escapes (:func:`dumps`): control characters (``json``
escapes them always), lone surrogates, U+FFFE and U+FFFF. So the body is valid for SQS,
the ``jsonb`` column accepts the envelope, and the payload still parses back to exactly
the value the application dispatched.

Payload rules (decided here, documented in ``docs/handlers.md``): objects with string
keys, arrays (lists and tuples), strings, integers, finite floats, booleans and null.
NaN/Infinity, bytes, sets, datetimes, UUIDs, Decimals and other objects are refused with
:class:`~sqla_outbox.errors.PayloadNotSerializable`, naming the path of the bad value;
convert them explicitly (``value.isoformat()``, ``str(uuid)``) so the handler knows what
it gets.

Everything read from a queue is untrusted: :func:`decode` parses JSON only (never pickle
or eval), bounds the size before parsing, and validates every field.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import json
import math
import re
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

import orjson

from sqla_outbox import charsets, errors, tracing
from sqla_outbox.types import JSONValue, is_name, is_queue_name

VERSION = 1
_MAX_DEPTH = 200


class MalformedEnvelope(errors.OutboxError):
    """A message body is not a valid sqla_outbox envelope.

    Attributes:
        reason: Short machine-readable reason (``not-json``, ``bad-run-id``, ...).
    """

    code = "malformed-envelope"

    def __init__(self, reason: str, detail: str) -> None:
        self.reason = reason
        super().__init__(f"{reason}: {detail}")


@dataclasses.dataclass(frozen=True)
class Envelope:
    """Decoded envelope.

    Attributes:
        run_id: The run this message executes.
        task: Task name.
        queue: Logical queue name.
        tenant_id: Tenant, or None for platform work.
        event: The published event this run subscribes to, or None for a plain dispatch.
        idempotency_key: The dispatch's idempotency key, if any.
        payload_json: The payload as the application encoded it (JSON text).
        trace: W3C trace-context carrier (``traceparent``/``tracestate``), possibly empty.
    """

    run_id: uuid.UUID
    task: str
    queue: str
    tenant_id: int | None
    payload_json: str
    event: str | None = None
    idempotency_key: str | None = None
    trace: Mapping[str, str] = dataclasses.field(default_factory=dict)

    @property
    def payload(self) -> JSONValue:
        """The payload, parsed from :attr:`payload_json`."""
        value: JSONValue = json.loads(self.payload_json)
        return value

    def to_document(self) -> dict[str, Any]:
        """The envelope as a JSON-ready dict (stored in the outbox ``envelope`` column)."""
        return document(
            run_id=self.run_id,
            task=self.task,
            queue=self.queue,
            tenant_id=self.tenant_id,
            payload_json=self.payload_json,
            event=self.event,
            idempotency_key=self.idempotency_key,
            trace=self.trace,
        )

    def encode(self) -> str:
        """The SQS message body (compact UTF-8 JSON, :func:`dumps`)."""
        return encode_document(self.to_document())

    def message_attributes(self) -> dict[str, dict[str, str]]:
        """SQS message attributes carried beside the body: run_id, task, tenant_id."""
        return message_attributes(self.run_id, self.task, self.tenant_id)

    def size_bytes(self) -> int:
        """Message size as SQS counts it: body plus attribute names, types and values
        (including the relay's signature attribute)."""
        return run_message_size_bytes(self.encode(), self.task, self.tenant_id)


def document(
    *,
    run_id: uuid.UUID,
    task: str,
    queue: str,
    tenant_id: int | None,
    payload_json: str,
    event: str | None,
    idempotency_key: str | None,
    trace: Mapping[str, str],
) -> dict[str, Any]:
    """The envelope document of these fields (:meth:`Envelope.to_document`), built without
    an :class:`Envelope` (the dispatch path makes one per run)."""
    doc: dict[str, Any] = {
        "v": VERSION,
        "run_id": str(run_id),
        "task": task,
        "queue": queue,
        "tenant_id": tenant_id,
        "event": event,
        "idempotency_key": idempotency_key,
        "payload": payload_json,
    }
    if trace:
        doc["trace"] = dict(trace)
    return doc


_NOT_CARRIED = re.compile("[\ud800-\udfff\ufffe\uffff]")


def _json_escape(match: re.Match[str]) -> str:
    return f"\\u{ord(match.group()):04x}"


_JSON_MODULE_ENCODER = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False)
_STRICT_JSON_MODULE_ENCODER = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False, allow_nan=False)
"""What ``json.dumps`` would build on every call with these options (made once)."""


def dumps(value: Any) -> str:
    """Compact UTF-8 JSON whose every character SQS and PostgreSQL accept.

    Encoded by ``orjson`` (compact, UTF-8, keys in insertion order), which takes about a
    tenth of the ``json`` module's instructions for an envelope (ADR 0017, item 11;
    ``docs/benchmarks.md``), when ``value`` is made of the exact built-in types; the
    text is then exactly what ``json.dumps(value, separators=(",", ":"),
    ensure_ascii=False)`` writes, but for floats, written in their shortest round-trip form
    (``1e-05`` may read ``0.00001``: the same number). Anything else goes to the ``json``
    module with those options: what ``orjson`` refuses (integers beyond 64 bits, lone
    surrogates, ``float`` subclasses) and, refused here on purpose, subclasses of ``dict``,
    ``list``, ``str`` and ``int``, which ``orjson`` reads from their storage where ``json``
    (and the payload walk) read ``items()`` and ``__iter__`` (a Werkzeug ``MultiDict``, an
    ``OrderedDict`` after ``move_to_end``). ``Enum`` members are the one subclass ``orjson``
    still takes (it writes their ``.value``): :func:`encode_payload` encodes payloads holding
    one with the ``json`` module, and envelope documents hold none (``Dispatch`` keeps exact
    copies of the names, key and tenant it is given).

    Both escape control characters (U+0000 to U+001F); the characters they leave raw and
    that SQS (XML character set) or PostgreSQL (valid UTF-8) refuse, lone surrogates,
    U+FFFE and U+FFFF, are written as ``\\uXXXX`` escapes. They can only occur inside JSON
    strings, where the escape means the same character, so ``json.loads`` returns the same
    value.

    ``value`` must hold no NaN or infinite float: ``orjson`` writes them as ``null``.
    :func:`encode_payload` refuses them before encoding, and envelope documents hold none
    (``jsonb``, where the relay reads them from, cannot store them).
    """
    try:
        text = orjson.dumps(value, option=orjson.OPT_PASSTHROUGH_SUBCLASS).decode()
    except TypeError:  # orjson.JSONEncodeError: a subclass, beyond 64-bit integers, lone surrogates
        return _by_json_module(value, allow_nan=True)
    return _carried(text)


def _by_json_module(value: Any, *, allow_nan: bool) -> str:
    """:func:`dumps` by the ``json`` module alone (it reads every container through its
    ``items()``/``__iter__``); ``allow_nan=False`` raises ``ValueError`` on NaN/Infinity."""
    return _carried((_JSON_MODULE_ENCODER if allow_nan else _STRICT_JSON_MODULE_ENCODER).encode(value))


def _carried(text: str) -> str:
    """``text`` with the characters SQS or PostgreSQL refuse written as JSON escapes."""
    if text.isascii() or _NOT_CARRIED.search(text) is None:  # what they refuse is never ASCII
        return text
    return _NOT_CARRIED.sub(_json_escape, text)


def encode_document(document: Mapping[str, Any]) -> str:
    """Serialise an envelope document compactly (the form sent to SQS): :func:`dumps`."""
    return dumps(document)


SIGNATURE_ATTRIBUTE = "signature"
SIGNATURE_SIZE_BYTES = len(SIGNATURE_ATTRIBUTE) + len("String") + 64
"""Bytes the relay's signature attribute adds; always counted, so turning signing on never
makes an accepted dispatch too large to send."""


def sign(body: str, key: str) -> str:
    """HMAC-SHA256 of the body under ``key``, hex (64 characters)."""
    return hmac.new(key.encode("utf-8"), body.encode("utf-8"), hashlib.sha256).hexdigest()


def signature_valid(body: str, signature: str | None, keys: Sequence[str]) -> bool:
    """True when ``signature`` is the HMAC of ``body`` under one of ``keys`` (constant time)."""
    if not signature:
        return False
    return any(hmac.compare_digest(sign(body, key), signature) for key in keys)


def message_attributes(
    run_id: uuid.UUID | str, task: str, tenant_id: int | None
) -> dict[str, dict[str, str]]:
    """SendMessageBatch ``MessageAttributes`` for a run."""
    attributes = {"run_id": {"DataType": "String", "StringValue": str(run_id)}}
    if task:  # SQS refuses an empty value and characters outside the XML set
        attributes["task"] = {"DataType": "String", "StringValue": charsets.for_sqs(task)}
    if tenant_id is not None:
        attributes["tenant_id"] = {"DataType": "Number", "StringValue": str(tenant_id)}
    return attributes


def _utf8_len(text: str) -> int:
    """Length of ``text`` in UTF-8 bytes (ASCII text: its length, without encoding it)."""
    return len(text) if text.isascii() else len(text.encode("utf-8"))


def message_size_bytes(body: str, attributes: Mapping[str, Mapping[str, str]]) -> int:
    """Size of an SQS message in bytes: UTF-8 body plus, per attribute, name + type + value.

    This is how SQS counts against its maximum message size (SQS Developer Guide,
    "Amazon SQS message attributes": name, data type and value all count).
    """
    size = _utf8_len(body)
    for name, attribute in attributes.items():
        size += (
            _utf8_len(name) + _utf8_len(attribute["DataType"]) + _utf8_len(attribute.get("StringValue", ""))
        )
    return size


_RUN_ID_ATTRIBUTE_BYTES = len("run_id") + len("String") + len(str(uuid.UUID(int=0)))
_TASK_ATTRIBUTE_BYTES = len("task") + len("String")
_TENANT_ATTRIBUTE_BYTES = len("tenant_id") + len("Number")


def run_message_size_bytes(body: str, task: str, tenant_id: int | None) -> int:
    """Size in bytes SQS counts for a run's message, the relay's signature included.

    The same as ``message_size_bytes(body, message_attributes(run_id, task, tenant_id)) +
    SIGNATURE_SIZE_BYTES``, computed without building the attributes (every dispatch
    measures its message: the limit is checked at ``session.add``, not at the relay).
    """
    size = _utf8_len(body) + _RUN_ID_ATTRIBUTE_BYTES + SIGNATURE_SIZE_BYTES
    if task:  # a printable ASCII name (every catalog name) is sent as it is
        size += _TASK_ATTRIBUTE_BYTES + (
            len(task) if task.isascii() and task.isprintable() else _utf8_len(charsets.for_sqs(task))
        )
    if tenant_id is not None:
        size += _TENANT_ATTRIBUTE_BYTES + len(str(tenant_id))
    return size


# --------------------------------------------------------------------------------------
# payload encoding (application side)


def encode_payload(task: str, payload: Any) -> str:
    """Encode ``payload`` as compact JSON text, refusing anything that is not plain JSON.

    Args:
        task: Task name, for the error message.
        payload: The value to encode (see the module docstring for what is allowed).

    Returns:
        Compact UTF-8 JSON text (:func:`dumps`: characters SQS or PostgreSQL refuse are
        escaped, every other character kept as it is, so its size is its UTF-8 size).

    Raises:
        PayloadNotSerializable: A value is not plain JSON; the message names its path
            (``$.items[2]``) and type.
    """
    try:
        if _check_plain_json(task, payload):  # first: dumps writes a NaN it is given as null
            return dumps(payload)
        # a subclass's items()/__iter__ run again here: strict, for a NaN they did not show the walk
        return _by_json_module(payload, allow_nan=False)
    except errors.PayloadNotSerializable:
        raise
    except (ValueError, TypeError, RecursionError) as exc:  # a subclass's own methods failed
        raise errors.PayloadNotSerializable(task, f"payload is not JSON: {exc}") from exc


_Where = tuple[Any, str | int] | None
"""Where a value sits in the payload: None for the payload itself, else ``(where of its
container, key or index)``. Built as the walk goes (a tuple per value), formatted into
``$.items[2]`` only for an error message."""


_PATH_SHOWN = 12
"""Steps of a path an error message shows at each end (a path of hundreds is elided)."""


def _keys(where: _Where) -> list[str | int]:
    """The keys and indexes from the payload down to ``where``."""
    keys: list[str | int] = []
    while where is not None:
        where, key = where
        keys.append(key)
    keys.reverse()
    return keys


def _path(where: _Where) -> str:
    steps = [f"[{key}]" if isinstance(key, int) else f".{key}" for key in _keys(where)]
    if len(steps) > 2 * _PATH_SHOWN:
        hidden = len(steps) - 2 * _PATH_SHOWN
        steps[_PATH_SHOWN:-_PATH_SHOWN] = [f"...({hidden} more)..."]
    return "$" + "".join(steps)


def _too_deep(payload: Any, where: _Where) -> str:
    """The message for a payload nested past :data:`_MAX_DEPTH`: a reference cycle (a
    container inside itself) when the path to ``where`` passes one container twice."""
    keys = _keys(where)
    seen: dict[int, int] = {}  # id of a container on the path -> how many steps down
    container = payload
    try:
        for step, key in enumerate(keys):
            if id(container) in seen:
                inner, outer = _path_of(keys[:step]), _path_of(keys[: seen[id(container)]])
                return f"payload holds a reference cycle: {inner} is {outer} itself"
            seen[id(container)] = step
            container = container[key]
    except (LookupError, TypeError):  # a subclass whose [] does not give what it iterated
        pass
    return f"payload nests deeper than {_MAX_DEPTH} levels at {_path(where)}"


def _path_of(keys: list[str | int]) -> str:
    where: _Where = None
    for key in keys:
        where = (where, key)
    return _path(where)


_FLAT_VALUE_TYPES = frozenset({str, int, bool, type(None)})
"""Value types (exactly these, not subclasses) of a payload that needs no walk when it is a
flat object: the common payload, checked in one pass."""

_EXACT_TYPES = frozenset({dict, list, tuple, str, int, float, bool, type(None)})
"""The built-in types :func:`encode_payload` gives to ``orjson``; a payload holding anything
else (a subclass, an ``Enum`` member) is encoded by the ``json`` module."""


def _check_plain_json(task: str, payload: Any) -> bool:
    """Refuse what is not plain JSON; return whether every value and key is of an exact
    built-in type (:data:`_EXACT_TYPES`), so that ``orjson`` reads it as ``json`` does."""
    if type(payload) is dict:  # a flat object of plain values, in one pass (a loop: no generator)
        for key, value in payload.items():
            if type(key) is not str or type(value) not in _FLAT_VALUE_TYPES:
                break
        else:
            return True
    exact = True
    stack: list[tuple[Any, _Where, int]] = [(payload, None, 0)]
    pop, push = stack.pop, stack.append
    while stack:
        value, where, depth = pop()
        if depth > _MAX_DEPTH:
            raise errors.PayloadNotSerializable(task, _too_deep(payload, where))
        kind = type(value)  # its real type: isinstance() would believe a __class__ property
        if exact and kind not in _EXACT_TYPES:
            exact = False
        if value is None or issubclass(kind, (bool, str, int)):
            continue
        if issubclass(kind, float):
            if not math.isfinite(value):
                raise errors.PayloadNotSerializable(
                    task, f"payload is not JSON: {value!r} at {_path(where)} (JSON has no NaN/Infinity)"
                )
            continue
        if issubclass(kind, dict):
            for key, item in value.items():
                if type(key) is not str:
                    if not issubclass(type(key), str):
                        raise errors.PayloadNotSerializable(
                            task,
                            f"payload is not JSON: key {key!r} ({type(key).__name__}) at {_path(where)}; "
                            "object keys must be strings",
                        )
                    exact = False
                push((item, (where, key), depth + 1))
            continue
        if issubclass(kind, (list, tuple)):
            for index, item in enumerate(value):
                push((item, (where, index), depth + 1))
            continue
        hint = ""
        if hasattr(value, "isoformat"):
            hint = "; pass value.isoformat()"
        elif isinstance(value, uuid.UUID):
            hint = "; pass str(value)"
        elif type(value).__name__ == "Decimal":
            hint = "; pass str(value) to keep its precision"
        raise errors.PayloadNotSerializable(
            task, f"payload is not JSON: {type(value).__name__} at {_path(where)}{hint}"
        )
    return exact


# --------------------------------------------------------------------------------------
# decoding (worker side, untrusted input)


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"number {text[:40]} overflows a float")
    return value


def strict_loads(text: str) -> Any:
    """``json.loads`` that refuses NaN/Infinity literals and numbers that overflow a float."""
    return json.loads(text, parse_constant=_reject_constant, parse_float=_finite_float)


def decode(body: str, *, max_bytes: int) -> Envelope:
    """Parse and validate a message body received from SQS.

    Args:
        body: The raw message body.
        max_bytes: Bodies larger than this are refused before parsing.

    Returns:
        The validated :class:`Envelope`.

    Raises:
        MalformedEnvelope: With ``reason`` one of ``too-large``, ``not-json``,
            ``not-an-object``, ``bad-version``, ``bad-field``, ``bad-payload``.
    """
    if len(body) > max_bytes or len(body.encode("utf-8", "surrogatepass")) > max_bytes:
        raise MalformedEnvelope("too-large", f"body is over {max_bytes} bytes")
    try:
        doc = strict_loads(body)
    except (ValueError, RecursionError) as exc:
        raise MalformedEnvelope("not-json", str(exc)[:200]) from None
    if not isinstance(doc, dict):
        raise MalformedEnvelope("not-an-object", f"body is a JSON {type(doc).__name__}")
    if doc.get("v") != VERSION or isinstance(doc.get("v"), bool):
        raise MalformedEnvelope("bad-version", f"unsupported envelope version {doc.get('v')!r}"[:200])
    run_id = _field(doc, "run_id", str)
    try:
        parsed_run_id = uuid.UUID(run_id)
    except ValueError:
        raise MalformedEnvelope("bad-field", "run_id is not a UUID") from None
    task = _field(doc, "task", str)
    if not is_name(task):
        raise MalformedEnvelope("bad-field", "task is not a valid task name")
    queue = _field(doc, "queue", str)
    if not is_queue_name(queue):  # the run row's queue is compared when the lease is taken
        raise MalformedEnvelope("bad-field", "queue is not a valid queue name")
    tenant_id = _optional(doc, "tenant_id", int)
    if tenant_id is not None and not -(2**63) <= tenant_id < 2**63:
        raise MalformedEnvelope("bad-field", "tenant_id is out of the bigint range")
    event = _optional(doc, "event", str)
    if event is not None and not is_name(event):
        raise MalformedEnvelope("bad-field", "event is not a valid event name")
    key = _optional(doc, "idempotency_key", str)
    if key is not None and not storable_text(key):
        raise MalformedEnvelope("bad-field", "idempotency_key holds a NUL or a lone surrogate")
    payload_json = _field(doc, "payload", str)
    if not storable_text(payload_json):
        raise MalformedEnvelope("bad-payload", "payload holds a NUL or a lone surrogate")
    try:
        strict_loads(payload_json)
    except (ValueError, RecursionError):
        raise MalformedEnvelope("bad-payload", "payload is not JSON text") from None
    trace = doc.get("trace", {})
    if not isinstance(trace, dict) or not all(
        isinstance(k, str)
        and isinstance(v, str)
        and len(v) <= tracing.MAX_VALUE_CHARS
        and storable_text(k + v)
        for k, v in trace.items()
    ):
        raise MalformedEnvelope("bad-field", "trace must map strings to short strings")
    return Envelope(
        run_id=parsed_run_id,
        task=task,
        queue=queue,
        tenant_id=tenant_id,
        payload_json=payload_json,
        event=event,
        idempotency_key=key,
        trace=trace,
    )


def storable_text(text: str) -> bool:
    """Whether PostgreSQL can hold ``text`` (no NUL, valid UTF-8: no lone surrogate).

    Every envelope the relay sends was read from a ``jsonb`` column, which refuses both
    (PostgreSQL: "unsupported Unicode escape sequence"), so a body carrying one is not ours.
    """
    return charsets.storable(text)


def _field(doc: Mapping[str, Any], name: str, kind: type) -> Any:
    value = doc.get(name)
    if not isinstance(value, kind) or isinstance(value, bool):
        raise MalformedEnvelope("bad-field", f"{name} must be a {kind.__name__}")
    return value


def _optional(doc: Mapping[str, Any], name: str, kind: type) -> Any:
    value = doc.get(name)
    if value is None:
        return None
    return _field(doc, name, kind)
