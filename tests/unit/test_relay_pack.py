"""Packing rows into SendMessageBatch calls: <= 10 entries, <= the byte limit."""

from __future__ import annotations

import datetime as dt
import uuid

from sqla_outbox.relay.claim import ClaimedRow
from sqla_outbox.relay.send import build_entry, pack


def row(i: int, pad: int = 0) -> ClaimedRow:
    run_id = uuid.uuid4()
    return ClaimedRow(
        table="outbox_messages",
        id=i,
        run_id=run_id,
        queue="default",
        tenant_id=1,
        envelope={
            "v": 1,
            "run_id": str(run_id),
            "task": "t",
            "queue": "default",
            "tenant_id": 1,
            "payload": '"' + "x" * pad + '"',
        },
        attempts=0,
        available_at=dt.datetime.now(dt.UTC),
    )


def test_batches_hold_at_most_ten_entries_in_order() -> None:
    entries = [build_entry(row(i)) for i in range(25)]
    batches = list(pack(entries, max_bytes=262_144))
    assert [len(b) for b in batches] == [10, 10, 5]
    assert [e.row.id for b in batches for e in b] == list(range(25))


def test_batches_respect_the_byte_limit() -> None:
    entries = [build_entry(row(i, pad=100_000)) for i in range(5)]
    batches = list(pack(entries, max_bytes=262_144))
    assert [len(b) for b in batches] == [2, 2, 1]
    assert all(sum(e.size_bytes for e in b) <= 262_144 for b in batches)


def test_an_oversized_entry_travels_alone() -> None:
    entries = [build_entry(row(0)), build_entry(row(1, pad=300_000)), build_entry(row(2))]
    batches = list(pack(entries, max_bytes=262_144))
    assert [[e.row.id for e in b] for b in batches] == [[0], [1], [2]]


def test_entry_carries_run_id_task_and_tenant_attributes() -> None:
    entry = build_entry(row(7))
    assert entry.attributes["run_id"]["StringValue"] == str(entry.row.run_id)
    assert entry.attributes["task"]["StringValue"] == "t"
    assert entry.attributes["tenant_id"] == {"DataType": "Number", "StringValue": "1"}
    assert entry.size_bytes > len(entry.body)
