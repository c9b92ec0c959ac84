"""Peer job queues measured beside sqla_outbox: procrastinate and pgqueuer.

Both come from the ``bench`` extra (``pip install -e '.[dev,bench]'`` into
``.venv-bench``), never from the library's dependencies. Their schemas are installed in
the benchmark's own database, beside our tables.

* procrastinate 3.x: the synchronous ``SyncPsycopgConnector`` for schema and ``defer``;
  ``task.configure(connection=<psycopg connection>).defer(...)`` runs the INSERT on the
  SQLAlchemy Session's own psycopg connection, inside its transaction (supported since
  procrastinate 3.x: "allowing atomic deferral within a user-managed transaction"). The
  worker uses the async ``PsycopgConnector`` (LISTEN/NOTIFY) in its own thread and loop.
* pgqueuer 1.x: only takes autocommit connections (its drivers refuse others), so it
  cannot join a SQLAlchemy transaction; jobs are enqueued with ``Queries.enqueue`` on an
  autocommit connection and run by a ``QueueManager`` (LISTEN/NOTIFY) in its own thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import psycopg

PGQ_ENTRYPOINT = "bench_noop"


# --- procrastinate ------------------------------------------------------------------------------
def procrastinate_app(url: str, *, handler: Callable[..., Any] | None = None, is_async: bool = False) -> Any:
    """A procrastinate App with one task ``bench_noop`` (sync connector)."""
    import procrastinate

    app = procrastinate.App(connector=procrastinate.SyncPsycopgConnector(conninfo=url))
    _register(app, handler, is_async)
    return app


def _register(app: Any, handler: Callable[..., Any] | None, is_async: bool) -> None:
    if is_async:

        async def bench_noop_async(**kwargs: Any) -> None:
            if handler is not None:
                handler(kwargs)

        app.task(name="bench_noop", queue="default")(bench_noop_async)
    else:

        def bench_noop(**kwargs: Any) -> None:
            if handler is not None:
                handler(kwargs)

        app.task(name="bench_noop", queue="default")(bench_noop)


def install_procrastinate(url: str) -> None:
    app = procrastinate_app(url)
    with app.open():
        app.schema_manager.apply_schema()


def procrastinate_defer(app: Any, connection: Any, **payload: Any) -> int:
    """Defer ``bench_noop`` on ``connection`` (a psycopg connection in a transaction)."""
    task = app.tasks["bench_noop"]
    job_id: int = task.configure(connection=connection).defer(**payload)
    return job_id


class ProcrastinateWorker:
    """A procrastinate worker (async connector, LISTEN/NOTIFY) in a thread of its own.

    Args:
        url: libpq URL. on_job: Called with the job's kwargs at handler start.
        concurrency: Worker concurrency.
    """

    def __init__(self, url: str, on_job: Callable[[dict[str, Any]], None], *, concurrency: int = 1) -> None:
        self.url = url
        self.on_job = on_job
        self.concurrency = concurrency
        self._loop: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Task[None] | None = None
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name="procrastinate-worker", daemon=True)

    def start(self) -> ProcrastinateWorker:
        self._thread.start()
        if not self._ready.wait(30):
            raise RuntimeError("procrastinate worker did not start")
        time.sleep(0.5)  # LISTEN established
        return self

    def _run(self) -> None:
        import procrastinate

        async def main() -> None:
            app = procrastinate.App(connector=procrastinate.PsycopgConnector(conninfo=self.url))
            _register(app, self.on_job, True)
            async with app.open_async():
                self._loop = asyncio.get_running_loop()
                self._task = asyncio.current_task()  # type: ignore[assignment]
                self._ready.set()
                with contextlib.suppress(asyncio.CancelledError):
                    await app.run_worker_async(
                        queues=["default"],
                        concurrency=self.concurrency,
                        wait=True,
                        listen_notify=True,
                        install_signal_handlers=False,
                        delete_jobs="successful",
                    )

        asyncio.run(main())

    def stop(self) -> None:
        if self._loop is not None and self._task is not None:
            self._loop.call_soon_threadsafe(self._task.cancel)
        self._thread.join(15)


# --- pgqueuer -----------------------------------------------------------------------------------
def install_pgqueuer(url: str) -> None:
    from pgqueuer.queries import Queries

    async def main() -> None:
        connection = await psycopg.AsyncConnection.connect(url, autocommit=True)
        try:
            await Queries.from_psycopg_connection(connection).install()
        finally:
            await connection.close()

    asyncio.run(main())


def pgqueuer_enqueue(url: str, count: int, *, chunk: int = 5_000) -> None:
    """Enqueue ``count`` ``bench_noop`` jobs in bulk (set-based, not timed)."""
    from pgqueuer.queries import Queries

    body = json.dumps({"order_id": 123456, "user_id": 42, "note": "benchmark payload"}).encode()

    async def main() -> None:
        connection = await psycopg.AsyncConnection.connect(url, autocommit=True)
        try:
            queries = Queries.from_psycopg_connection(connection)
            done = 0
            while done < count:
                n = min(chunk, count - done)
                await queries.enqueue([PGQ_ENTRYPOINT] * n, [body] * n, [0] * n)
                done += n
        finally:
            await connection.close()

    asyncio.run(main())


class PgqEnqueuer:
    """Synchronous single-job enqueue on an autocommit psycopg connection (for latency)."""

    def __init__(self, url: str) -> None:
        from pgqueuer.adapters.drivers.psycopg import PsycopgDriver
        from pgqueuer.queries import Queries

        self._loop = asyncio.new_event_loop()
        self._conn = self._loop.run_until_complete(psycopg.AsyncConnection.connect(url, autocommit=True))
        self._queries = Queries(PsycopgDriver(self._conn))
        self.body = json.dumps({"order_id": 123456, "user_id": 42, "note": "benchmark payload"}).encode()

    def enqueue(self) -> None:
        self._loop.run_until_complete(self._queries.enqueue(PGQ_ENTRYPOINT, self.body))

    def close(self) -> None:
        self._loop.run_until_complete(self._conn.close())
        self._loop.close()


class PgqWorker:
    """A pgqueuer QueueManager (asyncpg driver, LISTEN/NOTIFY) in a thread of its own.

    Args:
        url: libpq URL. on_job: Called at handler start (no arguments).
        batch_size: ``QueueManager.run(batch_size=...)`` (pgqueuer's default is 10).
        drain: Return once the queue is empty (``QueueExecutionMode.drain``).
    """

    def __init__(
        self,
        url: str,
        on_job: Callable[[], None] | None = None,
        *,
        batch_size: int = 10,
        drain: bool = False,
    ) -> None:
        self.url = url
        self.on_job = on_job
        self.batch_size = batch_size
        self.drain = drain
        self.elapsed = 0.0
        self.jobs = 0
        self._qm: Any = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name="pgqueuer", daemon=True)

    def start(self) -> PgqWorker:
        self._thread.start()
        if not self._ready.wait(30):
            raise RuntimeError("pgqueuer did not start")
        return self

    def run_here(self) -> float:
        """Run in the calling thread (drain mode); return the seconds it took."""
        self._run()
        return self.elapsed

    def _run(self) -> None:
        import asyncpg
        from pgqueuer import QueueManager
        from pgqueuer.queries import Queries
        from pgqueuer.types import QueueExecutionMode

        async def main() -> None:
            connection = await asyncpg.connect(self.url)
            qm = QueueManager(Queries.from_asyncpg_connection(connection))
            self._qm = qm
            self._loop = asyncio.get_running_loop()

            @qm.entrypoint(PGQ_ENTRYPOINT)
            async def bench_noop(job: Any) -> None:
                self.jobs += 1
                if self.on_job is not None:
                    self.on_job()

            self._ready.set()
            started = time.perf_counter()
            try:
                await qm.run(
                    dequeue_timeout=timedelta(seconds=30),
                    batch_size=self.batch_size,
                    mode=QueueExecutionMode.drain if self.drain else QueueExecutionMode.continuous,
                )
            finally:
                self.elapsed = time.perf_counter() - started
                await connection.close()

        asyncio.run(main())

    def stop(self) -> None:
        if self._loop is not None and self._qm is not None and not self._loop.is_closed():
            with contextlib.suppress(RuntimeError):
                self._loop.call_soon_threadsafe(self._qm.shutdown.set)
        self._thread.join(15)


@contextlib.contextmanager
def running(worker: Any) -> Iterator[Any]:
    worker.start()
    try:
        yield worker
    finally:
        worker.stop()
