"""Receiving: one long-polling receiver per queue, sharing the worker's handler slots.

A receiver asks for at most as many messages as it holds slots, so a worker never
receives more than it can run (a received message's visibility timeout is already
ticking). Slots are shared between the queues by weighted fair queuing: when several
receivers wait for slots, the one with the least weighted service so far goes first.
Weights are critical 8, default 4, bulk 2, maintenance 1, so with every queue backed up
critical gets about 8 of every 15 slots and the others still progress (nobody starves).

A receiver whose last receive came back empty asks for a single slot for its next long
poll, so idle queues hold at most one slot each while waiting; once messages arrive it
asks for up to 10 (the ReceiveMessage maximum).
"""

from __future__ import annotations

import asyncio
import dataclasses

from sqla_outbox import queues

RECEIVE_MAX_MESSAGES = 10
"""ReceiveMessage returns at most 10 messages per call (SQS quota)."""


@dataclasses.dataclass
class _Waiter:
    queue: str
    want: int
    start: float
    future: asyncio.Future[int]


class SlotPool:
    """Counting semaphore for handler slots with weighted-fair grants between queues.

    Grants follow start-time fair queuing: a request's start tag is the later of the
    pool's virtual time and the finish tag of its queue's previous grant; waiters are
    served in start-tag order; a grant of ``n`` slots advances its queue's finish tag by
    ``n / weight``. A queue back from idle starts at the current virtual time, so it
    neither jumps ahead on old credit nor waits behind busy queues.

    Args:
        capacity: Handler slots (``worker_concurrency``).
        weights: Queue → weight (default: the built-in queues' weights,
            :meth:`sqla_outbox.queues.QueueRegistry.weights`).
    """

    def __init__(self, capacity: int, weights: dict[str, int] | None = None) -> None:
        self.capacity = capacity
        self.free = capacity
        self.weights = weights or queues.BUILTIN_REGISTRY.weights()
        self._virtual_time = 0.0
        self._finish: dict[str, float] = {}
        self._waiters: list[_Waiter] = []

    @property
    def busy(self) -> int:
        return self.capacity - self.free

    async def acquire(self, queue: str, want: int) -> int:
        """Wait for at least one slot; take up to ``want``. Returns how many were taken."""
        want = max(1, want)
        start = max(self._virtual_time, self._finish.get(queue, 0.0))
        if self.free > 0 and not self._waiters:
            return self._grant(queue, start, want)
        waiter = _Waiter(queue, want, start, asyncio.get_running_loop().create_future())
        self._waiters.append(waiter)
        try:
            return await waiter.future
        except asyncio.CancelledError:
            if waiter in self._waiters:
                self._waiters.remove(waiter)
            elif waiter.future.done() and not waiter.future.cancelled():
                self.release(waiter.future.result())
            raise

    def release(self, count: int = 1) -> None:
        """Give back ``count`` slots and grant waiters."""
        self.free = min(self.capacity, self.free + count)
        while self.free > 0 and self._waiters:
            waiter = min(self._waiters, key=lambda w: (w.start, -self.weights.get(w.queue, 1)))
            self._waiters.remove(waiter)
            if waiter.future.done():
                continue
            waiter.future.set_result(self._grant(waiter.queue, waiter.start, waiter.want))

    def _grant(self, queue: str, start: float, want: int) -> int:
        granted = min(want, self.free)
        self.free -= granted
        self._virtual_time = start
        self._finish[queue] = start + granted / self.weights.get(queue, 1)
        return granted
