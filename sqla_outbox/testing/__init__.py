"""Helpers for an application's own tests: what a transaction dispatched, and running it inline.

Everything here reads and writes real rows; nothing is mocked. Assert what your code
scheduled::

    from sqla_outbox import testing

    with SessionFactory() as session, session.begin():
        place_order(session, tenant_id=1, product_id=101, quantity=2, email="a@example.com")
        testing.assert_dispatched(session, "send_receipt", tenant_id=1)   # same transaction
    testing.assert_published(engine, "order.placed", subscribers=["award_loyalty", "notify_warehouse"])

then execute those runs with the real handler code, without SQS, a relay or a worker::

    report = testing.run_pending(SessionFactory)
    report.assert_all_succeeded()

Reading (:func:`dispatched`, :func:`assert_dispatched`, :func:`assert_not_dispatched`,
:func:`assert_published`) accepts a ``Session`` (flushed first, then read inside its
transaction, so uncommitted dispatches are visible), a ``Connection`` (read in its
transaction), an ``Engine`` or a ``sessionmaker`` (committed rows only). For an
``AsyncSession``, call them through ``await session.run_sync(testing.dispatched, ...)``.

Running (:func:`run_pending`) does, for each due pending outbox row, what the relay and
the worker do together as far as the database is concerned: decode the envelope
(:func:`sqla_outbox.envelope.decode`), take the run's lease
(:func:`sqla_outbox.lifecycle.attempts.take_lease`), call the handler registered with ``@task``
with a real :class:`~sqla_outbox.worker.context.TaskContext` whose session commits
together with ``running → succeeded``, record failures (``retrying`` / ``failed``, with
trail rows), and mark the outbox row sent. Follow-up work that handlers dispatch runs in
the next round. It needs committed rows, like the real worker (it uses its own
transactions); tests that wrap everything in one rolled-back transaction can use the
reading helpers but not :func:`run_pending`.

What inline execution does not do: per-attempt timeouts are not enforced (the context
still carries ``deadline_at``), backoff delays are not waited (a transient failure is
retried at once), and nothing reaches SQS or a DLQ (a permanent failure ends ``failed``
with its trail rows, but no ``dead_lettered_at``). The pytest plugin
(:mod:`sqla_outbox.pytest_plugin`) wraps them, as an :class:`Outbox`, in an ``outbox`` fixture; see
``docs/testing.md``.
"""

from __future__ import annotations

from sqla_outbox.testing.database import database_server, embedded_database
from sqla_outbox.testing.inline import WORKER_ID, RoundLimitReached, RunOutcome, RunReport, run_pending
from sqla_outbox.testing.outbox import Outbox
from sqla_outbox.testing.reading import (
    ANY,
    AnyValue,
    DelayMatcher,
    DispatchedRun,
    PayloadMatcher,
    assert_dispatched,
    assert_not_dispatched,
    assert_published,
    dispatched,
)

__all__ = [
    "ANY",
    "WORKER_ID",
    "AnyValue",
    "DelayMatcher",
    "DispatchedRun",
    "Outbox",
    "PayloadMatcher",
    "RoundLimitReached",
    "RunOutcome",
    "RunReport",
    "assert_dispatched",
    "assert_not_dispatched",
    "assert_published",
    "database_server",
    "dispatched",
    "embedded_database",
    "run_pending",
]
