"""Envelope encoding, payload rules and decoding of untrusted bodies."""

from __future__ import annotations

import collections
import datetime as dt
import decimal
import enum
import json
import uuid

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sqla_outbox import charsets, envelope, errors


def make(**overrides: object) -> envelope.Envelope:
    fields: dict[str, object] = {
        "run_id": uuid.uuid4(),
        "task": "send_welcome",
        "queue": "default",
        "tenant_id": 3,
        "payload_json": '{"user_id":7}',
    }
    fields.update(overrides)
    return envelope.Envelope(**fields)  # type: ignore[arg-type]


def test_encode_then_decode_round_trips() -> None:
    original = make(event="user.created", idempotency_key="k", trace={"traceparent": "00-a-b-01"})
    decoded = envelope.decode(original.encode(), max_bytes=262_144)
    assert decoded == original
    assert decoded.payload == {"user_id": 7}


def test_body_is_compact_utf8_json_with_what_sqs_refuses_escaped() -> None:
    value = {"name": "Zoë ☃ 中 😀", "nul": "\x00", "bell": "\x07", "lone": "\ud800", "nonchar": "\uffff"}
    body = make(payload_json=envelope.encode_payload("t", value)).encode()
    assert "Zoë ☃ 中 😀" in body  # kept as UTF-8: 1 to 4 bytes each, as SQS counts
    assert charsets.sqs_allowed(body) and charsets.storable(body)
    assert json.loads(json.loads(body)["payload"]) == value
    assert len(envelope.encode_payload("t", "中" * 100).encode("utf-8")) == 302


@pytest.mark.parametrize(
    "payload",
    [
        {"a": [1, 2.5, None, True, "x"]},
        [],
        "just a string",
        12345678901234567890123,
        1e16,
        -0.0,
        {"nul": "\x00", "surrogate": "\ud800"},
    ],
)
def test_plain_json_payloads_encode_to_text_that_parses_back(payload: object) -> None:
    text = envelope.encode_payload("t", payload)
    back = json.loads(text)
    assert json.dumps(back) == json.dumps(payload)
    assert type(back) is type(payload)


@pytest.mark.parametrize(
    ("payload", "fragment"),
    [
        (b"bytes", "bytes at $"),
        ({"tags": {1, 2}}, "set at $.tags"),
        ({"x": [float("nan")]}, "nan at $.x[0]"),
        ({"x": float("inf")}, "inf at $.x"),
        ({"when": dt.datetime(2026, 1, 1)}, "datetime at $.when; pass value.isoformat()"),
        ({"id": uuid.uuid4()}, "UUID at $.id; pass str(value)"),
        ({"amount": decimal.Decimal("1.10")}, "Decimal at $.amount"),
        ({1: "int key"}, "key 1 (int) at $"),
        ({"ok": 1, True: "bool key"}, "key True (bool) at $"),  # flat, but one key is not a str
        ({"ok": "x", "n": None, "ratio": float("nan")}, "nan at $.ratio"),  # flat, with a float
        ({"obj": object()}, "object at $.obj"),
    ],
)
def test_non_json_payloads_are_refused_with_the_path(payload: object, fragment: str) -> None:
    with pytest.raises(errors.PayloadNotSerializable) as caught:
        envelope.encode_payload("send_welcome", payload)
    assert caught.value.task == "send_welcome"
    assert fragment in str(caught.value)
    assert "send_welcome" in str(caught.value)


def test_deeply_nested_payload_is_refused_not_crashing() -> None:
    deep: object = []
    for _ in range(5000):
        deep = [deep]
    with pytest.raises(errors.PayloadNotSerializable, match="deeper than"):
        envelope.encode_payload("t", deep)


def test_a_reference_cycle_is_named_as_one_with_short_paths() -> None:
    looped: dict[str, object] = {}
    looped["self"] = looped
    with pytest.raises(errors.PayloadNotSerializable) as caught:
        envelope.encode_payload("t", looped)
    assert str(caught.value) == "task 't': payload holds a reference cycle: $.self is $ itself"
    inner: list[object] = [1, {}]
    outer = {"items": inner}
    inner[1] = {"back": inner}  # type: ignore[assignment]
    with pytest.raises(errors.PayloadNotSerializable) as caught:
        envelope.encode_payload("t", outer)
    assert str(caught.value).endswith("reference cycle: $.items[1].back is $.items itself")


def test_a_deep_path_is_elided_in_the_message() -> None:
    deep: object = "leaf"
    for _ in range(300):
        deep = [deep]
    with pytest.raises(errors.PayloadNotSerializable) as caught:
        envelope.encode_payload("t", {"k": deep})
    message = str(caught.value)
    assert "deeper than 200 levels at $.k[0]" in message
    assert "more)..." in message
    assert len(message) < 250


def test_subclasses_pass_and_the_depth_limit_holds_at_its_edge() -> None:
    class Level(enum.IntEnum):
        HIGH = 1

    class Name(str):
        pass

    accepted = [{"level": Level.HIGH, "name": Name("n"), "pair": (1, 2)}, True, None]
    assert [json.loads(envelope.encode_payload("t", p)) for p in accepted] == [
        {"level": 1, "name": "n", "pair": [1, 2]},
        True,
        None,
    ]
    deepest: object = 1  # nested exactly as deep as allowed, then one level more
    for _ in range(envelope._MAX_DEPTH):
        deepest = [deepest]
    envelope.encode_payload("t", deepest)
    with pytest.raises(errors.PayloadNotSerializable, match=r"deeper than 200 levels at \$\[0\]\[0\]"):
        envelope.encode_payload("t", [deepest])


class _Level(enum.IntEnum):
    LOW = 1
    HIGH = 2


class _Skewed(enum.IntEnum):
    """An IntEnum whose integer is not its value: json writes the integer, orjson the value."""

    def __new__(cls, value: int) -> _Skewed:
        member = int.__new__(cls, value * 100)
        member._value_ = value
        return member

    ONE = 1


class _Colour(enum.StrEnum):
    RED = "red"


class _Rows(list):  # type: ignore[type-arg]
    """A list subclass that iterates over none of the items it holds (json reads __iter__)."""

    def __iter__(self):  # type: ignore[no-untyped-def]
        return iter(())


class _MultiValued(dict):  # type: ignore[type-arg]
    """Like Werkzeug's MultiDict (Flask's request.args): holds lists, gives the first of each."""

    def __init__(self, pairs: list[tuple[str, object]]) -> None:
        super().__init__()
        for key, value in pairs:
            dict.setdefault(self, key, []).append(value)

    def items(self):  # type: ignore[no-untyped-def]
        return [(key, values[0]) for key, values in dict.items(self)]

    def __iter__(self):  # type: ignore[no-untyped-def]
        return dict.__iter__(self)


_SCALARS = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.text()
    | st.sampled_from([_Level.HIGH, _Skewed.ONE, _Colour.RED])
)
_NO_FLOATS = st.recursive(
    _SCALARS,
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.lists(inner, max_size=4).map(tuple)
        | st.dictionaries(st.text(), inner, max_size=4)
        | st.dictionaries(st.text(), inner, max_size=4).map(collections.OrderedDict)
        | st.lists(st.tuples(st.text(max_size=2), inner), max_size=4).map(_MultiValued)
    ),
    max_leaves=20,
)


def _json_module(value: object) -> str:
    """What the ``json`` module writes with dumps' options, and dumps' escapes applied."""
    text = json.dumps(value, separators=(",", ":"), ensure_ascii=False)
    return envelope._NOT_CARRIED.sub(envelope._json_escape, text)


@given(_NO_FLOATS)
def test_payloads_encode_exactly_as_the_json_module_writes_them(value: object) -> None:
    """orjson for exact built-in types, the json module for the rest (integers past 64 bits,
    lone surrogates, subclasses, enums): the same text, character for character."""
    assert envelope.encode_payload("t", value) == _json_module(value)
    if not any(isinstance(v, enum.Enum) for v in _leaves(value)):  # enums: encode_payload's walk
        assert envelope.dumps(value) == _json_module(value)


def _leaves(value: object) -> list[object]:
    if isinstance(value, dict):
        return [leaf for item in value.items() for leaf in _leaves(item[1])]
    if isinstance(value, (list, tuple)):
        return [leaf for item in value for leaf in _leaves(item)]
    return [value]


def test_a_container_read_differently_by_its_storage_is_encoded_as_its_methods_say() -> None:
    """orjson reads a dict or list subclass from its storage; json and the payload walk read
    items() and __iter__. The walk's reading wins, so what was checked is what is written."""
    args = _MultiValued([("tag", "a"), ("tag", "b"), ("page", "2")])
    assert envelope.encode_payload("t", args) == '{"tag":"a","page":"2"}'

    class Hiding(dict):  # type: ignore[type-arg]
        def items(self):  # type: ignore[no-untyped-def]
            return [("ok", 1)]

    hidden = Hiding(ok=1, when=dt.datetime(2020, 1, 1), ratio=float("nan"))
    assert envelope.encode_payload("t", [hidden]) == '[{"ok":1}]'
    assert envelope.encode_payload("t", {"rows": _Rows([1, float("inf")])}) == '{"rows":[]}'
    ordered = collections.OrderedDict(a=1, b=2)
    ordered.move_to_end("a")
    assert envelope.encode_payload("t", ordered) == '{"b":2,"a":1}'
    assert envelope.encode_payload("t", {"level": _Skewed.ONE, "colour": _Colour.RED}) == (
        '{"level":100,"colour":"red"}'
    )


@given(st.recursive(st.floats(allow_nan=False, allow_infinity=False), st.lists, max_leaves=10))
def test_dumps_writes_floats_that_read_back_as_the_same_numbers(value: object) -> None:
    assert json.loads(envelope.dumps(value)) == value


def test_what_a_subclass_hides_from_the_walk_or_fails_to_give_is_refused() -> None:
    """A subclass read twice (by the walk, then by json) that shows a NaN only the second
    time, one whose __class__ claims to be int, and one whose own methods fail: refused,
    never written."""

    class Fickle(dict):  # type: ignore[type-arg]
        reads = 0

        def items(self):  # type: ignore[no-untyped-def]
            Fickle.reads += 1
            return [("a", 1.0 if Fickle.reads == 1 else float("nan"))]

    class Disguised(list):  # type: ignore[type-arg]
        __class__ = property(lambda self: int)  # type: ignore[assignment]

    class Broken(dict):  # type: ignore[type-arg]
        def items(self):  # type: ignore[no-untyped-def]
            return [("a", 1, "extra")]

    with pytest.raises(errors.PayloadNotSerializable, match="not JSON compliant"):
        envelope.encode_payload("t", {"x": Fickle(a=1.0)})
    with pytest.raises(errors.PayloadNotSerializable, match=r"inf at \$\.x\[0\]"):
        envelope.encode_payload("t", {"x": Disguised([float("inf")])})
    with pytest.raises(errors.PayloadNotSerializable, match="key 1 \\(int\\)"):
        envelope.encode_payload("t", {"x": Disguised([{1: 2}])})
    with pytest.raises(errors.PayloadNotSerializable, match="unpack") as caught:
        envelope.encode_payload("send_welcome", [Broken(a=1)])
    assert caught.value.task == "send_welcome"


def test_dumps_falls_back_to_json_for_what_orjson_refuses() -> None:
    class Ratio(float):
        pass

    assert envelope.dumps({"big": 2**64}) == '{"big":18446744073709551616}'
    assert envelope.dumps(["\ud800", "\uffff"]) == '["\\ud800","\\uffff"]'
    assert envelope.dumps([Ratio(0.5)]) == "[0.5]"
    assert envelope.encode_payload("t", {"r": Ratio(0.5)}) == '{"r":0.5}'
    with pytest.raises(errors.PayloadNotSerializable, match="nan"):
        envelope.encode_payload("t", {"r": Ratio("nan")})  # refused before orjson could write null


def test_size_counts_body_and_attribute_names_types_and_values() -> None:
    env = make()
    body = env.encode()
    attrs = env.message_attributes()
    expected = len(body)
    for name, attr in attrs.items():
        expected += len(name) + len(attr["DataType"]) + len(attr["StringValue"])
    signature = len("signature") + len("String") + 64  # counted whether or not the relay signs
    assert env.size_bytes() == expected + signature
    assert set(attrs) == {"run_id", "task", "tenant_id"}
    assert "tenant_id" not in make(tenant_id=None).message_attributes()


@pytest.mark.parametrize(
    ("task", "tenant_id", "payload_json"),
    [
        ("send_welcome", 3, '{"user_id":7}'),
        ("send_welcome", None, '{"note":"caf\u00e9 \u2603 \U0001f600"}'),  # 2-, 3- and 4-byte UTF-8
        ("tab\there", -9_223_372_036_854_775_808, "{}"),  # a task value SQS needs escaped
        ("", 0, '"\u00e9"'),  # no task attribute at all
    ],
)
def test_the_run_size_arithmetic_equals_the_attributes_it_stands_for(
    task: str, tenant_id: int | None, payload_json: str
) -> None:
    """The dispatch path measures a run without building its SQS attributes; the figure
    must be the one the relay's message (body + those attributes + signature) has."""
    env = make(task=task, tenant_id=tenant_id, payload_json=payload_json)
    body = env.encode()
    attributes = envelope.message_attributes(env.run_id, task, tenant_id)
    full = envelope.message_size_bytes(body, attributes) + envelope.SIGNATURE_SIZE_BYTES
    assert envelope.run_message_size_bytes(body, task, tenant_id) == full
    by_hand = len(body.encode()) + len("signature") + len("String") + 64
    for name, attribute in attributes.items():
        by_hand += len(name.encode()) + len(attribute["DataType"]) + len(attribute["StringValue"].encode())
    assert full == by_hand


@pytest.mark.parametrize(
    ("body", "reason"),
    [
        ("not json", "not-json"),
        ("[1, 2]", "not-an-object"),
        ('{"v": 2}', "bad-version"),
        ('{"v": true}', "bad-version"),
        ('{"v": 1, "run_id": "nope"}', "bad-field"),
        ('{"v": 1, "run_id": 5}', "bad-field"),
        ("NaN", "not-json"),
        ('{"v": 1e999}', "not-json"),
    ],
)
def test_malformed_bodies_are_refused_with_a_reason(body: str, reason: str) -> None:
    with pytest.raises(envelope.MalformedEnvelope) as caught:
        envelope.decode(body, max_bytes=262_144)
    assert caught.value.reason == reason


def _doc(**changes: object) -> str:
    doc = make().to_document()
    doc.update(changes)
    return json.dumps(doc)


@pytest.mark.parametrize(
    "changes",
    [
        {"task": "../../etc"},
        {"task": 5},
        {"queue": "../urgent"},  # a well-formed unknown name is refused when the lease is taken
        {"tenant_id": "3"},
        {"tenant_id": True},
        {"tenant_id": 2**70},
        {"payload": {"not": "text"}},
        {"payload": "{not json"},
        {"payload": "NaN"},
        {"trace": ["x"]},
        {"event": "bad event name!"},
        # what PostgreSQL's jsonb cannot hold was never sent by our relay
        {"idempotency_key": "a\x00b"},
        {"idempotency_key": "\ud800"},
        {"trace": {"traceparent": "\x00"}},
        {"trace": {"\udfff": "x"}},
        {"payload": '"\ud800"'},
    ],
)
def test_wrong_types_in_a_valid_looking_envelope_are_refused(changes: dict[str, object]) -> None:
    with pytest.raises(envelope.MalformedEnvelope) as caught:
        envelope.decode(_doc(**changes), max_bytes=262_144)
    assert caught.value.reason in {"bad-field", "bad-payload"}


def test_huge_body_is_refused_before_parsing() -> None:
    body = '{"v": 1, "pad": "' + "x" * 300_000 + '"}'
    with pytest.raises(envelope.MalformedEnvelope) as caught:
        envelope.decode(body, max_bytes=262_144)
    assert caught.value.reason == "too-large"


def test_deeply_nested_body_is_refused_not_crashing() -> None:
    body = "[" * 100_000 + "]" * 100_000
    with pytest.raises(envelope.MalformedEnvelope) as caught:
        envelope.decode(body, max_bytes=1_048_576)
    assert caught.value.reason == "not-json"


def test_signatures_verify_with_any_listed_key_and_reject_everything_else() -> None:
    body = make().encode()
    signature = envelope.sign(body, "new-key-0123456789")
    assert len(signature) == 64
    assert envelope.signature_valid(body, signature, ["new-key-0123456789", "old-key-0123456789"])
    assert envelope.signature_valid(
        body, envelope.sign(body, "old-key-0123456789"), ["new-key-0123456789", "old-key-0123456789"]
    )
    assert not envelope.signature_valid(body + " ", signature, ["new-key-0123456789"])
    assert not envelope.signature_valid(body, signature, ["another-key-0123456"])
    assert not envelope.signature_valid(body, None, ["new-key-0123456789"])
    assert not envelope.signature_valid(body, "", ["new-key-0123456789"])


def test_a_full_w3c_tracestate_travels_and_an_oversized_one_is_refused() -> None:
    members = ",".join(f"vendor{i}=" + "x" * 240 for i in range(32))  # the W3C maximum
    assert len(members) > 7_000
    doc = make().to_document()
    doc["trace"] = {"traceparent": "00-" + "1" * 32 + "-" + "2" * 16 + "-01", "tracestate": members}
    assert envelope.decode(json.dumps(doc), max_bytes=262_144).trace["tracestate"] == members
    doc["trace"]["tracestate"] = "x" * 9_000
    with pytest.raises(envelope.MalformedEnvelope):
        envelope.decode(json.dumps(doc), max_bytes=262_144)


def test_a_tracestate_too_long_to_carry_is_dropped_at_dispatch_and_the_trace_kept() -> None:
    """W3C Trace Context lets a propagator drop ``tracestate``; the worker would refuse it."""
    from opentelemetry import context, trace
    from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags, TraceState

    from sqla_outbox import tracing

    def carrier(state: TraceState) -> dict[str, str]:
        span_context = SpanContext(
            0x1234, 0x5678, is_remote=True, trace_flags=TraceFlags(1), trace_state=state
        )
        token = context.attach(trace.set_span_in_context(NonRecordingSpan(span_context)))
        try:
            return tracing.current_carrier()
        finally:
            context.detach(token)

    assert carrier(TraceState([("vendor", "abc")]))["tracestate"] == "vendor=abc"
    oversized = carrier(TraceState([(f"v{i:02d}" + "k" * 100, "x" * 250) for i in range(32)]))
    assert "tracestate" not in oversized and oversized["traceparent"].startswith("00-")


def test_the_carrier_is_empty_without_a_span_and_filled_with_one_even_beside_baggage() -> None:
    """The quick exit (an empty context) and the span check must not hide a real span: a
    context holding only baggage carries nothing, the same context with a span carries it."""
    from opentelemetry import baggage, context, trace
    from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags

    from sqla_outbox import tracing

    assert tracing.current_carrier() == {}
    with_baggage = baggage.set_baggage("user", "7")
    token = context.attach(with_baggage)
    try:
        assert tracing.current_carrier() == {}
    finally:
        context.detach(token)
    span = NonRecordingSpan(SpanContext(0x1234, 0x5678, is_remote=True, trace_flags=TraceFlags(1)))
    token = context.attach(trace.set_span_in_context(span, with_baggage))
    try:
        carried = tracing.current_carrier()
    finally:
        context.detach(token)
    assert carried["traceparent"] == f"00-{0x1234:032x}-{0x5678:016x}-01"
