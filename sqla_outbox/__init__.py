"""sqla_outbox: a transactional outbox for SQLAlchemy, relayed to AWS SQS.

Schedule work inside your own transaction; it exists exactly when the transaction
commits::

    import sqla_outbox
    from sqla_outbox import Dispatch, Publish

    sqla_outbox.install(SessionFactory)          # once, at start-up

    with SessionFactory() as session, session.begin():
        session.add(Order(...))
        session.add(Dispatch("send_receipt", {"order_id": 7}, tenant_id=3))
        session.add(Publish("order.placed", {"order_id": 7}, tenant_id=3))

``python -m sqla_outbox.relay`` sends committed rows to SQS; ``python -m
sqla_outbox.worker`` runs the handlers. The API process imports neither.

Layers, top to bottom (``docs/architecture.md``; checked by ``lint-imports``): ``cli`` →
``health | testing | ops`` → ``worker`` → ``relay`` → ``maintenance | events | migrations
| sqs | webhooks | presence`` → ``write | wakeup | models`` → ``dispatch`` →
``webhook_fanout`` → ``envelope | catalog`` → ``config | metrics | tracing | logging`` →
``errors | types | charsets | backoff | urls``.
"""

from __future__ import annotations

import inspect
import uuid
from typing import TYPE_CHECKING, Any

from sqla_outbox import lazy

# The submodule ``sqla_outbox.dispatch`` is imported here, before the ``dispatch()`` helper
# below is defined: importing it later would replace the package attribute ``dispatch``.
from sqla_outbox.dispatch import _MISSING, Dispatch, Group, Publish

if TYPE_CHECKING:  # the other names are imported on first use (PEP 562), not at import
    from sqla_outbox import errors
    from sqla_outbox.catalog import Catalog, TaskSpec
    from sqla_outbox.config import OutboxSettings
    from sqla_outbox.controls import Cancel, ControlOutcome, Reschedule
    from sqla_outbox.events import Installation, install, installation_for, uninstall
    from sqla_outbox.models import metadata
    from sqla_outbox.results import RunResult, get_result, get_result_async
    from sqla_outbox.types import JSONPayload, QueueName, RunStatus

__version__ = "0.2.0"  # SemVer; the package version (pyproject.toml reads it); docs/releasing.md

__all__ = [
    "Cancel",
    "Catalog",
    "ControlOutcome",
    "Dispatch",
    "Group",
    "Installation",
    "OutboxSettings",
    "Publish",
    "QueueName",
    "Reschedule",
    "RunResult",
    "RunStatus",
    "TaskSpec",
    "dispatch",
    "dispatch_async",
    "errors",
    "get_result",
    "get_result_async",
    "install",
    "installation_for",
    "metadata",
    "publish",
    "publish_async",
    "uninstall",
]

_EXPORTS = {
    "Catalog": "sqla_outbox.catalog",
    "TaskSpec": "sqla_outbox.catalog",
    "OutboxSettings": "sqla_outbox.config",
    "Cancel": "sqla_outbox.controls",
    "ControlOutcome": "sqla_outbox.controls",
    "Reschedule": "sqla_outbox.controls",
    "RunResult": "sqla_outbox.results",
    "get_result": "sqla_outbox.results",
    "get_result_async": "sqla_outbox.results",
    "Installation": "sqla_outbox.events",
    "install": "sqla_outbox.events",
    "installation_for": "sqla_outbox.events",
    "uninstall": "sqla_outbox.events",
    "metadata": "sqla_outbox.models",
    "JSONPayload": "sqla_outbox.types",
    "QueueName": "sqla_outbox.types",
    "RunStatus": "sqla_outbox.types",
}


__getattr__, __dir__ = lazy.attributes(__name__, _EXPORTS, __all__)
"""Public names and submodules are imported on first use, so ``import sqla_outbox`` (and
the pytest plugin, in projects that never use it) stays cheap."""


def _sync_only(session: Any, helper: str) -> None:
    """Refuse an asyncio session before touching it: its ``flush()`` is a coroutine that a
    sync helper could not await (the Dispatch would stay in the session, half done)."""
    if inspect.iscoroutinefunction(getattr(session, "flush", None)):
        raise TypeError(
            f"sqla_outbox.{helper}() takes a sync Session; for an AsyncSession use "
            f"`await sqla_outbox.{helper}_async(session, ...)`"
        )


def _async_only(session: Any, helper: str) -> None:
    if not inspect.iscoroutinefunction(getattr(session, "flush", None)):
        raise TypeError(
            f"sqla_outbox.{helper}_async() takes an AsyncSession; for a sync Session use "
            f"`sqla_outbox.{helper}(session, ...)`"
        )


def _resolved(item: Dispatch) -> uuid.UUID:
    if item.resolved_run_id is None:  # the flush did not reach sqla_outbox's listeners
        from sqla_outbox import errors

        raise errors.NotInstalled(
            f"the flush did not write {item!r}: the session has no sqla_outbox listeners "
            "(call sqla_outbox.install() on its session class or factory)"
        )
    return item.resolved_run_id


def dispatch(session: Any, task: str, payload: JSONPayload = _MISSING, **options: Any) -> uuid.UUID:
    """Add a :class:`Dispatch` and flush; return the run that will execute.

    Flushing resolves an idempotency key (or a caller-chosen ``run_id``) to an existing
    unfinished run, so the returned id is always the one to track. Works with a
    ``Session``, a ``scoped_session`` and a session bound to a connection (an Alembic
    migration's); for an ``AsyncSession`` use :func:`dispatch_async`.

    Args:
        session: A sync session with the listeners installed.
        task, payload, **options: As for :class:`Dispatch` (no ``payload`` means ``{}``;
            ``None`` is delivered as ``None``, as ``Dispatch`` delivers it).

    Returns:
        The resolved run id.

    Raises:
        TypeError: ``session`` is an ``AsyncSession`` (nothing was added to it).
        DispatchError: As :class:`Dispatch` and ``session.add`` raise it.
        NotInstalled: The session has no sqla_outbox listeners.
    """
    _sync_only(session, "dispatch")
    item = Dispatch(task, payload, **options)
    session.add(item)
    session.flush()
    return _resolved(item)


async def dispatch_async(
    session: Any, task: str, payload: JSONPayload = _MISSING, **options: Any
) -> uuid.UUID:
    """:func:`dispatch` for an ``AsyncSession`` (or ``async_scoped_session``): add, ``await``
    the flush, return the run that will execute.

    Raises:
        TypeError: ``session`` is not an asyncio session (nothing was added to it).
        DispatchError, NotInstalled: As :func:`dispatch`.
    """
    _async_only(session, "dispatch")
    item = Dispatch(task, payload, **options)
    session.add(item)
    await session.flush()
    return _resolved(item)


def publish(
    session: Any, event: str, payload: JSONPayload = _MISSING, **options: Any
) -> dict[str, uuid.UUID]:
    """Add a :class:`Publish` and flush; return ``{subscriber task: run id}``.

    Raises:
        TypeError: ``session`` is an ``AsyncSession`` (use :func:`publish_async`).
        DispatchError: As :class:`Publish` and ``session.add`` raise it.
    """
    _sync_only(session, "publish")
    item = Publish(event, payload, **options)
    session.add(item)
    session.flush()
    return item.resolved_run_ids


async def publish_async(
    session: Any, event: str, payload: JSONPayload = _MISSING, **options: Any
) -> dict[str, uuid.UUID]:
    """:func:`publish` for an ``AsyncSession``: add, ``await`` the flush, return
    ``{subscriber task: run id}``.

    Raises:
        TypeError: ``session`` is not an asyncio session.
    """
    _async_only(session, "publish")
    item = Publish(event, payload, **options)
    session.add(item)
    await session.flush()
    return item.resolved_run_ids
