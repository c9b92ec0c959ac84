"""Helpers shared by the benchmark scripts: databases, moto, statistics, reports.

The moto server helpers (``MotoServer``, ``free_port``, ``reset_moto``) are the test
suite's (``tests/support.py``), so benchmarks and tests run the same patched moto. Every
script:

* creates its own database on the PostgreSQL server (``--pg-url``, default
  ``postgresql://postgres@127.0.0.1:5432/postgres``; env ``BENCH_PG_URL``), with a
  ``tenants`` table, an application table ``bench_orders`` and the sqla_outbox migrations
  at head, and drops it at the end (``--keep-db`` keeps it);
* runs the sides of each comparison alternately, several rounds (:func:`alternate`), and
  reports medians over the rounds and the ratio it is judged by (:class:`Report`);
* prints a table and, with ``--json PATH``, writes the same figures as JSON.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime as dt
import importlib.metadata
import json
import math
import os
import platform
import signal
import statistics
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import psycopg
import sqlalchemy as sa
from psycopg import sql

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    # last, not first: for `tests.support`; a library snapshot on PYTHONPATH (run_all.sh's
    # BENCH_SNAPSHOT, ab.py's baseline) must win over the checkout's sqla_outbox
    sys.path.append(str(ROOT))

from tests.support import MotoServer, reset_moto  # noqa: E402

DEFAULT_PG_URL = os.environ.get("BENCH_PG_URL", "postgresql://postgres@127.0.0.1:5432/postgres")
DEFAULT_REDIS_URL = os.environ.get("BENCH_REDIS_URL", "redis://127.0.0.1:6379/0")

AWS_ENV = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_SESSION_TOKEN": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
    "AWS_REGION": "us-east-1",
}
for _key, _value in AWS_ENV.items():  # boto3's chain reads these (moto accepts anything)
    os.environ.setdefault(_key, _value)

TASK = "bench_noop"
TENANT_TASK = "bench_tenant"
CATALOG: dict[str, Any] = {
    "version": 1,
    "tasks": {
        TASK: {"queue": "default"},
        TENANT_TASK: {"queue": "default", "scope": "tenant"},
    },
    "events": {},
}
PAYLOAD: dict[str, Any] = {"order_id": 123456, "user_id": 42, "note": "benchmark payload"}
TENANTS = 20


# --- command line ---------------------------------------------------------------------------
def positive_int(text: str) -> int:
    """argparse type: a whole number of at least 1 (rounds, transactions, batch sizes)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be 1 or more, got {value}")
    return value


def parser(doc: str | None, *, rounds: int) -> argparse.ArgumentParser:
    """An argument parser with the options every script takes.

    Also turns SIGTERM into ``SystemExit`` so ``finally`` blocks stop the moto server and
    the relay/worker subprocesses and drop the database.
    """
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    first = (doc or "").strip().splitlines()[0] if doc else None
    p = argparse.ArgumentParser(
        description=first,
        epilog="See the module docstring (and benchmarks/README.md) for what is measured and how.",
    )
    p.add_argument(
        "--rounds", type=positive_int, default=rounds, help=f"alternating rounds (default {rounds})"
    )
    p.add_argument("--json", metavar="PATH", help="also write the figures as JSON to PATH")
    p.add_argument("--pg-url", default=DEFAULT_PG_URL, help="PostgreSQL server (libpq URL, any database)")
    p.add_argument("--redis-url", default=DEFAULT_REDIS_URL, help="Valkey/Redis for the wake signal")
    p.add_argument("--keep-db", action="store_true", help="keep the benchmark database afterwards")
    return p


# --- databases ------------------------------------------------------------------------------
def _with_database(server_url: str, name: str) -> str:
    parts = urlsplit(server_url)
    return urlunsplit((parts.scheme, parts.netloc, "/" + name, parts.query, parts.fragment))


def libpq_url(url: str) -> str:
    """``postgresql://`` form of a SQLAlchemy or libpq URL (for psycopg / asyncpg)."""
    return url.replace("postgresql+psycopg://", "postgresql://")


def sqlalchemy_url(url: str) -> str:
    return "postgresql+psycopg://" + libpq_url(url).removeprefix("postgresql://")


@dataclasses.dataclass
class BenchDatabase:
    """A database created for one script run.

    Attributes:
        name: Database name. url: libpq URL. sa_url: SQLAlchemy (psycopg 3) URL.
    """

    server_url: str
    name: str
    url: str
    sa_url: str

    def drop(self) -> None:
        with psycopg.connect(self.server_url, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(self.name)))


def create_database(server_url: str, name: str, *, migrate: bool = True) -> BenchDatabase:
    """(Re)create ``name``: tenants 1..20, the ``bench_orders`` app table, our migrations.

    ``bench_orders`` is what "one application ORM row" writes: a bigint identity key,
    a tenant, a text and a numeric column and a timestamp default.
    """
    server_url = libpq_url(server_url)
    with psycopg.connect(server_url, autocommit=True) as conn:
        conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    url = _with_database(server_url, name)
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("CREATE TABLE tenants (id bigint PRIMARY KEY, name text)")
        conn.execute(f"INSERT INTO tenants SELECT g, 'tenant ' || g FROM generate_series(1, {TENANTS}) g")
        conn.execute(
            "CREATE TABLE bench_orders (id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY, "
            "tenant_id bigint NOT NULL, customer text NOT NULL, amount numeric(12, 2) NOT NULL, "
            "created_at timestamptz NOT NULL DEFAULT clock_timestamp())"
        )
    if migrate:
        from sqla_outbox import migrations

        migrations.upgrade(sqlalchemy_url(url))
    return BenchDatabase(server_url, name, url, sqlalchemy_url(url))


@contextlib.contextmanager
def bench_database(args: argparse.Namespace, name: str) -> Iterator[BenchDatabase]:
    # the pid keeps two runs on one server (other sessions' benchmarks) from dropping each
    # other's database
    db = create_database(args.pg_url, f"{name}_{os.getpid()}")
    try:
        yield db
    finally:
        if not args.keep_db:
            db.drop()


def vacuum(url: str, *tables: str) -> None:
    """VACUUM ANALYZE (autocommit), so every round starts from the same table state."""
    with psycopg.connect(libpq_url(url), autocommit=True) as conn:
        for table in tables:
            conn.execute(f"VACUUM ANALYZE {table}")


def truncate_outbox(url: str) -> None:
    with psycopg.connect(libpq_url(url), autocommit=True) as conn:
        conn.execute(
            "TRUNCATE outbox_messages, platform_outbox_messages, task_runs, task_run_trail RESTART IDENTITY"
        )


def write_catalog(directory: Path) -> Path:
    path = directory / "tasks.json"
    path.write_text(json.dumps(CATALOG))
    return path


def catalog() -> Any:
    from sqla_outbox.catalog import Catalog

    return Catalog.from_dict(CATALOG)


def settings(db: BenchDatabase, redis_url: str | None, **overrides: Any) -> Any:
    """OutboxSettings isolated to this run (own wake key and queue prefix)."""
    from sqla_outbox.config import OutboxSettings

    tag = uuid.uuid4().hex[:8]
    catalog_path = Path(os.environ.get("TMPDIR", "/tmp")) / f"sqla_outbox_bench_{tag}.json"
    catalog_path.write_text(json.dumps(CATALOG))
    values: dict[str, Any] = {
        "database_url": db.sa_url,
        "valkey_url": redis_url,
        "wake_key": f"bench:{tag}:wake",
        "queue_prefix": f"bench{tag}-",
        "catalog_path": str(catalog_path),
    }
    values.update(overrides)
    return OutboxSettings(**values)


def envelope_document(task: str = TASK, tenant_id: int | None = None) -> dict[str, Any]:
    """A real envelope document, as ``Dispatch`` builds it, for bulk-filled rows."""
    from sqla_outbox.dispatch import Dispatch

    run = Dispatch(task, PAYLOAD, tenant_id=tenant_id).prepare(catalog(), max_message_bytes=262_144)[0]
    return run.envelope


def fill_backlog(
    url: str,
    rows: int,
    *,
    tenant: bool = True,
    chunk: int = 50_000,
    only_tenant: int | None = None,
    tenants: int = TENANTS,
) -> None:
    """Insert ``rows`` due outbox rows plus their ``task_runs`` rows with set-based SQL.

    The envelope is a real ``Dispatch`` envelope with its ``run_id`` replaced per row; the
    rows are what ``Dispatch`` would write, just written faster. Tenant rows spread over
    tenants 1..``tenants`` (added to the ``tenants`` table when missing), or all belong to
    ``only_tenant``; each chunk is one transaction.
    """
    task = TENANT_TASK if tenant else TASK
    template = envelope_document(task, 1 if tenant else None)
    table = "outbox_messages" if tenant else "platform_outbox_messages"
    tenant_col = "tenant_id, " if tenant else ""
    tenant_expr = f"1 + mod(g, {int(tenants)})" if only_tenant is None else str(int(only_tenant))
    tenant_val = f"{tenant_expr}, " if tenant else ""
    with psycopg.connect(libpq_url(url), autocommit=True) as conn:
        if tenants > TENANTS:
            conn.execute(
                "INSERT INTO tenants SELECT g, 'tenant ' || g FROM generate_series(1, %(n)s) g "
                "ON CONFLICT DO NOTHING",
                {"n": tenants},
            )
        done = 0
        while done < rows:
            n = min(chunk, rows - done)
            conn.execute(
                f"""
WITH ids AS (SELECT g, gen_random_uuid() AS run_id FROM generate_series(1, %(n)s) g),
runs AS (
    INSERT INTO task_runs (run_id, task, queue, tenant_id, available_at)
    SELECT run_id, %(task)s, 'default', {tenant_expr if tenant else "NULL"},
           clock_timestamp() - interval '1 second'
    FROM ids
)
INSERT INTO {table} ({tenant_col}run_id, queue, envelope, available_at)
SELECT {tenant_val}run_id, 'default',
       jsonb_set(jsonb_set(%(env)s::jsonb, '{{run_id}}', to_jsonb(run_id::text)),
                 '{{tenant_id}}', {f"to_jsonb({tenant_expr})" if tenant else "'null'::jsonb"}),
       clock_timestamp() - interval '1 second' + g * interval '1 microsecond'
FROM ids ORDER BY g
""",
                {"n": n, "task": task, "env": json.dumps(template)},
            )
            done += n
    vacuum(url, table, "task_runs")


def count(url: str, query: str) -> int:
    with psycopg.connect(libpq_url(url), autocommit=True) as conn:
        row = conn.execute(query).fetchone()
        return int(row[0]) if row else 0


# --- senders ---------------------------------------------------------------------------------
class AcceptAllSender:
    """A relay ``Sender`` that accepts every row at once (benchmark-only).

    Args:
        target: When ``sent`` reaches it, :attr:`done` is set (the drain is over).
        encode: Also build the SQS entries (body, attributes, size) like ``SqsSender``
            does, so the CPU cost of message building is counted.

    Attributes:
        calls: ``(perf_counter at entry, time.time() at entry, rows)`` per call, when
            ``record`` is true.
    """

    def __init__(self, *, target: int | None = None, encode: bool = False, record: bool = False) -> None:
        self.target = target
        self.encode = encode
        self.record = record
        self.sent = 0
        self.done = threading.Event()
        self.calls: list[tuple[float, float, list[Any]]] = []
        self.on_call: Callable[[float, list[Any]], None] | None = None

    def send(self, rows: Sequence[Any]) -> Any:
        t = time.perf_counter()
        wall = time.time()
        from sqla_outbox.relay.send import SendResult, build_entry

        if self.encode:
            for row in rows:
                build_entry(row)
        if self.record:
            self.calls.append((t, wall, list(rows)))
        if self.on_call is not None:
            self.on_call(t, list(rows))
        self.sent += len(rows)
        if self.target is not None and self.sent >= self.target:
            self.done.set()
        return SendResult(sent=list(rows))

    def close(self) -> None:
        pass


class CountingSender:
    """Wraps a real sender; sets :attr:`done` once ``target`` rows were accepted."""

    def __init__(self, inner: Any, target: int) -> None:
        self.inner = inner
        self.target = target
        self.sent = 0
        self.done = threading.Event()

    def send(self, rows: Sequence[Any]) -> Any:
        result = self.inner.send(rows)
        self.sent += len(result.sent)
        if self.sent >= self.target:
            self.done.set()
        return result

    def close(self) -> None:
        self.inner.close()


class DeleteCounter:
    """Wraps a boto3 SQS client; counts the messages SQS confirms deleted.

    The worker's acknowledgement path is library-internal (one DeleteMessage per run,
    or DeleteMessageBatch); counting at the client works for both. :attr:`done` is set
    when ``target`` deletions were confirmed. Every other attribute is the client's.
    """

    def __init__(self, client: Any, target: int) -> None:
        self._client = client
        self.target = target
        self.deleted = 0
        self.done = threading.Event()
        self._lock = threading.Lock()

    def _count(self, n: int) -> None:
        with self._lock:
            self.deleted += n
            if self.deleted >= self.target:
                self.done.set()

    def delete_message(self, **kwargs: Any) -> Any:
        response = self._client.delete_message(**kwargs)
        self._count(1)
        return response

    def delete_message_batch(self, **kwargs: Any) -> Any:
        response = self._client.delete_message_batch(**kwargs)
        self._count(len(response.get("Successful", [])))
        return response

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)


# --- moto (SQS) -------------------------------------------------------------------------------
@contextlib.contextmanager
def moto_server() -> Iterator[MotoServer]:
    server = MotoServer.start()
    try:
        yield server
    finally:
        server.stop()


def sqs_client(endpoint: str, *, pool: int = 20) -> Any:
    import boto3
    import botocore.config

    return boto3.client(
        "sqs",
        endpoint_url=endpoint,
        region_name="us-east-1",
        aws_access_key_id="testing",
        aws_secret_access_key="testing",
        config=botocore.config.Config(max_pool_connections=pool, retries={"mode": "standard"}),
    )


def provision(client: Any, settings_: Any) -> dict[str, str]:
    """Create the run's queues and DLQs; return logical name → URL."""
    from sqla_outbox.sqs.provision import provision as provision_queues

    reports = provision_queues(client, settings_)
    return {r.queue + ("-dlq" if r.dead_letter else ""): r.url for r in reports}


def queue_depth(client: Any, url: str) -> int:
    attrs = client.get_queue_attributes(
        QueueUrl=url,
        AttributeNames=["ApproximateNumberOfMessages", "ApproximateNumberOfMessagesNotVisible"],
    )["Attributes"]
    return int(attrs["ApproximateNumberOfMessages"]) + int(attrs["ApproximateNumberOfMessagesNotVisible"])


def fresh_queues(endpoint: str, client: Any, settings_: Any) -> dict[str, str]:
    """Empty every queue: reset moto and provision the run's queues again.

    moto enforces SQS's "one PurgeQueue per queue every 60 seconds", so a reset is the
    way to empty queues between rounds. Queue URLs stay the same (same names).
    """
    reset_moto(endpoint)
    urls = provision(client, settings_)
    if queue_depth(client, urls["default"]):
        raise RuntimeError("queue not empty after moto reset")
    return urls


# --- statistics ----------------------------------------------------------------------------------
def percentile(values: Sequence[float], p: float) -> float:
    """Linear-interpolated percentile (``p`` in 0..100)."""
    if not values:
        return math.nan
    ordered = sorted(values)
    k = (len(ordered) - 1) * p / 100
    lo, hi = math.floor(k), math.ceil(k)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


def summary_ms(seconds: Sequence[float]) -> dict[str, float]:
    """p50/p90/p99/max/mean in milliseconds of latencies given in seconds."""
    ms = [s * 1000 for s in seconds]
    return {
        "n": len(ms),
        "p50_ms": round(percentile(ms, 50), 3),
        "p90_ms": round(percentile(ms, 90), 3),
        "p99_ms": round(percentile(ms, 99), 3),
        "max_ms": round(max(ms), 3) if ms else math.nan,
        "mean_ms": round(statistics.fmean(ms), 3) if ms else math.nan,
    }


def median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else math.nan


def paired_ratio(results: dict[str, list[float]], a: str, b: str) -> float:
    """Median over rounds of ``a / b`` computed within each round.

    The two sides of a round ran back to back, so a load burst from other work on the
    machine tends to hit both; the per-round ratio cancels most of it, and the median
    drops the rounds where it did not.
    """
    return median([x / y for x, y in zip(results[a], results[b], strict=True)])


def alternate(rounds: int, sides: dict[str, Callable[[], Any]], *, log: bool = True) -> dict[str, list[Any]]:
    """Run every side once per round, rotating the order each round; collect results.

    Rotating means no side always runs first (cold) or last (after the others warmed
    caches or left dead tuples).
    """
    names = list(sides)
    out: dict[str, list[Any]] = {name: [] for name in names}
    for r in range(rounds):
        order = names[r % len(names) :] + names[: r % len(names)]
        for name in order:
            value = sides[name]()
            out[name].append(value)
            if log:
                shown = f"{value:,.1f}" if isinstance(value, (int, float)) else str(value)[:100]
                print(f"  round {r + 1}/{rounds} {name}: {shown}", flush=True)
    return out


# --- machine and versions -----------------------------------------------------------------------
def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def library_source() -> dict[str, Any]:
    """Which sqla_outbox is measured: its path, the checkout's HEAD and a hash of its source.

    The hash covers every ``.py`` file of the imported package, so two runs with the same
    hash measured the same library code (the working tree may differ from HEAD).
    """
    import hashlib

    import sqla_outbox

    package = Path(sqla_outbox.__file__).resolve().parent
    digest = hashlib.sha256()
    for path in sorted(package.rglob("*.py")):
        digest.update(str(path.relative_to(package)).encode())
        digest.update(path.read_bytes())
    head = None
    with contextlib.suppress(Exception):
        head = subprocess.run(
            ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            timeout=5,
        ).stdout.strip()
    return {"path": str(package), "git_head": head, "source_sha256": digest.hexdigest()[:16]}


def machine_info(pg_url: str = DEFAULT_PG_URL, redis_url: str | None = DEFAULT_REDIS_URL) -> dict[str, Any]:
    info: dict[str, Any] = {
        "nproc": os.cpu_count(),
        "loadavg_at_start": [round(x, 2) for x in os.getloadavg()],
        "python": platform.python_version(),
        "platform": platform.platform(),
        "packages": {
            name: _version(name)
            for name in (
                "sqla-outbox",
                "sqlalchemy",
                "psycopg",
                "redis",
                "boto3",
                "moto",
                "procrastinate",
                "pgqueuer",
                "asyncpg",
                "psutil",
            )
        },
    }
    info["library"] = library_source()
    with contextlib.suppress(Exception), psycopg.connect(libpq_url(pg_url), connect_timeout=5) as conn:
        info["postgresql"] = conn.execute("SHOW server_version").fetchone()[0]  # type: ignore[index]
        info["synchronous_commit"] = conn.execute("SHOW synchronous_commit").fetchone()[0]  # type: ignore[index]
    if redis_url:
        with contextlib.suppress(Exception):
            import redis

            client = redis.Redis.from_url(redis_url, socket_timeout=3)
            info["redis"] = client.info("server").get("redis_version")
            client.close()
    return info


# --- report --------------------------------------------------------------------------------------
@dataclasses.dataclass
class Ratio:
    name: str
    value: float
    target: float | None
    higher_is_better: bool = True
    note: str = ""

    @property
    def met(self) -> bool | None:
        if self.target is None or math.isnan(self.value):
            return None
        return self.value >= self.target if self.higher_is_better else self.value <= self.target


class Report:
    """Collects one script's figures; prints them and writes JSON."""

    def __init__(self, benchmark: str, args: argparse.Namespace, params: dict[str, Any]) -> None:
        self.benchmark = benchmark
        self.args = args
        self.params = params
        self.started_at = dt.datetime.now(dt.UTC)
        self.machine = machine_info(args.pg_url, getattr(args, "redis_url", None))
        self.tables: list[tuple[str, list[str], list[list[Any]]]] = []
        self.ratios: list[Ratio] = []
        self.results: dict[str, Any] = {}
        self.notes: list[str] = []

    def table(self, title: str, header: list[str], rows: list[list[Any]]) -> None:
        self.tables.append((title, header, rows))

    def ratio(
        self, name: str, value: float, target: float | None, *, higher_is_better: bool = True, note: str = ""
    ) -> None:
        self.ratios.append(Ratio(name, value, target, higher_is_better, note))

    def note(self, text: str) -> None:
        self.notes.append(text)

    def emit(self) -> None:
        print()
        print(f"== {self.benchmark} ==  params: {json.dumps(self.params)}")
        print(f"   machine: nproc={self.machine['nproc']} load={self.machine['loadavg_at_start']}")
        for title, header, rows in self.tables:
            print()
            print(title)
            print(render_table(header, rows))
        if self.ratios:
            print()
            print("Judged by (a throughput ratio is the median over rounds of the per-round ratio):")
            rows = []
            for r in self.ratios:
                cmp = ">=" if r.higher_is_better else "<="
                target = "-" if r.target is None else f"{cmp} {r.target:g}"
                met = {True: "met", False: "MISSED", None: "-"}[r.met]
                rows.append([r.name, float(r.value), target, met, r.note])
            print(render_table(["figure", "value", "target", "", "note"], rows))
        for text in self.notes:
            print(f"note: {text}")
        if self.args.json:
            document = {
                "benchmark": self.benchmark,
                "started_at": self.started_at.isoformat(timespec="seconds"),
                "command": " ".join([Path(sys.executable).name, *sys.argv]),
                "params": self.params,
                "machine": self.machine,
                "results": self.results,
                "tables": [{"title": t, "header": h, "rows": r} for t, h, r in self.tables],
                "ratios": [dataclasses.asdict(r) | {"met": r.met} for r in self.ratios],
                "notes": self.notes,
            }
            path = Path(self.args.json)
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(document, indent=2, default=str) + "\n")
            print(f"wrote {path}")


def _cell(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        if math.isnan(value):
            return "-"
        return f"{value:,.3f}" if abs(value) < 10 else f"{value:,.1f}"
    if isinstance(value, int):
        return f"{value:,}"
    return str(value)


def render_table(header: list[str], rows: list[list[Any]]) -> str:
    """A Markdown table (readable in a terminal, pasteable into docs/benchmarks.md)."""
    cells = [[_cell(v) for v in row] for row in rows]
    numeric = [
        all(row[i] is None or isinstance(row[i], (int, float)) for row in rows) for i in range(len(header))
    ]
    widths = [max(len(h), *(len(r[i]) for r in cells)) if cells else len(h) for i, h in enumerate(header)]
    lines = ["| " + " | ".join(h.ljust(w) for h, w in zip(header, widths, strict=True)) + " |"]
    lines.append(
        "|"
        + "|".join("-" * (w + 1) + (":" if n else "-") for w, n in zip(widths, numeric, strict=True))
        + "|"
    )
    for row in cells:
        lines.append(
            "| "
            + " | ".join(
                c.rjust(w) if n else c.ljust(w) for c, w, n in zip(row, widths, numeric, strict=True)
            )
            + " |"
        )
    return "\n".join(lines)


def one_connection_engine(url: str, **kwargs: Any) -> sa.Engine:
    """An engine that uses exactly one connection (pool of one, no overflow)."""
    return sa.create_engine(sqlalchemy_url(url), pool_size=1, max_overflow=0, **kwargs)
