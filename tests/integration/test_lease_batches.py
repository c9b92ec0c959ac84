"""Leases of one receive taken in one transaction (issue 17, ``worker/leases.py``), with every
rule of ``take_lease`` intact: real PostgreSQL, real rows."""

from __future__ import annotations

import asyncio
import json
import uuid
from typing import Any

import sqlalchemy as sa
from sqlalchemy.orm import Session, sessionmaker

from sqla_outbox import Dispatch, envelope
from sqla_outbox.lifecycle import attempts
from sqla_outbox.worker.leases import LeaseBatcher
from tests.support import outbox_rows, run_row


def _dispatch(app: sessionmaker[Session]) -> uuid.UUID:
    with app() as session, session.begin():
        item = Dispatch("audit", {"mode": "ok"})
        session.add(item)
    return item.run_id


def _request(engine: sa.Engine, run_id: uuid.UUID, *, document: str | None = None) -> dict[str, Any]:
    [row] = [r for r in outbox_rows(engine) if r.run_id == run_id]
    env = envelope.decode(envelope.encode_document(row.envelope), max_bytes=262_144)
    return {
        "run_id": env.run_id,
        "task": env.task,
        "tenant_id": env.tenant_id,
        "worker_id": "batching-worker",
        "lease_seconds": 60,
        "receive_count": 1,
        "document": document or env.encode(),
        "queue": env.queue,
    }


def test_one_receive_takes_its_leases_in_one_commit_and_each_gets_its_own_verdict(
    app: sessionmaker[Session], engine: sa.Engine
) -> None:
    free, held, forged = (_dispatch(app) for _ in range(3))
    with engine.begin() as conn:  # another worker holds a live lease on `held`
        attempts.take_lease(
            conn,
            run_id=held,
            task="audit",
            tenant_id=None,
            worker_id="other",
            lease_seconds=60,
            receive_count=1,
        )
    forged_request = _request(engine, forged)
    document = json.loads(forged_request["document"])
    document["payload"] = json.dumps({"mode": "evil"})
    forged_request["document"] = json.dumps(document)
    commits: list[Any] = []

    def count(conn: Any) -> None:
        commits.append(conn)

    sa.event.listen(engine, "commit", count)
    batcher = LeaseBatcher(engine, lambda fn, *a: asyncio.to_thread(fn, *a))

    async def receive() -> list[attempts.Claim]:
        return await asyncio.gather(
            batcher.take(**_request(engine, free)),
            batcher.take(**_request(engine, held)),
            batcher.take(**forged_request),
        )

    try:
        claims = asyncio.run(receive())
    finally:
        sa.event.remove(engine, "commit", count)
    assert [c.status for c in claims] == [
        attempts.ClaimStatus.CLAIMED,
        attempts.ClaimStatus.LEASED,
        attempts.ClaimStatus.MISMATCH,
    ]
    assert len(commits) == 1
    assert (run_row(engine, free).status, run_row(engine, free).lease_owner) == ("running", "batching-worker")
    assert (run_row(engine, held).lease_owner, run_row(engine, held).attempts) == ("other", 1)
    assert (run_row(engine, forged).status, run_row(engine, forged).attempts) == ("queued", 0)


def test_a_failing_batch_fails_every_lease_in_it_and_takes_none(
    app: sessionmaker[Session], engine: sa.Engine
) -> None:
    first, second = _dispatch(app), _dispatch(app)
    broken = _request(engine, second)
    broken["lease_seconds"] = "not a number"  # the database refuses the statement
    batcher = LeaseBatcher(engine, lambda fn, *a: asyncio.to_thread(fn, *a))

    async def receive() -> list[Any]:
        return await asyncio.gather(
            batcher.take(**_request(engine, first)), batcher.take(**broken), return_exceptions=True
        )

    outcomes = asyncio.run(receive())
    assert all(isinstance(o, sa.exc.DBAPIError) for o in outcomes)
    assert (run_row(engine, first).status, run_row(engine, first).attempts) == ("queued", 0)


def test_a_copy_of_a_retrying_run_received_before_its_backoff_ends_is_an_early_copy(
    app: sessionmaker[Session], engine: sa.Engine
) -> None:
    """A replayed copy (even a validly signed one: it is the run's own envelope) of a run
    waiting for its retry is NOT_DUE until the backoff ends; the attempt is not counted."""
    run_id = _dispatch(app)
    request = _request(engine, run_id)
    with engine.begin() as conn:
        first = attempts.take_lease(conn, **request)
        assert first.status is attempts.ClaimStatus.CLAIMED
        attempt = attempts.Attempt(run_id, first.attempt, 1, "batching-worker")
        failure = attempts.Failure("TimeoutError", "upstream slow")
        assert attempts.mark_retrying(conn, attempt, failure, backoff_seconds=25.4)
    with engine.begin() as conn:
        replayed = attempts.take_lease(conn, **{**request, "receive_count": 2})
    assert replayed.status is attempts.ClaimStatus.NOT_DUE
    # due when the run's own message comes back (whole seconds), less the tolerance
    assert 22.0 < replayed.due_in_seconds <= 24.0
    assert (run_row(engine, run_id).status, run_row(engine, run_id).attempts) == ("retrying", 1)
    with engine.begin() as conn:  # a retry without delay (Retry(0), backoff 0): due at once
        due_now = "UPDATE task_runs SET available_at = clock_timestamp() WHERE run_id = :r"
        conn.execute(sa.text(due_now), {"r": run_id})
        again = attempts.take_lease(conn, **{**request, "receive_count": 2})
        assert again.status is attempts.ClaimStatus.CLAIMED
        attempt = attempts.Attempt(run_id, again.attempt, 2, "batching-worker")
        assert attempts.mark_retrying(conn, attempt, failure, backoff_seconds=0.4)
    with engine.begin() as conn:
        third = attempts.take_lease(conn, **{**request, "receive_count": 3})
        assert third.status is attempts.ClaimStatus.CLAIMED
