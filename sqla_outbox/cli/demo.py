"""``python -m sqla_outbox demo``: the whole pipeline, end to end, on this machine.

What it does, using embedded defaults wherever nothing is configured:

1. **PostgreSQL**: creates a fresh database (``--database-name``, default
   ``sqla_outbox_demo``) on the server of ``DATABASE_URL`` (default
   ``postgresql://postgres@127.0.0.1:5432/postgres``). When nothing answers there, starts
   an embedded PostgreSQL in a temporary folder (the ``embedded`` extra,
   :mod:`sqla_outbox.postgres_server`), removed at the end unless ``--keep``; without
   that extra, a container through testcontainers when Docker is available.
2. **SQS**: the endpoint in ``SQLA_OUTBOX_SQS_ENDPOINT_URL``; when none is set, an
   in-process moto server on a free loopback port.
3. **The wake**: Valkey at ``REDIS_URL``/``VALKEY_URL`` when it answers; otherwise the
   PostgreSQL wake (``NOTIFY`` in the dispatching transaction, a relay that ``LISTEN``s).
   The header names the one in use and the summary shows the latency that results.
4. Migrates with the example shop's own Alembic environment (its tables plus ours),
   provisions the queues, starts ``python -m sqla_outbox.relay`` and ``python -m
   sqla_outbox.worker --imports examples.shop.tasks`` as real subprocesses.
5. Places orders (one transaction each; one more is rolled back on purpose) and shows
   progress while the runs drain.
6. Prints a summary: runs by status, commit → handler-finished latency p50/p99, delayed
   runs' lateness, and what landed in the DLQs and why. Exit code 1 if any committed
   run is missing, stuck, or ended in a status other than the one the shop's inputs
   call for. Ctrl-C stops everything cleanly (exit 130).

The shop lives in ``examples/shop`` of a source checkout; run the demo from there.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import signal
import statistics
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import click

from sqla_outbox.cli.options import EXIT_CHECK_FAILED, EXIT_CONFIG, EXIT_OK
from sqla_outbox.cli.terminal import console as make_console
from sqla_outbox.cli.terminal import echo, print_json, styled
from sqla_outbox.cli.terminal import grid as make_grid
from sqla_outbox.cli.terminal import progress as make_progress
from sqla_outbox.cli.terminal import table as make_table
from sqla_outbox.config import OutboxSettings, redact_url, with_database

REPO_ROOT = Path(__file__).resolve().parent.parent.parent
SHOP = REPO_ROOT / "examples" / "shop"
EXPECTED_RUNS_PER_ORDER = 4  # send_receipt, notify_warehouse, award_loyalty, ask_for_review
DELAYED_TASK = "ask_for_review"  # the shop's delayed run (examples/shop/app.py, review_delay)


@dataclasses.dataclass
class Order:
    tenant_id: int
    product_id: int
    quantity: int
    email: str


def workload(orders: int) -> list[Order]:
    """Deterministic orders: every 5th has quantity 3 (warehouse fails once, then
    succeeds); every 7th uses an address at invalid.example (loyalty fails permanently)."""
    out = []
    for n in range(orders):
        tenant = 1 + n % 3
        out.append(
            Order(
                tenant_id=tenant,
                product_id=tenant * 100 + 1 + n % 3,
                quantity=3 if n % 5 == 4 else 1 + n % 2,
                email=f"customer{n}@invalid.example" if n % 7 == 6 else f"customer{n}@example.com",
            )
        )
    return out


def expected_status(task: str, payload: dict[str, Any]) -> str:
    """What the shop's handlers do with these inputs."""
    if task == "award_loyalty" and str(payload.get("email", "")).endswith("@invalid.example"):
        return "failed"
    return "succeeded"


@click.command("demo")
@click.option("--orders", default=30, show_default=True, type=click.IntRange(min=1), help="Orders to place.")
@click.option(
    "--database-name",
    default="sqla_outbox_demo",
    show_default=True,
    help="Database the demo creates on the DATABASE_URL server and drops at the end; "
    "an existing database is refused unless an earlier demo created it.",
)
@click.option(
    "--review-delay",
    default=3.0,
    show_default=True,
    type=click.FloatRange(min=0, max=3600),
    help="Delay of the ask_for_review runs [s].",
)
@click.option(
    "--timeout",
    default=120.0,
    show_default=True,
    type=click.FloatRange(min=1),
    help="Give up waiting for the runs after this long [s].",
)
@click.option(
    "--keep",
    is_flag=True,
    help="Keep the demo database afterwards (and the embedded PostgreSQL's folder, when one was started).",
)
@click.option("--json", "as_json", is_flag=True, help="Print the summary as JSON.")
def demo_command(
    orders: int, database_name: str, review_delay: float, timeout: float, keep: bool, as_json: bool
) -> None:
    """Run the example shop through relay and worker processes and summarise what happened."""
    global REPO_ROOT, SHOP
    if not (SHOP / "tasks.py").exists() and (Path.cwd() / "examples" / "shop" / "tasks.py").exists():
        REPO_ROOT, SHOP = Path.cwd(), Path.cwd() / "examples" / "shop"  # a checkout, installed non-editable
    if not (SHOP / "tasks.py").exists():
        echo(
            "error: the demo needs the example shop (examples/shop) of a source checkout: run it "
            "from the checkout's root (./scripts/demo), or install the checkout with `pip install -e .`",
            err=True,
        )
        sys.exit(EXIT_CONFIG)
    if str(REPO_ROOT) not in sys.path:
        sys.path.insert(0, str(REPO_ROOT))
    console = _console(as_json)
    try:
        with _services(database_name, console, keep) as env:
            summary = _run(env, orders=orders, review_delay=review_delay, timeout=timeout, console=console)
    except KeyboardInterrupt:
        console.print("interrupted: relay and worker stopped")
        sys.exit(130)
    if as_json:
        print_json(summary)
    else:
        _print_summary(summary, console)
    sys.exit(EXIT_OK if summary["ok"] else EXIT_CHECK_FAILED)


# --- services ----------------------------------------------------------------------------
@contextlib.contextmanager
def _services(database_name: str, console: Any, keep: bool) -> Iterator[dict[str, str]]:
    with contextlib.ExitStack() as stack:
        server_url, origin = _postgres(stack, console, keep)
        database_url = _fresh_database(server_url, database_name)
        if not keep:
            stack.callback(_drop_database, server_url, database_name)
        _header(
            console,
            "PostgreSQL",
            _shown_url(database_url),
            *origin,
            "a fresh database, kept afterwards (--keep)"
            if keep
            else "a fresh database, dropped at the end (--keep keeps it)",
        )
        endpoint = _sqs(stack, console)
        valkey = _valkey(console)
        _header(
            console,
            "Wake",
            "Valkey (LPUSH after commit, BLPOP in the relay)"
            if valkey
            else "PostgreSQL (NOTIFY in the dispatching transaction, LISTEN in the relay)",
        )
        env = {k: v for k, v in os.environ.items() if not k.startswith("SQLA_OUTBOX_")}
        env.setdefault("AWS_ACCESS_KEY_ID", "demo")
        env.setdefault("AWS_SECRET_ACCESS_KEY", "demo")
        env.setdefault("AWS_REGION", "us-east-1")
        env.update(
            {
                "SQLA_OUTBOX_DATABASE_URL": database_url,
                "SHOP_DATABASE_URL": database_url,
                "SQLA_OUTBOX_VALKEY_URL": valkey or "none",
                "SQLA_OUTBOX_WAKE_MODE": "valkey" if valkey else "postgres",
                "SQLA_OUTBOX_SQS_ENDPOINT_URL": endpoint,
                "SQLA_OUTBOX_QUEUE_PREFIX": f"demo-{uuid.uuid4().hex[:6]}-",
                "SQLA_OUTBOX_CATALOG_PATH": str(SHOP / "tasks.json"),
                "SQLA_OUTBOX_WAKE_KEY": f"sqla_outbox:demo:{uuid.uuid4().hex[:6]}:wake",
                "SQLA_OUTBOX_WORKER_WAIT_SECONDS": "2",
                "SQLA_OUTBOX_WORKER_BACKOFF_BASE_SECONDS": "1",
                "SQLA_OUTBOX_WORKER_BACKOFF_MAX_SECONDS": "4",
                "SQLA_OUTBOX_WORKER_CONCURRENCY": "8",
                "SQLA_OUTBOX_WORKER_STOP_BUDGET_SECONDS": "5",
                # the shop's workload only: no maintenance.purge slot at start
                "SQLA_OUTBOX_RELAY_SCHEDULER": "false",
                "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")])),
            }
        )
        yield env


def _postgres(stack: contextlib.ExitStack, console: Any, keep: bool) -> tuple[str, list[str]]:
    """The server URL to create the demo's database on, and header notes on where it is.

    The configured server when it answers; otherwise an embedded PostgreSQL (removed at
    the end unless ``keep``), otherwise a testcontainers container when Docker is there.
    """
    import psycopg

    from sqla_outbox import postgres_server

    url = os.environ.get("SQLA_OUTBOX_DATABASE_URL") or os.environ.get("DATABASE_URL")
    url = (url or "postgresql://postgres@127.0.0.1:5432/postgres").replace(
        "postgresql+psycopg://", "postgresql://"
    )
    try:
        psycopg.connect(url, connect_timeout=5).close()
        return url, []
    except psycopg.OperationalError as exc:
        reason = str(exc).strip().splitlines()[0]
    nothing = f"nothing answered at {redact_url(url)}"
    if postgres_server.is_installed():
        server = stack.enter_context(postgres_server.embedded_postgres(keep=keep, prefix="sqla_outbox-demo-"))
        kept = (
            f"its folder {server.folder} is kept, the server stopped (--keep)"
            if keep
            else "removed at the end (--keep keeps it)"
        )
        return server.url(), [
            f"an embedded PostgreSQL {server.version} in {server.pgdata}",
            f"started because {nothing}; {kept}",
        ]
    try:
        from testcontainers.postgres import PostgresContainer
    except ImportError:
        raise click.ClickException(
            f"PostgreSQL is not reachable at {redact_url(url)} ({reason}); set DATABASE_URL, or "
            f"install '{postgres_server.EXTRA}' for an embedded one"
        ) from None
    console.print(f"PostgreSQL not reachable at {redact_url(url)}; starting one with testcontainers")
    container = stack.enter_context(PostgresContainer("postgres:15", driver=None))
    return str(container.get_connection_url()), [f"a container (testcontainers), since {nothing}"]


def _shown_url(url: str) -> str:
    """``url`` for the header: password masked; a Unix-socket URL without its query (the
    socket's folder is named in the notes)."""
    from urllib.parse import urlsplit, urlunsplit

    parts = urlsplit(url)
    if "host=/" in parts.query:
        parts = parts._replace(query="")
    return redact_url(urlunsplit(parts))


DEMO_DATABASE_COMMENT = "created by python -m sqla_outbox demo"
"""The comment the demo puts on the databases it creates; it only ever drops or re-creates a
database that carries it, so ``--database-name`` can never destroy someone else's database."""


class DemoDatabaseTaken(click.ClickException):
    """``--database-name`` names a database the demo did not create (exit status 2)."""

    exit_code = EXIT_CONFIG


def _fresh_database(server_url: str, name: str) -> str:
    """Create database ``name`` on ``server_url`` for this run and return its URL.

    A database of that name left by an earlier demo (``--keep``; recognised by
    :data:`DEMO_DATABASE_COMMENT`) is dropped and created again; any other database of that
    name is left alone.

    Raises:
        DemoDatabaseTaken: the database exists and the demo did not create it.
    """
    import psycopg
    from psycopg import sql

    with psycopg.connect(server_url, autocommit=True) as conn:
        row = conn.execute(
            "SELECT shobj_description(oid, 'pg_database') FROM pg_database WHERE datname = %s", (name,)
        ).fetchone()
        if row is not None:
            if row[0] != DEMO_DATABASE_COMMENT:
                raise DemoDatabaseTaken(
                    f"database {name!r} already exists and the demo did not create it; the demo "
                    "drops its database at the end, so it only uses a new name (or one an earlier "
                    "demo created): pass another --database-name"
                )
            conn.execute(sql.SQL("DROP DATABASE {} WITH (FORCE)").format(sql.Identifier(name)))
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
        conn.execute(
            sql.SQL("COMMENT ON DATABASE {} IS {}").format(
                sql.Identifier(name), sql.Literal(DEMO_DATABASE_COMMENT)
            )
        )
    return with_database(server_url, name)


def _drop_database(server_url: str, name: str) -> None:
    import psycopg
    from psycopg import sql

    with contextlib.suppress(psycopg.Error), psycopg.connect(server_url, autocommit=True) as conn:
        conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))


def _sqs(stack: contextlib.ExitStack, console: Any) -> str:
    configured = os.environ.get("SQLA_OUTBOX_SQS_ENDPOINT_URL") or os.environ.get("AWS_ENDPOINT_URL_SQS")
    if configured:
        _header(console, "SQS", redact_url(configured))
        return configured
    try:
        from moto.server import ThreadedMotoServer

        from sqla_outbox.moto_server import patch_moto
    except ImportError:
        raise click.ClickException(
            "no SQS endpoint configured and moto is not installed (pip install 'moto[server]')"
        ) from None
    import logging

    port = _free_port()

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # no access log on the console
    patch_moto()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    stack.callback(server.stop)
    endpoint = f"http://127.0.0.1:{port}"
    _header(
        console, "SQS", f"in-process moto server at {endpoint}", "SQLA_OUTBOX_SQS_ENDPOINT_URL is not set"
    )
    return endpoint


def _valkey(console: Any) -> str | None:
    from sqla_outbox import wakeup

    url = OutboxSettings.from_env().valkey_url
    if url is None:
        _header(console, "Valkey", "not configured")
        return None
    try:
        wakeup.ping(url, timeout_seconds=2)
    except Exception:
        _header(console, "Valkey", f"not reachable at {redact_url(url)}")
        return None
    _header(console, "Valkey", redact_url(url))
    return url


def _header(console: Any, label: str, value: str, *notes: str) -> None:
    """One service line of the demo's header: ``label`` in a fixed column, ``value`` beside
    it, each note on a line of its own below the value, so a narrow terminal wraps inside
    the value column instead of splitting a phrase across the left margin."""
    lines = make_grid(padding=(0, 1))
    lines.add_column(no_wrap=True, min_width=11)
    lines.add_column(overflow="fold")
    lines.add_row(f"{label}:", value)
    for note in notes:
        lines.add_row("", note)
    console.print(lines)


# --- the run -----------------------------------------------------------------------------
def _run(
    env: dict[str, str], *, orders: int, review_delay: float, timeout: float, console: Any
) -> dict[str, Any]:
    import datetime as dt

    import sqlalchemy as sa
    from sqlalchemy.orm import sessionmaker

    import sqla_outbox
    from examples.shop.app import place_order
    from sqla_outbox.catalog import Catalog
    from sqla_outbox.sqs.client import make_client
    from sqla_outbox.sqs.provision import provision

    python = sys.executable
    _check_call(
        [python, "-m", "alembic", "-c", str(SHOP / "alembic.ini"), "upgrade", "heads"], env, "migrate"
    )
    settings = OutboxSettings.from_env(env)
    with _environ(env):
        provision(make_client(settings), settings)
    console.print("migrated the shop database and provisioned the queues")

    processes: list[subprocess.Popen[bytes]] = []
    engine = sa.create_engine(settings.sqlalchemy_url, hide_parameters=True)
    relay_port, worker_port = _free_port(), _free_port()
    try:
        for args, port in (
            ([python, "-m", "sqla_outbox.relay", "--log-format", "json"], relay_port),
            (
                [
                    python,
                    "-m",
                    "sqla_outbox.worker",
                    "--log-format",
                    "json",
                    "--imports",
                    "examples.shop.tasks",
                ],
                worker_port,
            ),
        ):
            processes.append(
                subprocess.Popen(
                    args,
                    env={**env, "SQLA_OUTBOX_HEALTH_PORT": str(port)},
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                )
            )
        _wait_ready(relay_port, worker_port, processes)
        console.print(
            f"relay (pid {processes[0].pid}) is the active relay; worker (pid {processes[1].pid}) is ready"
        )

        maker = sessionmaker(engine)
        sqla_outbox.install(maker, settings, catalog=Catalog.load(SHOP / "tasks.json"))
        committed_at: dict[str, float] = {}
        with contextlib.suppress(RuntimeError), maker() as session, session.begin():
            place_order(session, tenant_id=1, product_id=101, quantity=1, email="rolled-back@example.com")
            raise RuntimeError("payment declined: this order and its runs are rolled back")
        for order in workload(orders):
            with maker() as session, session.begin():
                placed = place_order(
                    session,
                    tenant_id=order.tenant_id,
                    product_id=order.product_id,
                    quantity=order.quantity,
                    email=order.email,
                    review_delay=dt.timedelta(seconds=review_delay),
                )
                order_id = placed.id
            committed_at[str(order_id)] = time.time()
        expected_total = _count(engine) if orders else 0
        console.print(f"placed {orders} orders: {expected_total} runs committed (1 order rolled back)")
        finished = _wait(engine, expected_total, timeout, console)
        summary = _summarise(engine, settings, env, committed_at, orders, finished)
    finally:
        for process in processes:
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        for process in processes:
            try:
                process.wait(30)
            except subprocess.TimeoutExpired:
                process.kill()
        engine.dispose()
    return summary


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _wait_ready(relay_port: int, worker_port: int, processes: list[subprocess.Popen[bytes]]) -> None:
    """Until the relay holds the advisory lock and the worker answers /readyz."""
    import urllib.error
    import urllib.request

    def get(port: int, path: str) -> str:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=2) as response:
                return str(response.read().decode())
        except (urllib.error.URLError, OSError):
            return ""

    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if any(p.poll() is not None for p in processes):
            raise click.ClickException(
                "the relay or the worker exited at start (run them by hand to see why)"
            )
        if "sqla_outbox_relay_leader 1.0" in get(relay_port, "/metrics") and get(worker_port, "/readyz"):
            return
        time.sleep(0.1)
    raise click.ClickException("the relay and worker did not become ready within 60 s")


def _check_call(args: list[str], env: dict[str, str], what: str) -> None:
    result = subprocess.run(args, env=env, capture_output=True, text=True, cwd=REPO_ROOT)
    if result.returncode != 0:
        raise click.ClickException(f"{what} failed:\n{result.stderr[-2000:]}")


@contextlib.contextmanager
def _environ(env: dict[str, str]) -> Iterator[None]:
    saved = dict(os.environ)
    os.environ.update(env)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def _count(engine: Any, where: str = "") -> int:
    import sqlalchemy as sa

    with engine.connect() as conn:
        return int(conn.execute(sa.text(f"SELECT count(*) FROM task_runs {where}")).scalar_one())


def _wait(engine: Any, total: int, timeout: float, console: Any) -> bool:
    deadline = time.monotonic() + timeout
    with make_progress("runs finished", console) as progress:
        bar = progress.add_task("runs", total=total)
        while time.monotonic() < deadline:
            done = _count(
                engine,
                "WHERE status IN ('succeeded', 'failed') AND (status <> 'failed' "
                "OR dead_lettered_at IS NOT NULL)",
            )
            progress.update(bar, completed=done)
            if done >= total:
                return True
            time.sleep(0.25)
    return False


def _summarise(
    engine: Any,
    settings: OutboxSettings,
    env: dict[str, str],
    committed_at: dict[str, float],
    orders: int,
    finished: bool,
) -> dict[str, Any]:
    import sqlalchemy as sa

    with engine.connect() as conn:
        rows = conn.execute(
            sa.text(
                "SELECT r.run_id, r.task, r.status, r.attempts, r.last_error_type, r.last_error, "
                "EXTRACT(EPOCH FROM r.finished_at)::float8 AS finished, "
                "EXTRACT(EPOCH FROM r.finished_at - r.available_at)::float8 AS after_due, "
                "COALESCE(o.envelope, p.envelope) AS envelope "
                "FROM task_runs r LEFT JOIN outbox_messages o USING (run_id) "
                "LEFT JOIN platform_outbox_messages p USING (run_id)"
            )
        ).all()
        effects = int(conn.execute(sa.text("SELECT count(*) FROM shop_effects")).scalar_one())
    by_status: dict[str, int] = {}
    latencies, lateness, unexpected = [], [], []
    for row in rows:
        by_status[row.status] = by_status.get(row.status, 0) + 1
        payload = json.loads(row.envelope["payload"]) if row.envelope else {}
        want = expected_status(row.task, payload)
        if row.status != want:
            unexpected.append(
                {"run_id": str(row.run_id), "task": row.task, "status": row.status, "expected": want}
            )
        order_id = str(payload.get("order_id"))
        if row.status == "succeeded" and row.finished is not None:
            # the shop's one delayed task, by name: a run of another task can be deferred
            # (a rate limit, a busy machine) and its available_at then moves as well
            if row.task == DELAYED_TASK:
                lateness.append(row.after_due)
            elif order_id in committed_at and row.attempts == 1:
                latencies.append(max(0.0, row.finished - committed_at[order_id]))
    dlq = _dlq_contents(settings, env)
    expected_runs = orders * EXPECTED_RUNS_PER_ORDER + 3  # + the migration's welcome_tenant runs
    return {
        "ok": finished and not unexpected and len(rows) == expected_runs,
        "orders": orders,
        "runs_expected": expected_runs,
        "runs_found": len(rows),
        "runs_by_status": dict(sorted(by_status.items())),
        "unexpected": unexpected,
        "handler_effects": effects,
        "wake": settings.wake_mode,
        "latency_ms": _percentiles(latencies),
        "delayed_lateness_ms": _percentiles(lateness),
        "dlq": dlq,
        "rolled_back_runs": 0,
    }


def _percentiles(values: list[float]) -> dict[str, float | int | None]:
    if not values:
        return {"count": 0, "p50": None, "p99": None}
    ordered = sorted(v * 1000 for v in values)
    p99 = ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))]
    return {"count": len(ordered), "p50": round(statistics.median(ordered), 1), "p99": round(p99, 1)}


def _dlq_contents(settings: OutboxSettings, env: dict[str, str]) -> list[dict[str, str]]:
    from sqla_outbox.sqs.client import QueueDirectory, make_client
    from sqla_outbox.types import QUEUE_NAMES

    with _environ(env):
        client = make_client(settings)
    directory = QueueDirectory(client, settings)
    found = []
    for queue in QUEUE_NAMES:
        url = directory.dlq_url(queue)
        while True:
            messages = client.receive_message(
                QueueUrl=url,
                MaxNumberOfMessages=10,
                VisibilityTimeout=60,
                WaitTimeSeconds=0,
                MessageAttributeNames=["All"],
            ).get("Messages", [])
            if not messages:
                break
            for message in messages:
                attrs = {k: v.get("StringValue", "") for k, v in message.get("MessageAttributes", {}).items()}
                found.append(
                    {
                        "queue": queue,
                        "task": attrs.get("task", ""),
                        "run_id": attrs.get("run_id", ""),
                        "reason": attrs.get("reason", ""),
                        "error": attrs.get("error_message", "")[:120],
                    }
                )
    return found


# --- output ------------------------------------------------------------------------------
def _console(quiet: bool) -> Any:
    return make_console(stderr=True, quiet=quiet)


def _print_summary(summary: dict[str, Any], progress: Any) -> None:
    """The human summary on stdout; every value is printed literally (no rich markup)."""
    out = make_console()
    by_status = make_table("runs by status", ("status", "runs"))
    by_status.columns[1].justify = "right"
    for status, count in summary["runs_by_status"].items():
        by_status.add_row(status, str(count))
    out.print(by_status)
    lat, late = summary["latency_ms"], summary["delayed_lateness_ms"]
    wake = "Valkey" if summary["wake"] == "valkey" else "PostgreSQL LISTEN/NOTIFY"
    out.print(
        f"commit → handler finished: p50 {lat['p50']} ms, p99 {lat['p99']} ms ({lat['count']} runs, "
        f"{wake} wake; the orders arrive in one burst, so this includes waiting behind it)"
    )
    out.print(f"delayed runs finished after their due time: p50 {late['p50']} ms, p99 {late['p99']} ms")
    out.print(f"handler effects recorded: {summary['handler_effects']}; rolled-back order: no runs")
    dlq = make_table("dead-letter queues", ("queue", "task", "run_id", "reason", "error"))
    for item in summary["dlq"]:
        dlq.add_row(item["queue"], item["task"], item["run_id"][:8], item["reason"], item["error"])
    out.print(dlq)
    if summary["ok"]:
        out.print(
            styled("OK", "green"),
            f": all {summary['runs_found']} committed runs reached their expected status",
            sep="",
        )
    else:
        out.print(
            styled("FAILED", "red"),
            f": {summary['runs_found']}/{summary['runs_expected']} runs found, "
            f"{len(summary['unexpected'])} with an unexpected status",
            sep="",
        )
        for item in summary["unexpected"][:20]:
            out.print(f"  {item}")
