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
"""

from __future__ import annotations

import uuid
from typing import Any

from sqla_outbox import errors
from sqla_outbox.catalog import Catalog, TaskSpec
from sqla_outbox.config import OutboxSettings
from sqla_outbox.dispatch import Dispatch, Publish
from sqla_outbox.events import Installation, install, installation_for, uninstall
from sqla_outbox.models import metadata
from sqla_outbox.types import JSONPayload, QueueName, RunStatus

__version__ = "0.1.0"

__all__ = [
    "Catalog",
    "Dispatch",
    "Installation",
    "OutboxSettings",
    "Publish",
    "QueueName",
    "RunStatus",
    "TaskSpec",
    "dispatch",
    "errors",
    "install",
    "installation_for",
    "metadata",
    "publish",
    "uninstall",
]


def dispatch(session: Any, task: str, payload: JSONPayload = None, **options: Any) -> uuid.UUID:
    """Add a :class:`Dispatch` and flush; return the run that will execute.

    Flushing resolves an idempotency key (or a caller-chosen ``run_id``) to an existing
    unfinished run, so the returned id is always the one to track. Works with a sync
    ``Session`` (for ``AsyncSession`` add a ``Dispatch`` and ``await session.flush()``).

    Args:
        session: A session with the listeners installed.
        task, payload, **options: As for :class:`Dispatch` (``payload`` None means ``{}``).

    Returns:
        The resolved run id.

    Raises:
        DispatchError: As :class:`Dispatch` and ``session.add`` raise it.
    """
    item = Dispatch(task, {} if payload is None else payload, **options)
    session.add(item)
    session.flush()
    assert item.resolved_run_id is not None
    return item.resolved_run_id


def publish(session: Any, event: str, payload: JSONPayload = None, **options: Any) -> dict[str, uuid.UUID]:
    """Add a :class:`Publish` and flush; return ``{subscriber task: run id}``."""
    item = Publish(event, {} if payload is None else payload, **options)
    session.add(item)
    session.flush()
    return item.resolved_run_ids
