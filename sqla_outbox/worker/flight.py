"""One received message while the worker works on it (shared by receive, handle and heartbeat)."""

from __future__ import annotations

import asyncio
import dataclasses
import time
import uuid
from typing import Any

from sqla_outbox.worker.context import TaskContext


@dataclasses.dataclass
class InFlight:
    """A received message the worker is working on.

    Attributes:
        queue: Logical queue it was received from.
        message_id / receipt_handle: SQS identifiers of this delivery (the handle is a
            secret-ish token: logs show it shortened).
        receive_count: SQS ``ApproximateReceiveCount`` of this delivery.
        body / attributes: The raw, untrusted message body and message attributes.
        received_at / extended_at: ``time.monotonic()`` of the receive and of the last
            visibility extension (the heartbeat's clock).
        run_id / task_name: Set once the envelope was decoded.
        attempt / leased: The attempt number and whether this delivery holds the run's lease.
        ctx: The handler's context while it runs (its ``cancel_event`` stops it).
        task: The asyncio task handling this message.
        verdict: ``succeeded``, ``retrying`` or ``failed`` once recorded.
    """

    queue: str
    message_id: str
    receipt_handle: str
    receive_count: int
    body: str
    attributes: dict[str, Any]
    received_at: float = dataclasses.field(default_factory=time.monotonic)
    extended_at: float = dataclasses.field(default_factory=time.monotonic)
    run_id: uuid.UUID | None = None
    task_name: str | None = None
    attempt: int = 0
    ctx: TaskContext | None = None
    task: asyncio.Task[None] | None = None
    leased: bool = False
    verdict: str | None = None
