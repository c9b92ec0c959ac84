"""Acknowledging messages in batches: DeleteMessageBatch instead of one DeleteMessage each.

A message is deleted only after its run's verdict is committed, so a delete that waits a
few milliseconds, or that fails, never loses anything: an undeleted message comes back
and is acknowledged then (its run is finished). Batching the deletes of one queue (up to
10 per call, the SQS batch limit) cuts the worker's SQS calls per run nearly in half.

A batch goes out when it has 10 entries, or ``linger_seconds`` (default 5 ms) after its
first entry arrived, whichever is first. The worker queues its deletes with
:meth:`AckBatcher.ack_soon` and frees the handler slot at once; :meth:`AckBatcher.close`
(at shutdown) sends what is still queued.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from sqla_outbox.logging import log_extra
from sqla_outbox.sqs.client import SQS_MAX_BATCH_ENTRIES, QueueDirectory, error_code

logger = logging.getLogger("sqla_outbox.worker")


@dataclasses.dataclass
class _Pending:
    receipt_handle: str
    done: asyncio.Future[bool]


class AckBatcher:
    """Collects deletes per queue and sends them with DeleteMessageBatch.

    Args:
        client: boto3 SQS client.
        directory: Queue URLs.
        run_blocking: Runs a blocking call off the event loop (the worker's ``io``).
        linger_seconds: Longest a delete waits for companions.
    """

    def __init__(
        self,
        client: Any,
        directory: QueueDirectory,
        run_blocking: Callable[..., Awaitable[Any]],
        *,
        linger_seconds: float = 0.005,
    ) -> None:
        self.client = client
        self.directory = directory
        self.run_blocking = run_blocking
        self.linger_seconds = linger_seconds
        self._pending: dict[str, list[_Pending]] = {}
        self._timers: dict[str, asyncio.TimerHandle] = {}
        self._inflight: set[asyncio.Task[None]] = set()

    async def ack(self, queue: str, receipt_handle: str) -> bool:
        """Delete one message (batched) and wait for the call.

        Returns:
            False when SQS refused the delete or the call failed.
        """
        return await asyncio.shield(self.ack_soon(queue, receipt_handle))

    def ack_soon(self, queue: str, receipt_handle: str) -> asyncio.Future[bool]:
        """Queue one delete and return at once (the worker frees the handler slot without
        waiting: the run's verdict is already committed). Returns the delete's future."""
        loop = asyncio.get_running_loop()
        entry = _Pending(receipt_handle, loop.create_future())
        batch = self._pending.setdefault(queue, [])
        batch.append(entry)
        if len(batch) >= SQS_MAX_BATCH_ENTRIES:
            self._flush(queue)
        elif queue not in self._timers:
            self._timers[queue] = loop.call_later(self.linger_seconds, self._flush, queue)
        return entry.done

    async def close(self) -> None:
        """Send what is pending and wait for every call in flight."""
        for queue in list(self._pending):
            self._flush(queue)
        if self._inflight:
            await asyncio.gather(*self._inflight, return_exceptions=True)

    def _flush(self, queue: str) -> None:
        timer = self._timers.pop(queue, None)
        if timer is not None:
            timer.cancel()
        batch = self._pending.pop(queue, [])
        if batch:
            task = asyncio.get_running_loop().create_task(self._send(queue, batch))
            self._inflight.add(task)
            task.add_done_callback(self._inflight.discard)

    async def _send(self, queue: str, batch: list[_Pending]) -> None:
        try:
            failed = await self.run_blocking(self._delete_batch, queue, [p.receipt_handle for p in batch])
        except Exception as exc:
            logger.warning(
                "delete failed",
                extra=log_extra(action="worker.ack_failed", queue=queue, error_code=error_code(exc)),
            )
            failed = set(range(len(batch)))
        for index, pending in enumerate(batch):
            if not pending.done.done():
                pending.done.set_result(index not in failed)

    def _delete_batch(self, queue: str, receipt_handles: list[str]) -> set[int]:
        response = self.client.delete_message_batch(
            QueueUrl=self.directory.url(queue),
            Entries=[{"Id": str(i), "ReceiptHandle": handle} for i, handle in enumerate(receipt_handles)],
        )
        failed = {int(entry["Id"]) for entry in response.get("Failed", [])}
        if failed:
            logger.warning(
                "deletes refused",
                extra=log_extra(action="worker.ack_failed", queue=queue, messages=len(failed)),
            )
        return failed
