"""The helpers bound to one application database (the pytest plugin's ``outbox`` fixture)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from sqla_outbox.catalog import Catalog
from sqla_outbox.config import OutboxSettings
from sqla_outbox.testing.inline import RunReport, run_pending
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
from sqla_outbox.worker.registry import Registry

# --------------------------------------------------------------------------------------
# bound helper (what the pytest plugin's ``outbox`` fixture gives)


class Outbox:
    """The helpers above bound to one application database.

    Reads go through ``session`` when a method is given one (uncommitted work of that
    transaction is visible), else through ``source`` (committed rows).

    Args:
        source: The application's installed ``sessionmaker`` (or an ``Engine``).
        registry / catalog / settings: Passed to :func:`run_pending`.
    """

    def __init__(
        self,
        source: Any,
        *,
        registry: Registry | None = None,
        catalog: Catalog | None = None,
        settings: OutboxSettings | None = None,
    ) -> None:
        self.source = source
        self.registry = registry
        self.catalog = catalog
        self.settings = settings

    def dispatched(
        self,
        *,
        task: str | AnyValue = ANY,
        event: str | AnyValue | None = ANY,
        tenant_id: int | AnyValue | None = ANY,
        session: Any = None,
    ) -> list[DispatchedRun]:
        """See :func:`dispatched`."""
        return dispatched(
            self.source if session is None else session, task=task, event=event, tenant_id=tenant_id
        )

    def assert_dispatched(
        self,
        task: str,
        *,
        payload: PayloadMatcher = ANY,
        tenant_id: int | AnyValue | None = ANY,
        delay: DelayMatcher = ANY,
        queue: str | AnyValue = ANY,
        event: str | AnyValue | None = ANY,
        idempotency_key: str | AnyValue | None = ANY,
        status: str | AnyValue = ANY,
        count: int | None = None,
        session: Any = None,
    ) -> list[DispatchedRun]:
        """See :func:`assert_dispatched`."""
        return assert_dispatched(
            self.source if session is None else session,
            task,
            payload=payload,
            tenant_id=tenant_id,
            delay=delay,
            queue=queue,
            event=event,
            idempotency_key=idempotency_key,
            status=status,
            count=count,
        )

    def assert_not_dispatched(
        self,
        task: str,
        *,
        payload: PayloadMatcher = ANY,
        tenant_id: int | AnyValue | None = ANY,
        delay: DelayMatcher = ANY,
        queue: str | AnyValue = ANY,
        event: str | AnyValue | None = ANY,
        idempotency_key: str | AnyValue | None = ANY,
        status: str | AnyValue = ANY,
        session: Any = None,
    ) -> None:
        """See :func:`assert_not_dispatched`."""
        assert_not_dispatched(
            self.source if session is None else session,
            task,
            payload=payload,
            tenant_id=tenant_id,
            delay=delay,
            queue=queue,
            event=event,
            idempotency_key=idempotency_key,
            status=status,
        )

    def assert_published(
        self,
        event: str,
        *,
        payload: PayloadMatcher = ANY,
        tenant_id: int | AnyValue | None = ANY,
        delay: DelayMatcher = ANY,
        idempotency_key: str | AnyValue | None = ANY,
        subscribers: Iterable[str] | None = None,
        count: int | None = None,
        session: Any = None,
    ) -> list[DispatchedRun]:
        """See :func:`assert_published`."""
        return assert_published(
            self.source if session is None else session,
            event,
            payload=payload,
            tenant_id=tenant_id,
            delay=delay,
            idempotency_key=idempotency_key,
            subscribers=subscribers,
            count=count,
        )

    def run_pending(
        self,
        *,
        include_delayed: bool = False,
        retries: bool = True,
        tasks: Iterable[str] | None = None,
        max_rounds: int = 10,
    ) -> RunReport:
        """See :func:`run_pending` (with this object's source, registry, catalog and settings)."""
        return run_pending(
            self.source,
            registry=self.registry,
            catalog=self.catalog,
            settings=self.settings,
            include_delayed=include_delayed,
            retries=retries,
            tasks=tasks,
            max_rounds=max_rounds,
        )
