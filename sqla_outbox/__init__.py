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
``errors | types``.
"""

from __future__ import annotations

import importlib
import uuid
from typing import TYPE_CHECKING, Any

# The submodule ``sqla_outbox.dispatch`` is imported here, before the ``dispatch()`` helper
# below is defined: importing it later would replace the package attribute ``dispatch``.
from sqla_outbox.dispatch import Dispatch, Publish

if TYPE_CHECKING:  # the other names are imported on first use (PEP 562), not at import
    from sqla_outbox import errors
    from sqla_outbox.catalog import Catalog, TaskSpec
    from sqla_outbox.config import OutboxSettings
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

_EXPORTS = {
    "Catalog": "sqla_outbox.catalog",
    "TaskSpec": "sqla_outbox.catalog",
    "OutboxSettings": "sqla_outbox.config",
    "Installation": "sqla_outbox.events",
    "install": "sqla_outbox.events",
    "installation_for": "sqla_outbox.events",
    "uninstall": "sqla_outbox.events",
    "metadata": "sqla_outbox.models",
    "JSONPayload": "sqla_outbox.types",
    "QueueName": "sqla_outbox.types",
    "RunStatus": "sqla_outbox.types",
}


def __getattr__(name: str) -> Any:
    """Import public names and submodules on first use, so ``import sqla_outbox`` (and the
    pytest plugin, in projects that never use it) stays cheap."""
    module = _EXPORTS.get(name)
    if module is not None:
        value = getattr(importlib.import_module(module), name)
        globals()[name] = value
        return value
    try:
        return importlib.import_module(f"{__name__}.{name}")
    except ModuleNotFoundError as exc:
        if exc.name != f"{__name__}.{name}":
            raise
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


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
