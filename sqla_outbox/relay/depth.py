"""The bounded queue depth: hand SQS only what the workers will take soon.

SQS is roughly first in, first out within a queue: whatever sits in it is ahead of the
next tenant's run, and nothing there can be reordered, paused or cancelled. So the relay
keeps each queue's waiting (visible) messages at or below ``relay_queue_depth`` and
leaves the rest of the backlog in the outbox, where the fair claim, priority, pauses and
rate limits apply (docs/flow-control.md).

The depth is read with GetQueueAttributes (``ApproximateNumberOfMessages``) at most every
``relay_depth_poll_seconds`` per queue while the queue is near its bound, and counted
forward locally with what the relay sends in between. The default bound is
``2 x worker_concurrency`` per live worker (``worker_presence``), at least 20: each
worker's next receive finds work while a new tenant's run waits behind at most about two
rounds of handler slots (the last count of live workers this relay saw, so a restart of
every worker does not flood SQS). Before this relay has seen any live worker (workers
that predate presence, none started yet, or ``relay_hold_unserved`` off so presence is
not read) the default bounds nothing, as the hold of ADR 0010 holds nothing then: the
relay sends as before.
If the depth cannot be read (SQS error), the relay sends as if
the queue were empty, as it did before this bound existed: a failed read never stops the
flow (it is logged once per outage).

"Approximate" is SQS's word: the figure may lag a second behind; the bound is a target,
not a guarantee.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from sqla_outbox.logging import error_fields, log_extra

logger = logging.getLogger("sqla_outbox.relay")

MIN_AUTO_DEPTH = 20


def auto_depth(worker_concurrency: int, live_workers: int) -> int:
    """The default ``relay_queue_depth``: ``2 x worker_concurrency x live workers``, >= 20."""
    return max(MIN_AUTO_DEPTH, 2 * worker_concurrency * max(1, live_workers))


class DepthGauge:
    """Per-queue room in SQS: ``bound - (last read depth + sent since the read)``.

    Args:
        read: ``queue -> visible messages`` (GetQueueAttributes); may raise.
        poll_seconds: Re-read a queue's depth at most this often.
        clock: Monotonic seconds (tests pass their own).
    """

    def __init__(
        self, read: Callable[[str], int], *, poll_seconds: float, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._read = read
        self.poll_seconds = poll_seconds
        self._clock = clock
        self._depth: dict[str, int] = {}
        self._read_at: dict[str, float] = {}
        self._failing = False

    def room(self, queue: str, bound: int) -> int:
        """Messages the relay may send to ``queue`` now (0..bound)."""
        now = self._clock()
        if now - self._read_at.get(queue, float("-inf")) >= self.poll_seconds:
            try:
                self._depth[queue] = self._read(queue)
                if self._failing:
                    self._failing = False
                    logger.info("queue depth readable again", extra=log_extra(action="relay.depth_ok"))
            except Exception as exc:
                if not self._failing:
                    self._failing = True
                    logger.warning(
                        "cannot read the queue depth: sending without the bound",
                        extra=log_extra(action="relay.depth_unread", queue=queue, **error_fields(exc)),
                    )
                self._depth[queue] = 0
            self._read_at[queue] = now
        return max(0, bound - self._depth.get(queue, 0))

    def sent(self, queue: str, count: int) -> None:
        """Count ``count`` messages sent to ``queue`` since the last read."""
        self._depth[queue] = self._depth.get(queue, 0) + count
