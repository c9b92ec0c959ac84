"""Taking leases in batches: the messages of one receive share one transaction.

A receive brings up to 10 messages, and the worker starts a handling task for each in the
same event-loop turn; each then needs its run's lease
(:func:`sqla_outbox.lifecycle.attempts.take_lease`). Taken one by one, that is a thread hop, a
checkout, a ``BEGIN`` and a ``COMMIT`` per message (ADR 0017, item 4). :class:`LeaseBatcher`
collects the requests made in one loop turn and takes them in one transaction on one I/O
thread: one commit for the batch, the same statement per run as before, so every rule of
``take_lease`` (the envelope compared with the outbox row, the due time, a live lease
elsewhere; decision 0004) holds unchanged.

The statements run in ``run_id`` order, so two workers batching copies of the same runs
lock them in the same order and never deadlock each other. A database error fails the
whole batch: each of its messages is then handled like any failed lease (logged; the
message comes back after its visibility timeout), as one error did for one message before.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from sqlalchemy.engine import Engine

from sqla_outbox.lifecycle import attempts

_Request = tuple[dict[str, Any], "asyncio.Future[attempts.Claim]"]


class LeaseBatcher:
    """Takes the leases requested in one event-loop turn in one transaction.

    Args:
        engine: The worker's engine.
        run_blocking: Runs a blocking call off the loop (the worker's ``io``).
    """

    def __init__(self, engine: Engine, run_blocking: Callable[..., Awaitable[Any]]) -> None:
        self.engine = engine
        self.run_blocking = run_blocking
        self._pending: list[_Request] = []
        self._scheduled = False
        self._inflight: set[asyncio.Task[None]] = set()

    async def take(self, **arguments: Any) -> attempts.Claim:
        """``take_lease(connection, **arguments)``, batched with the other requests of this
        loop turn, committed before it returns.

        Raises:
            Exception: Whatever the batch's transaction raised.
        """
        loop = asyncio.get_running_loop()
        future: asyncio.Future[attempts.Claim] = loop.create_future()
        future.add_done_callback(lambda f: f.cancelled() or f.exception())  # its awaiter may be gone
        self._pending.append((arguments, future))
        if not self._scheduled:
            self._scheduled = True
            loop.call_soon(self._flush)  # after every task ready in this turn asked
        return await asyncio.shield(future)

    def _flush(self) -> None:
        batch, self._pending, self._scheduled = self._pending, [], False
        task = asyncio.get_running_loop().create_task(self._send(batch))
        self._inflight.add(task)
        task.add_done_callback(self._inflight.discard)

    async def _send(self, batch: list[_Request]) -> None:
        try:
            claims = await self.run_blocking(self._take_all, [arguments for arguments, _ in batch])
        except Exception as exc:
            for _, future in batch:
                if not future.done():
                    future.set_exception(exc)
            return
        for (_, future), claim in zip(batch, claims, strict=True):
            if not future.done():
                future.set_result(claim)

    def _take_all(self, requests: list[dict[str, Any]]) -> list[attempts.Claim]:
        order = sorted(range(len(requests)), key=lambda i: str(requests[i]["run_id"]))
        claims: list[attempts.Claim | None] = [None] * len(requests)
        with self.engine.begin() as connection:
            for i in order:
                claims[i] = attempts.take_lease(connection, **requests[i])
        return [claim for claim in claims if claim is not None]
