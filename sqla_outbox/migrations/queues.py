"""Queues of your own in the database: the outbox tables' queue CHECK constraints.

``outbox_messages``, ``platform_outbox_messages`` and ``task_runs`` CHECK that ``queue`` is
a known queue (the four defaults after our migrations). An application that declares more
queues in its catalog (``docs/queues.md``) widens those constraints with a revision in
*its own* Alembic environment, through the operation this module registers::

    import sqla_outbox.migrations.queues  # registers op.set_outbox_queues

    def upgrade():
        op.set_outbox_queues(["reminders"], previous=[])

    def downgrade():
        op.set_outbox_queues([], previous=["reminders"])

The four defaults are always kept, so a list names only the declared queues (naming the
defaults too changes nothing). The operation is reversible (``previous`` is what the
downgrade restores; ``reverse()`` swaps the two) and renders in offline ``--sql`` mode.

Autogenerate writes that revision for you when env.py passes the hook::

    from sqla_outbox.migrations import queues as outbox_queues
    context.configure(
        ...,
        process_revision_directives=outbox_queues.autogenerate(Catalog.load("tasks.json")),
    )

``alembic revision --autogenerate`` then compares the catalog's queues with the
constraint in the database and adds ``op.set_outbox_queues(...)`` (with ``previous`` read
from the database) to the new revision's upgrade, and its reverse to the downgrade, only
when they differ, with ``depends_on`` our head revision when the environment holds ours;
``alembic check`` reports the difference. A directive hook (rather than
a comparator plugin) works the same on every Alembic version this package supports.

Downgrading below a queue's revision fails while rows still use the queue (PostgreSQL
refuses a CHECK that existing rows violate): purge or move them first.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from alembic.autogenerate import renderers
from alembic.operations import MigrateOperation, Operations
from sqlalchemy import text

from sqla_outbox import errors
from sqla_outbox.types import QUEUE_NAMES, is_queue_name

QUEUE_CHECKED_TABLES = ("outbox_messages", "platform_outbox_messages", "task_runs")
"""Tables whose ``<table>_queue_check`` constraint lists the allowed queues."""


def _normalise(queues: Iterable[str]) -> tuple[str, ...]:
    """The declared queues in order, defaults removed, each checked (they end up in SQL)."""
    out: list[str] = []
    for queue in queues:
        if not is_queue_name(queue):
            raise errors.ConfigurationError(
                f"{queue!r} is not a queue name (1..40 letters, digits, '-' and '_')",
                option="set_outbox_queues",
            )
        if queue not in QUEUE_NAMES and queue not in out:
            out.append(queue)
    return tuple(out)


def check_condition(queues: Iterable[str]) -> str:
    """SQL of the queue CHECK allowing the four defaults and ``queues``."""
    names = (*QUEUE_NAMES, *_normalise(queues))
    return "queue IN ({})".format(", ".join(f"'{q}'" for q in names))


@Operations.register_operation("set_outbox_queues")
class SetOutboxQueuesOp(MigrateOperation):
    """Set the declared queues the outbox tables accept (``op.set_outbox_queues``).

    Args:
        queues: Declared queue names the tables accept after this operation (besides the
            four defaults, always accepted).
        previous: Those accepted before it; what :meth:`reverse` (the downgrade) restores.
            Default: none (the four defaults only).

    Raises:
        ConfigurationError: A name is not a queue name (``types.QUEUE_NAME_PATTERN``).
    """

    def __init__(self, queues: Iterable[str], previous: Iterable[str] = ()) -> None:
        self.queues = _normalise(queues)
        self.previous = _normalise(previous)

    @classmethod
    def set_outbox_queues(
        cls, operations: Operations, queues: Iterable[str], previous: Iterable[str] = ()
    ) -> Any:
        """Replace the queue CHECK of the outbox tables (see :class:`SetOutboxQueuesOp`)."""
        return operations.invoke(cls(queues, previous))

    def reverse(self) -> SetOutboxQueuesOp:
        return SetOutboxQueuesOp(self.previous, self.queues)

    def to_diff_tuple(self) -> tuple[Any, ...]:
        return ("set_outbox_queues", self.queues, self.previous)


@Operations.implementation_for(SetOutboxQueuesOp)
def _set_outbox_queues(operations: Operations, operation: SetOutboxQueuesOp) -> None:
    condition = check_condition(operation.queues)
    for table in QUEUE_CHECKED_TABLES:
        name = f"{table}_queue_check"
        operations.drop_constraint(operations.f(name), table, type_="check")
        operations.create_check_constraint(operations.f(name), table, condition)


@renderers.dispatch_for(SetOutboxQueuesOp)
def _render_set_outbox_queues(autogen_context: Any, operation: SetOutboxQueuesOp) -> str:
    autogen_context.imports.add("import sqla_outbox.migrations.queues  # registers op.set_outbox_queues")
    return f"op.set_outbox_queues({list(operation.queues)!r}, previous={list(operation.previous)!r})"


_QUOTED = re.compile(r"'((?:[^']|'')*)'")


def current_queues(connection: Any) -> tuple[str, ...]:
    """The declared queues ``outbox_messages``'s queue CHECK accepts now (defaults left out).

    Raises:
        ConfigurationError: The constraint does not exist (our migrations have not run).
    """
    definition = connection.execute(
        text(
            "SELECT pg_get_constraintdef(oid) FROM pg_constraint "
            "WHERE conname = 'outbox_messages_queue_check' AND conrelid = 'outbox_messages'::regclass"
        )
    ).scalar()
    if definition is None:
        raise errors.ConfigurationError(
            "outbox_messages has no queue CHECK constraint: run sqla_outbox's migrations first "
            "(alembic upgrade heads)",
            option="set_outbox_queues",
        )
    return tuple(
        q for q in (m.replace("''", "'") for m in _QUOTED.findall(definition)) if q not in QUEUE_NAMES
    )


def _depend_on_our_head(context: Any, script: Any) -> None:
    """When this Alembic environment also holds sqla_outbox's revisions (its
    ``version_locations``), make the generated revision depend on our head: on a database
    built from scratch, ``alembic upgrade heads`` then creates the outbox tables (and
    their CHECK) before it widens them. An environment without our revisions (the outbox
    migrated by ``python -m sqla_outbox migrate``) is left alone: there the name would not
    resolve."""
    directory = getattr(context, "script", None)
    if directory is None:
        return
    try:
        ours = [r.revision for r in directory.get_revisions("sqla_outbox@head") if r is not None]
    except Exception:  # alembic.util.CommandError: no sqla_outbox branch in this environment
        return
    existing = script.depends_on
    if isinstance(existing, str):
        existing = (existing,)
    merged = tuple(dict.fromkeys([*(existing or ()), *ours]))
    script.depends_on = merged or None


def autogenerate(catalog: Any, *, then: Callable[..., None] | None = None) -> Callable[..., None]:
    """A ``process_revision_directives`` hook adding ``op.set_outbox_queues`` to an
    autogenerated revision when the database's queue CHECK differs from the catalog.

    Args:
        catalog: The application's :class:`~sqla_outbox.catalog.Catalog` (its ``queues``),
            or a sequence of declared queue names.
        then: Your own ``process_revision_directives``, called afterwards.

    Returns:
        The hook, for ``context.configure(process_revision_directives=...)``.
    """
    wanted = _normalise(catalog.queues if hasattr(catalog, "queues") else catalog)

    def hook(context: Any, revision: Any, directives: Sequence[Any]) -> None:
        connection = getattr(context, "connection", None)
        script = directives[0] if directives else None
        if connection is not None and script is not None and script.upgrade_ops is not None:
            current = current_queues(connection)
            if set(current) != set(wanted):
                operation = SetOutboxQueuesOp(wanted, current)
                script.upgrade_ops.ops.append(operation)
                script.downgrade_ops.ops.insert(0, operation.reverse())
                _depend_on_our_head(context, script)
        if then is not None:
            then(context, revision, directives)

    return hook
