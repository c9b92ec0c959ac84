"""Property: any plain-JSON payload reaches the handler byte for byte; anything else is refused at add."""

from __future__ import annotations

import datetime as dt
import decimal
import json
import uuid
from typing import Any

import sqlalchemy as sa
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy.orm import Session, sessionmaker

from sqla_outbox import Dispatch, envelope, errors
from sqla_outbox.relay.claim import ClaimedRow
from sqla_outbox.relay.send import build_entry
from tests.support import count

JSON_LEAVES = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**80), max_value=2**80)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text()
)
JSON = st.recursive(
    JSON_LEAVES,
    lambda children: (
        st.lists(children, max_size=5) | st.dictionaries(st.text(max_size=10), children, max_size=5)
    ),
    max_leaves=25,
)
NOT_JSON_LEAVES = st.sampled_from(
    [
        b"bytes",
        {1, 2},
        frozenset(),
        object(),
        float("nan"),
        float("inf"),
        float("-inf"),
        dt.datetime(2026, 1, 1),
        dt.date(2026, 1, 1),
        uuid.UUID(int=7),
        decimal.Decimal("1.1"),
        complex(1, 2),
    ]
)
PROPERTY_SETTINGS = settings(
    max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


def through_the_pipeline(engine: sa.Engine, run_id: uuid.UUID) -> Any:
    """What the handler receives: jsonb row → relay body (as sent to SQS) → worker decode."""
    with engine.connect() as conn:
        row = conn.execute(
            sa.text(
                "SELECT id, run_id, queue, envelope, attempts, available_at FROM platform_outbox_messages "
                "WHERE run_id = :r"
            ),
            {"r": run_id},
        ).one()
    claimed = ClaimedRow(
        "platform_outbox_messages",
        row.id,
        row.run_id,
        row.queue,
        None,
        row.envelope,
        row.attempts,
        row.available_at,
    )
    body = build_entry(claimed, "a-signing-key-0123456789").body
    return envelope.decode(body, max_bytes=262_144).payload


@PROPERTY_SETTINGS
@given(payload=JSON)
def test_any_json_payload_round_trips_byte_for_byte(
    app: sessionmaker[Session], engine: sa.Engine, payload: Any
) -> None:
    with app() as session, session.begin():
        item = Dispatch("audit", payload)
        session.add(item)
    received = through_the_pipeline(engine, item.run_id)
    assert json.dumps(received) == json.dumps(payload)
    assert type(received) is type(payload)


def with_bad_leaf(draw: st.DrawFn) -> Any:
    good = draw(st.lists(JSON, max_size=3))
    bad = draw(NOT_JSON_LEAVES)
    where = draw(st.sampled_from(["list", "dict", "nested", "root", "key"]))
    if where == "root":
        return bad
    if where == "list":
        return [*good, bad]
    if where == "dict":
        return {"ok": good, "bad": bad}
    if where == "key":
        return {draw(st.integers()): "int keys are not JSON object keys"}
    return {"a": [{"b": [bad]}]}


@PROPERTY_SETTINGS
@given(payload=st.composite(with_bad_leaf)())
def test_anything_else_is_refused_at_add_and_nothing_is_written(
    app: sessionmaker[Session], engine: sa.Engine, payload: Any
) -> None:
    before = count(engine, "task_runs")
    with app() as session, session.begin():
        try:
            session.add(Dispatch("audit", payload))
        except errors.PayloadNotSerializable as exc:
            assert exc.task == "audit"
            assert "payload is not JSON" in str(exc)
        else:
            raise AssertionError(f"accepted a non-JSON payload: {payload!r}")
    assert count(engine, "task_runs") == before
