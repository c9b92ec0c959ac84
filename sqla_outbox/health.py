"""Health: the HTTP probe of relay and worker, and the ``--check`` service report.

The probe (:class:`ProbeServer`, on ``SQLA_OUTBOX_HEALTH_PORT``, bound to
``SQLA_OUTBOX_HEALTH_HOST``) answers:

* ``GET /livez`` — 200 while the process runs its loop;
* ``GET /readyz`` — 200 while it takes work, 503 once it is stopping (SIGTERM) or not
  ready, so an orchestrator stops routing to it;
* ``GET /metrics`` — Prometheus metrics (``sqla_outbox.metrics``).
"""

from __future__ import annotations

import dataclasses
import errno
import http.server
import socket
import threading
from collections.abc import Callable, Collection
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from sqla_outbox import errors, metrics
from sqla_outbox.config import OutboxSettings, redact_url


class _IPv6Server(http.server.ThreadingHTTPServer):
    address_family = socket.AF_INET6


class ProbeServer:
    """Tiny HTTP server for liveness, readiness and metrics, in a daemon thread.

    Args:
        port: TCP port (0 picks a free one; see :attr:`port` after :meth:`start`).
        ready: Called per ``/readyz`` request; True means ready.
        alive: Called per ``/livez`` request; True means alive.
        host: Address to bind (``health_host``; default every IPv4 interface).
        roles: Whose metrics ``/metrics`` shows (:func:`sqla_outbox.metrics.served`):
            ``{"relay"}``, ``{"worker"}``, or both for a worker that runs the relay.

    Raises:
        ConfigurationError: The port cannot be bound (in use, or privileged).
    """

    def __init__(
        self,
        port: int,
        *,
        ready: Callable[[], bool],
        alive: Callable[[], bool] = lambda: True,
        host: str = "0.0.0.0",  # noqa: S104 - probes come from the orchestrator
        roles: Collection[str] = metrics.ROLES,
    ) -> None:
        self._ready = ready
        self._alive = alive
        served = metrics.served(roles)
        probe = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                if self.path == "/livez":
                    self._answer(200 if probe._alive() else 503, b"alive\n")
                elif self.path == "/readyz":
                    ok = probe._ready()
                    self._answer(200 if ok else 503, b"ready\n" if ok else b"not ready\n")
                elif self.path == "/metrics":
                    self._answer(200, generate_latest(served), CONTENT_TYPE_LATEST)
                else:
                    self._answer(404, b"not found\n")

            def _answer(self, status: int, body: bytes, content_type: str = "text/plain") -> None:
                self.send_response(status)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: Any) -> None:
                return

        server_class = _IPv6Server if ":" in host else http.server.ThreadingHTTPServer
        try:
            self._server = server_class((host, port), Handler)
        except OSError as exc:  # EADDRINUSE, EACCES for a privileged port, an unknown address
            host_problem = isinstance(exc, socket.gaierror) or exc.errno == errno.EADDRNOTAVAIL
            raise errors.ConfigurationError(
                f"cannot serve probes on {host}:{port}: {exc.strerror or exc}",
                option="SQLA_OUTBOX_HEALTH_HOST" if host_problem else "SQLA_OUTBOX_HEALTH_PORT",
            ) from None
        self._server.daemon_threads = True
        self.port = int(self._server.server_address[1])
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="sqla-outbox-probe", daemon=True
        )

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()


@dataclasses.dataclass
class CheckResult:
    """One line of a ``--check`` report: a service, whether it answered, and details."""

    service: str
    ok: bool
    detail: str


@dataclasses.dataclass
class CheckReport:
    results: list[CheckResult]

    @property
    def ok(self) -> bool:
        return all(r.ok for r in self.results)

    def ok_without(self, *results: CheckResult) -> bool:
        """Whether every check other than ``results`` passed."""
        return all(r.ok for r in self.results if not any(r is x for x in results))


def check_services(settings: OutboxSettings, *, need_queues: bool) -> CheckReport:
    """Reach PostgreSQL (and the outbox tables), Valkey, the PostgreSQL wake's ``LISTEN``
    connection when that wake is in force, and SQS; never raises."""
    results = [_check_database(settings), _check_valkey(settings)]
    if settings.wake_notify:
        results.append(_check_listen(settings))
    if need_queues:
        results.append(_check_queues(settings))
    return CheckReport(results)


def check_handlers(settings: OutboxSettings) -> CheckResult:
    """The worker's registered handlers against its queues (see ``Registry.preflight``)."""
    from sqla_outbox.worker.registry import registry

    try:
        warnings = registry.preflight(
            settings, queues=settings.worker_queues, queues_chosen=settings.worker_queues_chosen
        )
    except errors.ConfigurationError as exc:
        return CheckResult("handlers", False, str(exc))
    queues = ", ".join(settings.worker_queues)
    detail = f"{len(registry.tasks)} tasks; queues {queues}"
    return CheckResult("handlers", True, "; ".join([detail, *warnings]))


def check_partitions(settings: OutboxSettings) -> CheckResult:
    """This relay's ``relay_partitions`` against the relays running on the database.

    Fails only when a relay that owns partitions runs with another value: this relay would
    then wait until those stop (docs/scaling.md). Relays with another value that are
    themselves waiting do not fail the check (they never take work from relays like this
    one); the detail names them.
    """
    import sqlalchemy as sa

    from sqla_outbox.relay.partitions import active_relays

    try:
        engine = sa.create_engine(
            settings.sqlalchemy_url, hide_parameters=True, connect_args={"connect_timeout": 5}
        )
        with engine.connect() as conn:
            running = active_relays(conn, settings)
        engine.dispose()
    except Exception as exc:
        return CheckResult(
            "relay_partitions", False, f"could not read the running relays: {type(exc).__name__}"
        )
    mine = settings.relay_partitions
    active = [r for r in running if r.partitions]
    blocking = sorted({r.relay_partitions for r in active if r.relay_partitions != mine})
    waiting_other = sorted({r.relay_partitions for r in running if not r.partitions} - {mine})
    if blocking:
        shown = ", ".join(str(v) for v in blocking)
        return CheckResult(
            "relay_partitions",
            False,
            f"{mine} here, but the active relays on this database use {shown}: this relay would "
            "wait until they stop; set SQLA_OUTBOX_RELAY_PARTITIONS to the same value everywhere",
        )
    detail = f"{mine}; {len(running)} relay(s) running, {len(active)} active"
    if waiting_other:
        shown = ", ".join(str(v) for v in waiting_other)
        detail += f" (relays with relay_partitions {shown} are waiting: they take over only when these stop)"
    return CheckResult("relay_partitions", True, detail)


def check_schedules(settings: OutboxSettings) -> CheckResult:
    """What the relay's scheduler will run: the catalog's scheduled tasks, or only the
    built-in ones when there is no catalog file; fails on an invalid catalog file."""
    if not settings.relay_scheduler:
        return CheckResult("schedules", True, "scheduler off (SQLA_OUTBOX_RELAY_SCHEDULER)")
    from pathlib import Path

    from sqla_outbox.relay import scheduling_catalog

    try:
        catalog = scheduling_catalog(settings, warn=False)
    except errors.CatalogError as exc:
        return CheckResult("schedules", False, str(exc))
    names = sorted(t.name for t in catalog.tasks.values() if t.schedule)
    listed = ", ".join(names) or "none"
    if Path(settings.catalog_path).exists():
        return CheckResult("schedules", True, f"{settings.catalog_path}: {listed}")
    return CheckResult(
        "schedules",
        True,
        f"no catalog at {settings.catalog_path}: built-in schedules only ({listed}); "
        "application schedules need `python -m sqla_outbox catalog write`",
    )


def _check_database(settings: OutboxSettings) -> CheckResult:
    import sqlalchemy as sa

    from sqla_outbox import migrations

    url = redact_url(settings.database_url)
    try:
        engine = sa.create_engine(
            settings.sqlalchemy_url, hide_parameters=True, connect_args={"connect_timeout": 5}
        )
        with engine.connect() as conn:
            missing = migrations.missing_tables(conn)
            message = migrations.missing_tables_message(url, missing, connection=conn) if missing else ""
        engine.dispose()
    except Exception as exc:
        return CheckResult("postgresql", False, f"{url}: {type(exc).__name__}")
    if missing:
        return CheckResult("postgresql", False, message)
    return CheckResult("postgresql", True, url)


def _check_valkey(settings: OutboxSettings) -> CheckResult:
    if settings.valkey_url is None:
        return CheckResult("valkey", True, f"not configured (wake: {_wake_words(settings)})")
    if settings.wake_valkey_url is None:
        return CheckResult("valkey", True, f"not used (wake_mode {settings.wake_mode})")
    from sqla_outbox import wakeup

    try:
        wakeup.ping(settings.valkey_url, timeout_seconds=3)
    except Exception as exc:
        return CheckResult("valkey", False, f"{redact_url(settings.valkey_url)}: {type(exc).__name__}")
    return CheckResult("valkey", True, redact_url(settings.valkey_url))


def _wake_words(settings: OutboxSettings) -> str:
    channels = settings.wake_channels
    if not channels:
        return "none, the relay sweeps"
    return " and ".join(sorted("PostgreSQL LISTEN/NOTIFY" if c == "postgres" else "Valkey" for c in channels))


LISTEN_CHECKED = (
    "a fresh connection holds a LISTEN (a running relay's own session is its "
    "sqla_outbox_relay_listen_alive metric)"
)
"""What the ``listen`` line checked: a connection of its own, not the session of a relay
that runs (another process's, which only that relay can see: it probes it and exports the
result, :mod:`sqla_outbox.relay.listen`)."""


def _check_listen(settings: OutboxSettings) -> CheckResult:
    """The PostgreSQL wake: the listen URL answers and a fresh connection to it holds a
    ``LISTEN`` (:data:`LISTEN_CHECKED`)."""
    from sqla_outbox.relay import listen

    url = redact_url(settings.listen_url)
    try:
        held = listen.probe(settings, timeout_seconds=3)
    except Exception as exc:
        return CheckResult("listen", False, f"{url}: {type(exc).__name__}")
    if not held:
        return CheckResult(
            "listen",
            False,
            f"{url}: a LISTEN does not hold (a transaction-mode pooler?); the relay would only sweep: "
            "set SQLA_OUTBOX_DATABASE_DIRECT_URL to a direct connection",
        )
    return CheckResult("listen", True, f"{url}: {LISTEN_CHECKED}")


def _check_queues(settings: OutboxSettings) -> CheckResult:
    from sqla_outbox.catalog import Catalog
    from sqla_outbox.sqs.client import QueueDirectory, error_code, make_client

    try:
        queues = Catalog.queue_names_at(settings.catalog_path)  # the four, plus declared ones
    except errors.CatalogError as exc:
        return CheckResult("sqs", False, f"catalog: {exc}")
    try:
        directory = QueueDirectory(make_client(settings, max_attempts=1), settings)
        for queue in queues:
            directory.url(queue)
            directory.dlq_url(queue)
    except Exception as exc:
        return CheckResult("sqs", False, f"{error_code(exc)} (run `python -m sqla_outbox provision`)")
    return CheckResult("sqs", True, f"{len(queues)} queues and DLQs with prefix {settings.queue_prefix!r}")
