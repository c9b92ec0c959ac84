"""One received message while the worker works on it (shared by receive, handle and heartbeat)."""

from __future__ import annotations

import asyncio
import dataclasses
import time
import uuid
from typing import Any

from sqla_outbox.worker.context import TaskContext

VISIBILITY_MARGIN_SECONDS = 60.0
"""Kept between the visibility the worker asks for and SQS's 12-hour ceiling (clock skew)."""


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
        visibility_ends_by: ``time.monotonic()`` after which SQS refuses to keep the
            message hidden: 12 hours after its *first* receive (SQS
            ``ApproximateFirstReceiveTimestamp``; this receive when SQS did not say).
        run_id / task_name / tenant_id: Set once the envelope was decoded.
        attempt / leased: The attempt number and whether this delivery holds the run's lease.
        ctx: The handler's context while it runs (its ``cancel_event`` stops it).
        task: The asyncio task handling this message.
        verdict: ``succeeded``, ``retrying``, ``failed`` or ``cancelled`` once recorded.
        stop_requested: Set by the heartbeat when a committed ``Cancel`` asked the run to
            stop (the attempt then ends ``cancelled`` without waiting for the handler).
        admission: The flow-control gate's admission while the run holds one
            (:class:`~sqla_outbox.worker.gate.Admission`).
        limit_outcome: How the attempt ends for the gate (``success``, ``failure``,
            ``neutral``; None: not executed, the admission is refunded).
        cap_reported: The heartbeat said SQS's 12-hour ceiling is near for this message.
    """

    queue: str
    message_id: str
    receipt_handle: str
    receive_count: int
    body: str
    attributes: dict[str, Any]
    received_at: float = dataclasses.field(default_factory=time.monotonic)
    extended_at: float = dataclasses.field(default_factory=time.monotonic)
    visibility_ends_by: float = dataclasses.field(default_factory=lambda: time.monotonic() + 43_200)
    run_id: uuid.UUID | None = None
    task_name: str | None = None
    tenant_id: int | None = None
    attempt: int = 0
    ctx: TaskContext | None = None
    task: asyncio.Task[None] | None = None
    leased: bool = False
    verdict: str | None = None
    stop_requested: asyncio.Event | None = None
    admission: Any = None
    limit_outcome: str | None = None
    cap_reported: bool = False

    def hideable_seconds(self, wanted: float, *, now: float | None = None) -> float:
        """``wanted`` seconds of visibility, cut to what SQS still allows for this message.

        SQS refuses a ChangeMessageVisibility that would keep a message hidden past 12
        hours (43,200 s) after it was first received (SQS ChangeMessageVisibility); the
        worker asks for at most that, less a minute for clock skew between this host and
        SQS. A timeout of 0 (visible at once) is always allowed.

        Returns:
            Seconds, within ``[0, wanted]``.
        """
        left = (
            self.visibility_ends_by - (time.monotonic() if now is None else now) - VISIBILITY_MARGIN_SECONDS
        )
        return max(0.0, min(wanted, left))
