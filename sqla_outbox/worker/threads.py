"""Threads for sync handlers: reused when free, never shared by two attempts at once.

A sync handler runs on a thread of its own, so one that ignores cancellation (a timeout,
a stop) keeps only its own thread and can never starve the others of threads. Starting
a thread per attempt cost about 0.15 ms of CPU per run (``Thread.start`` in a profile of
``benchmarks/bench_worker.py``); :class:`HandlerThreads` keeps that rule but reuses a
thread once its attempt returned: an attempt takes an idle thread when there is one and
starts a new one otherwise. A thread still stuck in an abandoned attempt is simply not
idle, so the next attempt gets another. At most ``max_idle`` idle threads are kept; the
others end. Each call runs in a fresh :class:`contextvars.Context`, as on a new thread.
"""

from __future__ import annotations

import asyncio
import contextvars
import queue
import threading
from collections.abc import Callable
from typing import Any

_Job = tuple[Callable[[], Any], asyncio.AbstractEventLoop, "asyncio.Future[Any]"]


class HandlerThreads:
    """Daemon threads running one blocking call each at a time.

    Args:
        max_idle: Idle threads kept for reuse (the worker passes ``worker_concurrency``).
        name: Thread name prefix.
    """

    def __init__(self, *, max_idle: int, name: str = "sqla-outbox-handler") -> None:
        self.max_idle = max_idle
        self.name = name
        self._idle: list[queue.SimpleQueue[_Job | None]] = []
        self._lock = threading.Lock()
        self._count = 0

    def run(self, fn: Callable[[], Any]) -> asyncio.Future[Any]:
        """Start ``fn()`` on a free thread; the returned future (of the running loop)
        settles with its result or exception. Nobody needs to await it (a handler that
        outlives its timeout settles a future nobody awaits)."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Any] = loop.create_future()
        future.add_done_callback(lambda f: f.cancelled() or f.exception())
        with self._lock:
            inbox = self._idle.pop() if self._idle else None
            if inbox is None:
                self._count += 1
                number = self._count
        if inbox is None:
            inbox = queue.SimpleQueue()
            threading.Thread(
                target=self._serve, args=(inbox,), name=f"{self.name}-{number}", daemon=True
            ).start()
        inbox.put((fn, loop, future))
        return future

    def close(self) -> None:
        """Let the idle threads end (busy ones end when their call returns)."""
        with self._lock:
            idle, self._idle = self._idle, []
            self.max_idle = 0
        for inbox in idle:
            inbox.put(None)

    def _serve(self, inbox: queue.SimpleQueue[_Job | None]) -> None:
        while True:
            job = inbox.get()
            if job is None:
                return
            fn, loop, future = job
            try:
                value, ok = contextvars.Context().run(fn), True  # fresh, as on a new thread
            except BaseException as exc:
                value, ok = exc, False
            try:
                loop.call_soon_threadsafe(_settle, future, ok, value)
            except RuntimeError:  # the loop is gone (worker stopped); nothing awaits this
                pass
            del job, fn, value
            with self._lock:
                if len(self._idle) >= self.max_idle:
                    return
                self._idle.append(inbox)


def _settle(future: asyncio.Future[Any], ok: bool, value: Any) -> None:
    if future.done():
        return
    if ok:
        future.set_result(value)
    else:
        future.set_exception(value)
