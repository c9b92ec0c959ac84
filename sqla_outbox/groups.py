"""Reading groups of runs: progress for the CLI, members' outcomes for the completion handler.

A group is dispatched with ``session.add(sqla_outbox.Group(members, on_complete=...))``
(:class:`sqla_outbox.dispatch.Group`). Its ``task_groups`` row counts the members not
finished yet; the database trigger ``task_runs_group_finish`` (migration sqlaob_0006)
decrements it in each member's finishing transaction and writes the completion run when it
reaches 0 (``docs/groups.md``, ADR 0016).

The completion handler reads what the members did with :func:`outcome`::

    @task("confirm_booking")
    def confirm_booking(payload, ctx):
        done = groups.outcome(ctx.session, ctx.run_id)
        if done.all_succeeded: ...

A member counts as finished once its status leaves queued, running and retrying: succeeded,
failed (given up), or any final status added later (a cancelled run, say).
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import uuid
from typing import Any

from sqlalchemy import bindparam, text
from sqlalchemy.dialects.postgresql import UUID

from sqla_outbox import models


@dataclasses.dataclass(frozen=True)
class Member:
    """One member run of a group.

    Attributes:
        run_id / task / status: The run and its current status.
        finished_status: The status it finished with (None while unfinished).
        result: The run's result, when ``task_runs`` has a ``result`` column; else None.
    """

    run_id: uuid.UUID
    task: str
    status: str
    finished_status: str | None
    result: Any = None


@dataclasses.dataclass(frozen=True)
class GroupState:
    """A group's progress (``n of m finished``) and, with ``members``, its runs.

    Attributes:
        group_id: The group. tenant_id: Tenant of its completion run (None: platform).
        total / finished: Members, and members finished so far.
        completion_task / completion_run_id: The completion run (it exists once
            ``completed_at`` is set). completion_status: Its status, or None before.
        created_at / completed_at: Dispatch time; when the last member finished.
        members: The member runs, oldest first (empty unless asked for).
    """

    group_id: uuid.UUID
    tenant_id: int | None
    total: int
    finished: int
    completion_task: str
    completion_run_id: uuid.UUID
    completion_status: str | None
    created_at: dt.datetime
    completed_at: dt.datetime | None
    members: tuple[Member, ...] = ()

    @property
    def succeeded(self) -> int:
        """Members that finished ``succeeded``."""
        return sum(1 for m in self.members if m.finished_status == "succeeded")

    @property
    def all_succeeded(self) -> bool:
        """Every member finished ``succeeded`` (needs ``members``)."""
        return bool(self.members) and all(m.finished_status == "succeeded" for m in self.members)

    @property
    def statuses(self) -> dict[str, str]:
        """``{run_id: finished status}`` of the finished members."""
        return {str(m.run_id): m.finished_status for m in self.members if m.finished_status}


_GROUP_COLUMNS = """
g.id, g.tenant_id, g.total, g.total - g.remaining AS finished, g.completion_task,
g.completion_run_id, c.status AS completion_status, g.created_at, g.completed_at, g.statuses
FROM task_groups AS g LEFT JOIN task_runs AS c ON c.run_id = g.completion_run_id
"""


def _state(row: Any, members: tuple[Member, ...] = ()) -> GroupState:
    return GroupState(
        group_id=row.id,
        tenant_id=row.tenant_id,
        total=row.total,
        finished=row.finished,
        completion_task=row.completion_task,
        completion_run_id=row.completion_run_id,
        completion_status=row.completion_status,
        created_at=row.created_at,
        completed_at=row.completed_at,
        members=members,
    )


def _members(connection: Any, group_id: uuid.UUID, statuses: dict[str, str]) -> tuple[Member, ...]:
    result = ", result" if "result" in models.task_runs.c else ", NULL AS result"
    rows = connection.execute(
        text(
            f"SELECT run_id, task, status{result} FROM task_runs WHERE group_id = :group_id "
            "ORDER BY created_at, run_id"
        ).bindparams(bindparam("group_id", type_=UUID(as_uuid=True))),
        {"group_id": group_id},
    )
    return tuple(
        Member(
            run_id=r.run_id,
            task=r.task,
            status=r.status,
            finished_status=statuses.get(str(r.run_id)),
            result=r.result,
        )
        for r in rows
    )


def _connection(session_or_connection: Any) -> Any:
    connection = getattr(session_or_connection, "connection", None)
    return connection() if callable(connection) else session_or_connection


def get_group(session_or_connection: Any, group_id: uuid.UUID) -> GroupState | None:
    """The group ``group_id`` with its members, or None when there is no such group.

    Args:
        session_or_connection: A sync ``Session`` or ``Connection`` (for an
            ``AsyncSession``: ``await session.run_sync(groups.get_group, group_id)``).
    """
    connection = _connection(session_or_connection)
    row = connection.execute(
        text(f"SELECT {_GROUP_COLUMNS} WHERE g.id = :group_id").bindparams(
            bindparam("group_id", type_=UUID(as_uuid=True))
        ),
        {"group_id": group_id},
    ).first()
    if row is None:
        return None
    return _state(row, _members(connection, row.id, dict(row.statuses)))


def outcome(session_or_connection: Any, completion_run_id: uuid.UUID) -> GroupState | None:
    """The group whose completion run is ``completion_run_id`` (a handler passes
    ``ctx.run_id``), with its members' finished statuses and results; None when the run
    completes no group.

    Args:
        session_or_connection: The handler's sync ``Session`` (``ctx.session``) or a
            ``Connection``; for an ``AsyncSession``:
            ``await ctx.session.run_sync(groups.outcome, ctx.run_id)``.
    """
    connection = _connection(session_or_connection)
    group_id = connection.execute(
        text("SELECT id FROM task_groups WHERE completion_run_id = :run_id").bindparams(
            bindparam("run_id", type_=UUID(as_uuid=True))
        ),
        {"run_id": completion_run_id},
    ).scalar()
    return None if group_id is None else get_group(connection, group_id)


def list_groups(
    session_or_connection: Any, *, unfinished_only: bool = False, limit: int = 50
) -> list[GroupState]:
    """Groups newest first, without their members.

    Args:
        unfinished_only: Only groups whose last member has not finished.
        limit: Most groups returned, >= 1.
    """
    connection = _connection(session_or_connection)
    where = "WHERE g.completed_at IS NULL" if unfinished_only else ""
    rows = connection.execute(
        text(f"SELECT {_GROUP_COLUMNS} {where} ORDER BY g.created_at DESC, g.id LIMIT :limit"),
        {"limit": limit},
    )
    return [_state(row) for row in rows]
