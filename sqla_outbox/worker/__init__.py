"""The worker: ``python -m sqla_outbox.worker`` runs task handlers from SQS.

Application modules register handlers with :func:`task`; the worker imports them
(``--imports myapp.tasks`` / ``SQLA_OUTBOX_WORKER_IMPORTS``) and consumes the queues in
``QUEUES``. See :mod:`sqla_outbox.worker.consumer` for the loop,
:mod:`sqla_outbox.worker.handle` for what happens to each message, and
``docs/handlers.md`` for writing handlers.
"""

from __future__ import annotations

from sqla_outbox.worker.context import Cancelled, TaskContext
from sqla_outbox.worker.limits import Breaker
from sqla_outbox.worker.registry import (
    Registry,
    RetryPolicy,
    TaskDefinition,
    queue,
    registry,
    task,
    webhook_events,
)

__all__ = [
    "Breaker",
    "Cancelled",
    "Registry",
    "RetryPolicy",
    "TaskContext",
    "TaskDefinition",
    "Worker",
    "queue",
    "registry",
    "task",
    "webhook_events",
]


def __getattr__(name: str) -> object:
    # The Worker pulls in boto3; task modules that only use @task do not need it.
    if name == "Worker":
        from sqla_outbox.worker.consumer import Worker

        return Worker
    raise AttributeError(name)
