"""``python -m sqla_outbox runs show|list``: one run with its trail and result, or matching runs.

Read-only. Ages and age filters use the database clock (``clock_timestamp()``), so a
skewed operator laptop never shifts them. Age filters apply to ``created_at`` (when the
run was dispatched).

Lists are newest first, ordered by ``(created_at, run_id)`` descending, and paginated by
keyset (a :class:`RunCursor` names the last row seen), never by OFFSET: a page costs the
same at the millionth row as at the first. Index-backed (``task_runs_created_at_idx``,
``task_runs_task_created_at_idx``, ``task_runs_tenant_id_created_at_idx``, and
``task_runs_status_idx`` for rare statuses).
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import uuid
from collections.abc import Sequence
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from sqla_outbox import errors
from sqla_outbox.models import outbox_messages, platform_outbox_messages, task_run_trail, task_runs

DEFAULT_LIMIT = 50


RunNotFound = errors.RunNotFound


@dataclasses.dataclass(frozen=True)
class RunRecord:
    """A ``task_runs`` row (see :class:`sqla_outbox.models.TaskRun` for each column),
    plus ``age_seconds``: database now minus ``created_at``, and ``parked``: its outbox row
    is parked (SQS refused the message for good; ``python -m sqla_outbox outbox unpark``).
    ``result`` (the handler's JSON result) is read by :func:`get_run` only; lists leave it
    None (a result may be up to ``result_max_bytes``)."""

    run_id: uuid.UUID
    task: str
    event: str | None
    queue: str
    tenant_id: int | None
    status: str
    idempotency_key: str | None
    attempts: int
    available_at: dt.datetime
    created_at: dt.datetime
    updated_at: dt.datetime
    started_at: dt.datetime | None
    finished_at: dt.datetime | None
    lease_owner: str | None
    lease_expires_at: dt.datetime | None
    last_error_type: str | None
    last_error: str | None
    dead_lettered_at: dt.datetime | None
    age_seconds: float
    parked: bool
    cancel_requested_at: dt.datetime | None = None
    result: Any = None

    @property
    def standing_error_type(self) -> str | None:
        """``last_error_type`` while that error still describes the run: None once the run
        has succeeded (its last error was an earlier attempt's, kept in the trail)."""
        return None if self.status == "succeeded" else self.last_error_type


@dataclasses.dataclass(frozen=True)
class TrailEntry:
    """A ``task_run_trail`` row (see :class:`sqla_outbox.models.TaskRunTrail`).

    ``traceback`` is None unless asked for (it can be 4,000 characters per entry).
    """

    id: int
    at: dt.datetime
    status: str
    attempt: int | None
    receive_count: int | None
    worker_id: str | None
    error_type: str | None
    error_message: str | None
    traceback: str | None
    detail: dict[str, Any] | None


@dataclasses.dataclass(frozen=True)
class RunDetail:
    """A run and its whole trail, oldest event first."""

    run: RunRecord
    trail: list[TrailEntry]


@dataclasses.dataclass(frozen=True)
class RunCursor:
    """A position in a run list: the ``(created_at, run_id)`` of a row.

    :meth:`encode` / :meth:`decode` give it a URL-safe text form (``<UTC ISO time>Z~<uuid>``).
    """

    created_at: dt.datetime
    run_id: uuid.UUID

    def encode(self) -> str:
        at = self.created_at.astimezone(dt.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")  # no "+": URL-safe
        return f"{at}~{self.run_id}"

    @classmethod
    def decode(cls, text: str) -> RunCursor:
        """Parse :meth:`encode`'s form.

        Raises:
            ConfigurationError: ``text`` is not a cursor (it comes from a URL: untrusted).
        """
        created, _, run_id = text.partition("~")
        try:
            at = dt.datetime.fromisoformat(created)
            parsed = uuid.UUID(run_id)
        except ValueError:
            raise errors.ConfigurationError("not a position in the run list", option="cursor") from None
        if at.tzinfo is None:
            raise errors.ConfigurationError("the cursor time has no time zone", option="cursor")
        return cls(at, parsed)


@dataclasses.dataclass(frozen=True)
class RunFilter:
    """Filters of ``runs list``; every given filter must match (AND).

    Attributes:
        tasks: Task names (any of). statuses: Run statuses (any of).
        queues: Logical queues (any of).
        tenant_id: A tenant id; ``"platform"`` selects runs without a tenant; None: any.
        tenant_ids: When not None, only runs of these tenants (never platform runs): what a
            dashboard operator restricted to tenants may see, on top of ``tenant_id``.
        parked: Only runs whose outbox row is parked (True) or is not (False); None: any.
        older_than: Only runs created longer ago than this.
        newer_than: Only runs created more recently than this.
        created_after / created_before: Only runs created at or after / before this
            instant (timezone-aware).
        before: Keyset cursor: only runs after this position in the list's order (the
            next page: older ones, or newer with ``oldest_first``).
        after: Keyset cursor: only runs before this position in the list's order (the
            previous page); still returned in the list's order.
        limit: Most runs returned, in the list's order.
        oldest_first: List the oldest runs first (by creation time, then run id) instead
            of the newest.
        run_id_prefix: Only runs whose id starts with these hex digits (1..32, dashes
            ignored): the run-id search. A range of the primary key, so it costs an index
            range scan, never a scan of ``task_runs``.
    """

    tasks: tuple[str, ...] = ()
    statuses: tuple[str, ...] = ()
    queues: tuple[str, ...] = ()
    tenant_id: int | str | None = None
    tenant_ids: frozenset[int] | None = None
    older_than: dt.timedelta | None = None
    newer_than: dt.timedelta | None = None
    created_after: dt.datetime | None = None
    created_before: dt.datetime | None = None
    before: RunCursor | None = None
    after: RunCursor | None = None
    limit: int = DEFAULT_LIMIT
    parked: bool | None = None
    run_id_prefix: str | None = None
    oldest_first: bool = False


def run_id_range(prefix: str) -> tuple[uuid.UUID, uuid.UUID]:
    """The smallest and largest run ids that start with ``prefix`` (hex digits, dashes
    ignored, any case). PostgreSQL orders ``uuid`` values by their bytes, so these bound an
    index range scan.

    Raises:
        ValueError: ``prefix`` is empty, longer than 32 hex digits, or not hex.
    """
    digits = prefix.replace("-", "").lower()
    if not 1 <= len(digits) <= 32 or any(c not in "0123456789abcdef" for c in digits):
        raise ValueError(f"{prefix!r} is not the start of a run id (1..32 hex digits)")
    return uuid.UUID(digits.ljust(32, "0")), uuid.UUID(digits.ljust(32, "f"))


_NOW = sa.func.clock_timestamp(type_=sa.DateTime(timezone=True))
_AGE = sa.cast(sa.extract("epoch", _NOW - task_runs.c.created_at), sa.Float).label("age_seconds")
_IS_PARKED = sa.or_(
    *(
        sa.exists().where(table.c.run_id == task_runs.c.run_id, table.c.parked_at.is_not(None))
        for table in (outbox_messages, platform_outbox_messages)
    )
)
_PARKED = _IS_PARKED.label("parked")


_LISTED = [column for column in task_runs.c if column.name != "result"]


def _record(row: Any) -> RunRecord:
    values: dict[str, Any] = {f.name: getattr(row, f.name, None) for f in dataclasses.fields(RunRecord)}
    return RunRecord(**values)


def get_run(connection: Connection, run_id: uuid.UUID, *, with_traceback: bool = False) -> RunDetail:
    """The run ``run_id`` and its trail.

    Args:
        connection: Connection to the outbox database.
        run_id: The run.
        with_traceback: Include each trail entry's traceback excerpt.

    Raises:
        RunNotFound: No such run.
    """
    row = connection.execute(
        sa.select(task_runs, _AGE, _PARKED).where(task_runs.c.run_id == run_id)
    ).one_or_none()
    if row is None:
        raise RunNotFound(run_id)
    trail = [
        TrailEntry(
            id=t.id,
            at=t.at,
            status=t.status,
            attempt=t.attempt,
            receive_count=t.receive_count,
            worker_id=t.worker_id,
            error_type=t.error_type,
            error_message=t.error_message,
            traceback=t.traceback if with_traceback else None,
            detail=t.detail,
        )
        for t in connection.execute(
            sa.select(task_run_trail).where(task_run_trail.c.run_id == run_id).order_by(task_run_trail.c.id)
        )
    ]
    return RunDetail(run=_record(row), trail=trail)


def list_runs(connection: Connection, filters: RunFilter) -> list[RunRecord]:
    """Runs matching ``filters``, newest ``(created_at, run_id)`` first, at most ``filters.limit``.

    Raises:
        ConfigurationError: ``limit`` is below 1, ``tenant_id`` is neither an integer
            nor ``"platform"``, or both cursors are given.
    """
    if filters.limit < 1:
        raise errors.ConfigurationError("must be >= 1", option="--limit")
    if filters.before is not None and filters.after is not None:
        raise errors.ConfigurationError("give one of before and after", option="cursor")
    query = sa.select(*_LISTED, _AGE, _PARKED)
    if filters.parked is not None:
        query = query.where(_IS_PARKED if filters.parked else sa.not_(_IS_PARKED))
    if filters.tasks:
        query = query.where(task_runs.c.task.in_(list(filters.tasks)))
    if filters.run_id_prefix is not None:
        try:
            low, high = run_id_range(filters.run_id_prefix)
        except ValueError as exc:
            raise errors.ConfigurationError(str(exc), option="--run-id-prefix") from None
        query = query.where(task_runs.c.run_id.between(low, high))
    if filters.statuses:
        query = query.where(task_runs.c.status.in_(list(filters.statuses)))
    if filters.queues:
        query = query.where(task_runs.c.queue.in_(list(filters.queues)))
    if filters.tenant_ids is not None:
        query = query.where(task_runs.c.tenant_id.in_(sorted(filters.tenant_ids)))
    if filters.tenant_id == "platform":
        query = query.where(task_runs.c.tenant_id.is_(None))
    elif isinstance(filters.tenant_id, int):
        query = query.where(task_runs.c.tenant_id == filters.tenant_id)
    elif filters.tenant_id is not None:
        raise errors.ConfigurationError("must be a tenant id or 'platform'", option="--tenant")
    if filters.older_than is not None:
        query = query.where(task_runs.c.created_at < _NOW - filters.older_than)
    if filters.newer_than is not None:
        query = query.where(task_runs.c.created_at > _NOW - filters.newer_than)
    if filters.created_after is not None:
        query = query.where(task_runs.c.created_at >= filters.created_after)
    if filters.created_before is not None:
        query = query.where(task_runs.c.created_at < filters.created_before)
    created, run_id = task_runs.c.created_at, task_runs.c.run_id

    # (created_at, run_id) against a cursor, spelled so that an index on created_at bounds the scan
    def earlier(cursor: RunCursor) -> tuple[Any, Any]:
        return created <= cursor.created_at, sa.or_(created < cursor.created_at, run_id < cursor.run_id)

    def later(cursor: RunCursor) -> tuple[Any, Any]:
        return created >= cursor.created_at, sa.or_(created > cursor.created_at, run_id > cursor.run_id)

    onward, back = (later, earlier) if filters.oldest_first else (earlier, later)
    listed = (created.asc(), run_id.asc()) if filters.oldest_first else (created.desc(), run_id.desc())
    reverse = (created.desc(), run_id.desc()) if filters.oldest_first else (created.asc(), run_id.asc())
    if filters.before is not None:
        query = query.where(*onward(filters.before))
    if filters.after is not None:  # the previous page: read backwards from the cursor, then turn round
        query = query.where(*back(filters.after)).order_by(*reverse).limit(filters.limit)
        return [_record(row) for row in reversed(list(connection.execute(query)))]
    query = query.order_by(*listed).limit(filters.limit)
    return [_record(row) for row in connection.execute(query)]


def tenants_of(connection: Connection, run_ids: Sequence[uuid.UUID]) -> dict[uuid.UUID, int | None]:
    """``{run_id: tenant_id}`` of the runs that exist among ``run_ids`` (None: a platform run)."""
    if not run_ids:
        return {}
    query = sa.select(task_runs.c.run_id, task_runs.c.tenant_id).where(task_runs.c.run_id.in_(list(run_ids)))
    return {row.run_id: row.tenant_id for row in connection.execute(query)}


def statuses_of(connection: Connection, run_ids: Sequence[uuid.UUID]) -> dict[uuid.UUID, str]:
    """``{run_id: status}`` for the runs that exist among ``run_ids``."""
    if not run_ids:
        return {}
    rows = connection.execute(
        sa.select(task_runs.c.run_id, task_runs.c.status).where(task_runs.c.run_id.in_(list(run_ids)))
    )
    return {row.run_id: str(row.status) for row in rows}
