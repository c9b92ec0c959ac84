"""Chaos run: real processes, real faults, and a check that nothing was lost or done twice.

Starts its own PostgreSQL instance and Valkey (redis-server) on free ports so it can stop and
restart them without disturbing anything else, a moto SQS server behind a proxy it can cut,
two relays, three workers and an application process committing a steady stream of
transactions (``tests/chaos/app_driver.py``). While the stream runs, a controller
repeatedly ``kill -9``s and restarts relays and workers at random moments, stops and
restarts Valkey, makes the SQS endpoint unavailable for a while, and restarts PostgreSQL
once; it also denies sends to one queue for a while (an IAM or KMS denial) after pushing
that queue's pending rows past 1,100 failed attempts (a send-failure streak of days), and
purges sent outbox rows of finished runs every few seconds (``purge_sent_after_days`` 0).
Some handlers fail with error texts PostgreSQL and SQS refuse (NUL, control characters, a
lone surrogate). Then, with everything healthy, it waits for the work to settle and checks:

* every committed run reached its expected final status (``succeeded``, or ``failed`` with
  its message in the DLQ where the handler was meant to fail);
* no run of a rolled-back (or never-committed) transaction exists or executed; a
  transaction whose COMMIT was cut off has all of its runs or none;
* no run is left ``queued``, ``running`` or ``retrying``;
* handler effects (rows written through the handler session) happened exactly once per
  succeeded run and never for a failed one;
* no purge ever left an unfinished run without its outbox row, and no row was parked (an
  outage or a denial is retried, never parked).

Short version in CI: ``pytest -m chaos`` (tests/e2e/test_chaos.py). Long version:
``scripts/chaos --duration 600``.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import psycopg
import sqlalchemy as sa

from tests import support

ROOT = Path(__file__).resolve().parents[2]
PG_BIN = (
    sorted(Path("/usr/lib/postgresql").glob("*/bin"))[-1] if Path("/usr/lib/postgresql").exists() else None
)


class Unavailable(RuntimeError):
    """A prerequisite (PostgreSQL binaries, redis-server, privileges) is missing."""


# --- services we own --------------------------------------------------------------------
class PostgresInstance:
    """A throwaway PostgreSQL cluster (initdb) that the run may stop and restart."""

    def __init__(self) -> None:
        if PG_BIN is None or not (PG_BIN / "initdb").exists():
            raise Unavailable(
                "PostgreSQL server binaries (initdb, pg_ctl) not found under /usr/lib/postgresql"
            )
        self.port = support.free_port()
        self.dir = Path(tempfile.mkdtemp(prefix="chaos-pg-"))
        self.data = self.dir / "data"
        self._as_postgres = os.geteuid() == 0
        if self._as_postgres:
            shutil.chown(self.dir, "postgres", "postgres")
        self._run("initdb", "-D", str(self.data), "-A", "trust", "-U", "postgres", "--no-sync", "-E", "UTF8")
        with open(self.data / "postgresql.conf", "a") as conf:
            conf.write(
                f"port = {self.port}\nlisten_addresses = '127.0.0.1'\n"
                f"unix_socket_directories = '{self.dir}'\n"
                "fsync = off\nmax_connections = 200\nclient_connection_check_interval = 250ms\n"
            )
        self.start()

    @property
    def url(self) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/postgres"

    def _run(self, tool: str, *args: str) -> None:
        assert PG_BIN is not None
        command = [str(PG_BIN / tool), *args]
        if self._as_postgres:
            command = ["runuser", "-u", "postgres", "--", *command]
        result = subprocess.run(command, capture_output=True, text=True, timeout=120)
        if result.returncode != 0:
            raise Unavailable(f"{tool} failed: {result.stderr[-500:]}")

    def start(self) -> None:
        self._run("pg_ctl", "-D", str(self.data), "-l", str(self.dir / "log"), "-w", "start")

    def stop(self, mode: str = "immediate") -> None:
        self._run("pg_ctl", "-D", str(self.data), "-m", mode, "-w", "stop")

    def destroy(self) -> None:
        try:
            self.stop("immediate")
        except Unavailable:
            pass
        shutil.rmtree(self.dir, ignore_errors=True)


class ValkeyInstance:
    """A redis-server on a free port that the run may stop and start."""

    def __init__(self) -> None:
        self.binary = shutil.which("valkey-server") or shutil.which("redis-server")
        if self.binary is None:
            raise Unavailable("valkey-server / redis-server not found")
        self.port = support.free_port()
        self.process: subprocess.Popen[bytes] | None = None
        self.start()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        self.process = subprocess.Popen(
            [
                self.binary,
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        import redis

        client = redis.Redis.from_url(self.url)
        support.wait_for(lambda: _ping(client), timeout=10)
        client.close()

    def stop(self) -> None:
        if self.process is not None:
            self.process.kill()
            self.process.wait(10)
            self.process = None


def _ping(client: Any) -> bool:
    try:
        return bool(client.ping())
    except Exception:
        return False


# --- the run -------------------------------------------------------------------------------
@dataclasses.dataclass
class ChaosReport:
    duration_seconds: float
    transactions: dict[str, int]
    runs_committed: int
    runs_by_status: dict[str, int]
    faults: dict[str, int]
    duplicates_delivered: int
    duplicate_executions_prevented: int
    lost: list[str]
    wrong_status: list[str]
    phantom_runs: list[str]
    stuck: list[str]
    effect_errors: list[str]
    dlq_missing: list[str]
    uncertain_split: list[str]
    purge_violations: list[str] = dataclasses.field(default_factory=list)
    parked: list[str] = dataclasses.field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not (
            self.purge_violations
            or self.parked
            or self.lost
            or self.wrong_status
            or self.phantom_runs
            or self.stuck
            or self.effect_errors
            or self.dlq_missing
            or self.uncertain_split
        )


def run(
    duration: float,
    *,
    rate: float = 15.0,
    seed: int = 11,
    visibility: int = 4,
    verbose: bool = True,
    relays: int = 2,
    relay_partitions: int = 1,
) -> ChaosReport:
    """Run the chaos scenario for ``duration`` seconds of faults; return the report.

    ``relays`` relay processes run (``relay_partitions`` > 1: all of them active, sharing
    the outbox's partitions, which move whenever one is killed or restarted)."""
    rng = random.Random(seed)
    say = print if verbose else (lambda *a, **k: None)
    pg = PostgresInstance()
    valkey = ValkeyInstance()
    moto = support.MotoServer.start()
    host, port = moto.endpoint.removeprefix("http://").split(":")
    proxy = support.TcpProxy(host, int(port))
    work = Path(tempfile.mkdtemp(prefix="chaos-"))
    processes: dict[str, support.ServiceProcess] = {}
    retired: list[support.ServiceProcess] = []
    driver: subprocess.Popen[bytes] | None = None
    faults: collections.Counter[str] = collections.Counter()
    started = time.monotonic()
    try:
        database_url = _prepare_database(pg.url)
        catalog_path = work / "tasks.json"
        _write_catalog(catalog_path)
        tag = f"chaos{seed}-"
        env_settings = _Settings(database_url, valkey.url, f"chaos:{seed}:wake", tag, str(catalog_path))
        _provision(moto.endpoint, env_settings, visibility)

        def spawn(name: str) -> None:
            extra = {
                "SQLA_OUTBOX_WORKER_BACKOFF_BASE_SECONDS": "0.3",
                "SQLA_OUTBOX_WORKER_BACKOFF_MAX_SECONDS": "2",
                "SQLA_OUTBOX_RELAY_BACKOFF_BASE_SECONDS": "0.2",
                "SQLA_OUTBOX_RELAY_BACKOFF_MAX_SECONDS": "2",
                "SQLA_OUTBOX_WORKER_WAIT_SECONDS": "1",
                "SQLA_OUTBOX_WORKER_CONCURRENCY": "6",
                "SQLA_OUTBOX_WORKER_STOP_BUDGET_SECONDS": "3",
                "SQLA_OUTBOX_RELAY_PARTITIONS": str(relay_partitions),
            }
            if name.startswith("relay"):
                processes[name] = support.start_relay(env_settings, proxy.endpoint, name=name, **extra)
            else:
                processes[name] = support.start_worker(
                    env_settings, proxy.endpoint, name=name, imports="tests.chaos.tasks", **extra
                )

        relay_names = [f"relay-{chr(ord('a') + n)}" for n in range(relays)]
        for name in (*relay_names, "worker-1", "worker-2", "worker-3"):
            spawn(name)
        driver_env = support.service_env(env_settings, proxy.endpoint)
        driver = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "tests.chaos.app_driver",
                "--out",
                str(work / "outcomes.jsonl"),
                "--rate",
                str(rate),
                "--seed",
                str(seed),
            ],
            env=driver_env,
            cwd=ROOT,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        say(f"chaos: {duration:.0f} s of faults at {rate:g} transactions/s")
        # faults follow a clock of their own (the pauses they sleep), so the seed decides how
        # many there are, however slowly the machine kills and restarts processes
        clock = {"elapsed": 0.0}

        def pause(seconds: float) -> None:
            time.sleep(seconds)
            clock["elapsed"] += seconds

        pg_restart_at = duration * rng.uniform(0.3, 0.6)
        pg_restarted = False
        aside = random.Random(seed + 1)  # the new faults keep the main sequence of the seed as it was
        streak_at = duration * aside.uniform(0.1, 0.25)
        streak: threading.Thread | None = None
        purger = _Purger(database_url, faults)
        purger.start()
        while clock["elapsed"] < duration:
            pause(rng.uniform(0.5, 2.0))
            if streak is None and clock["elapsed"] >= streak_at:  # runs beside the other faults
                say("  fault: sends to the bulk queue denied, after a streak of 1,100 failed attempts")
                streak = threading.Thread(
                    target=_send_failure_streak,
                    args=(moto.endpoint, database_url, tag),
                    kwargs={"seconds": aside.uniform(5.0, 8.0)},
                    daemon=True,
                )
                streak.start()
                faults["send_streaks"] += 1
            if not pg_restarted and clock["elapsed"] >= pg_restart_at:
                say("  fault: PostgreSQL restart")
                pg.stop("immediate")
                pause(rng.uniform(1.0, 3.0))
                pg.start()
                faults["postgres_restarts"] += 1
                pg_restarted = True
                continue
            kinds = ["kill_relay", "kill_worker", "kill_worker", "valkey", "sqs", "none"]
            if relay_partitions > 1:  # partitions move at every relay kill and restart: kill more
                kinds += ["kill_relay", "kill_relay"]
            fault = rng.choice(kinds)
            if fault == "kill_relay":
                name = rng.choice(relay_names)
                processes[name].kill()
                retired.append(processes[name])
                pause(rng.uniform(0, 1.5))
                spawn(name)
                faults["relay_kills"] += 1
            elif fault == "kill_worker":
                name = rng.choice(["worker-1", "worker-2", "worker-3"])
                processes[name].kill()
                retired.append(processes[name])
                pause(rng.uniform(0, 1.5))
                spawn(name)
                faults["worker_kills"] += 1
            elif fault == "valkey":
                valkey.stop()
                pause(rng.uniform(1.0, 4.0))
                valkey.start()
                faults["valkey_outages"] += 1
            elif fault == "sqs":
                proxy.disable()
                pause(rng.uniform(1.0, 4.0))
                proxy.enable()
                faults["sqs_outages"] += 1
        if not pg_restarted:
            pg.stop("immediate")
            pg.start()
            faults["postgres_restarts"] += 1
        driver.send_signal(signal.SIGTERM)
        driver.wait(60)
        purger.stop()
        if streak is not None:
            streak.join(30)
        say("chaos: faults over; waiting for the work to settle")
        records = [json.loads(line) for line in (work / "outcomes.jsonl").read_text().splitlines()]
        engine = sa.create_engine(support_sqlalchemy(database_url), pool_pre_ping=True)
        _settle(engine, patience=90.0, cap=max(300.0, 3 * duration), say=say)
        for process in processes.values():
            process.terminate(60)
        report = _verify(
            engine,
            records,
            moto.endpoint,
            env_settings,
            faults,
            list(processes.values()) + retired,
            time.monotonic() - started,
        )
        report.purge_violations = purger.violations
        engine.dispose()
        return report
    finally:
        if driver is not None and driver.poll() is None:
            driver.kill()
        for process in list(processes.values()) + retired:
            process.kill()
        proxy.close()
        moto.stop()
        valkey.stop()
        pg.destroy()
        shutil.rmtree(work, ignore_errors=True)


def support_sqlalchemy(url: str) -> str:
    return url.replace("postgresql://", "postgresql+psycopg://")


def _send_failure_streak(endpoint: str, database_url: str, tag: str, *, seconds: float) -> None:
    """Deny SendMessageBatch on the bulk queue (as an IAM or KMS denial does) for ``seconds``,
    after pushing its pending rows' ``attempts`` past 1,100: days of failures at the default
    backoff cap, whose backoff arithmetic once overflowed."""
    support.deny_calls(endpoint, f"{tag}bulk")
    try:
        with psycopg.connect(database_url.replace("+psycopg", ""), autocommit=True) as conn:
            for table in ("outbox_messages", "platform_outbox_messages"):
                conn.execute(
                    f"UPDATE {table} SET attempts = attempts + 1100 WHERE queue = 'bulk' AND sent_at IS NULL"
                )
    except psycopg.Error:
        pass  # PostgreSQL may be restarting: the denial alone still makes a streak
    time.sleep(seconds)
    support.deny_calls(endpoint, f"{tag}bulk", clear=True)


_ORPHANS = sa.text(
    """
SELECT run_id::text FROM task_runs AS r
WHERE status IN ('queued', 'running', 'retrying')
  AND NOT EXISTS (SELECT 1 FROM outbox_messages AS o WHERE o.run_id = r.run_id)
  AND NOT EXISTS (SELECT 1 FROM platform_outbox_messages AS p WHERE p.run_id = r.run_id)
"""
)


class _Purger:
    """Purges sent rows of finished runs every few seconds while the faults run, and checks
    after each purge that every unfinished run still has its outbox row."""

    def __init__(self, database_url: str, faults: collections.Counter[str]) -> None:
        from sqla_outbox.config import OutboxSettings

        self.settings = OutboxSettings(database_url=database_url, valkey_url=None, purge_sent_after_days=0.0)
        self.faults = faults
        self.violations: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="chaos-purger", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(30)

    def _run(self) -> None:
        from sqla_outbox import maintenance

        engine = sa.create_engine(self.settings.sqlalchemy_url, pool_pre_ping=True)
        try:
            while not self._stop.wait(3.0):
                try:
                    maintenance.purge(engine, self.settings)
                    with engine.connect() as conn:
                        orphans = conn.execute(_ORPHANS).scalars()
                        self.violations += [
                            f"run {run_id} unfinished without its outbox row" for run_id in orphans
                        ]
                    self.faults["purges"] += 1
                except sa.exc.DBAPIError:
                    continue  # PostgreSQL restarting
        finally:
            engine.dispose()


@dataclasses.dataclass
class _Settings:
    """The few settings ``tests.support.service_env`` reads."""

    database_url: str
    valkey_url: str
    wake_key: str
    queue_prefix: str
    catalog_path: str
    relay_sweep_interval_seconds: float = 1.0
    wake_mode: str = "auto"


def _prepare_database(server_url: str) -> str:
    name = "chaos"
    support.create_database(server_url, name)
    url = support.database_url(server_url, name)
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("CREATE TABLE tenants (id bigint PRIMARY KEY)")
        conn.execute("INSERT INTO tenants SELECT generate_series(1, 5)")
        conn.execute(
            "CREATE TABLE effects (id bigserial PRIMARY KEY, run_id uuid NOT NULL, task text NOT NULL, "
            "attempt int, worker text, note text, at timestamptz DEFAULT clock_timestamp())"
        )
    from sqla_outbox import migrations

    migrations.upgrade(support_sqlalchemy(url))
    return support_sqlalchemy(url)


def _write_catalog(path: Path) -> None:
    import tests.chaos.tasks  # noqa: F401 - registers the handlers
    from sqla_outbox.worker.registry import registry

    path.write_text(registry.catalog().to_json())


def _provision(endpoint: str, settings: _Settings, visibility: int) -> None:
    from sqla_outbox.config import OutboxSettings
    from sqla_outbox.sqs.provision import provision

    client = support.sqs_client(endpoint)
    reports = provision(client, OutboxSettings(queue_prefix=settings.queue_prefix, sqs_endpoint_url=endpoint))
    for report in reports:
        if not report.dead_letter:
            support.set_visibility(client, report.url, visibility)


def _settle(engine: sa.Engine, *, patience: float, cap: float, say: Any) -> None:
    """Wait until no run is open and no outbox row is pending, as long as work keeps finishing.

    Gives up after ``patience`` seconds without progress or ``cap`` seconds in all.
    """
    started = last_progress = time.monotonic()
    best: int | None = None
    while time.monotonic() - started < cap and time.monotonic() - last_progress < patience:
        with engine.connect() as conn:
            open_runs = conn.execute(
                sa.text(
                    "SELECT count(*) FROM task_runs WHERE status IN ('queued', 'running', 'retrying') "
                    "OR (status = 'failed' AND dead_lettered_at IS NULL)"
                )
            ).scalar_one()
            pending = conn.execute(
                sa.text(
                    "SELECT (SELECT count(*) FROM outbox_messages WHERE sent_at IS NULL) "
                    "+ (SELECT count(*) FROM platform_outbox_messages WHERE sent_at IS NULL)"
                )
            ).scalar_one()
        remaining = int(open_runs) + int(pending)
        if remaining == 0:
            return
        if best is None or remaining < best:
            best, last_progress = remaining, time.monotonic()
            say(f"  settling: {open_runs} runs open, {pending} rows pending")
        time.sleep(1)


def _verify(
    engine: sa.Engine,
    records: list[dict[str, Any]],
    endpoint: str,
    settings: _Settings,
    faults: collections.Counter[str],
    processes: list[support.ServiceProcess],
    elapsed: float,
) -> ChaosReport:
    with engine.connect() as conn:
        runs = {
            str(r.run_id): r
            for r in conn.execute(sa.text("SELECT run_id, status, dead_lettered_at FROM task_runs"))
        }
        parked = [
            f"{run_id}: {error}"
            for run_id, error in conn.execute(
                sa.text(
                    "SELECT run_id::text, last_error FROM outbox_messages WHERE parked_at IS NOT NULL "
                    "UNION ALL SELECT run_id::text, last_error FROM platform_outbox_messages "
                    "WHERE parked_at IS NOT NULL"
                )
            )
        ]
        effect_counts = dict(
            conn.execute(sa.text("SELECT run_id::text, count(*) FROM effects GROUP BY run_id")).all()
        )
    dlq_run_ids = _dlq_run_ids(endpoint, settings)
    outcome_counts = collections.Counter(r["outcome"] for r in records)
    lost, wrong, phantom, effect_errors, dlq_missing, split = [], [], [], [], [], []
    committed_runs = 0
    expected: dict[str, str] = {}
    for record in records:
        ids = list(record["expect"])
        if record["outcome"] == "committed":
            expected.update(record["expect"])
        elif record["outcome"] in ("rolled_back", "not_committed"):
            phantom += [f"tx {record['tx']}: run {rid} exists" for rid in ids if rid in runs]
            phantom += [f"tx {record['tx']}: run {rid} executed" for rid in ids if rid in effect_counts]
        elif record["outcome"] == "uncertain":
            present = [rid for rid in ids if rid in runs]
            if present and len(present) != len(ids):
                split.append(f"tx {record['tx']}: {len(present)} of {len(ids)} runs exist")
            if present:
                expected.update(record["expect"])
    for run_id, want in expected.items():
        committed_runs += 1
        run = runs.get(run_id)
        if run is None:
            lost.append(run_id)
            continue
        if run.status != want:
            wrong.append(f"{run_id}: {run.status}, expected {want}")
        effects_seen = effect_counts.get(run_id, 0)
        if (want == "succeeded" and effects_seen != 1) or (want == "failed" and effects_seen != 0):
            effect_errors.append(f"{run_id}: {effects_seen} effects, status {run.status}")
        if want == "failed" and run_id not in dlq_run_ids:
            dlq_missing.append(run_id)
    stuck = [rid for rid, r in runs.items() if r.status in ("queued", "running", "retrying")]
    by_status = collections.Counter(r.status for r in runs.values())
    duplicates = sum(
        len(p.actions(action))
        for p in processes
        for action in ("worker.duplicate", "worker.leased_elsewhere")
    )
    prevented = duplicates + sum(len(p.actions("worker.lease_lost")) for p in processes)
    return ChaosReport(
        duration_seconds=round(elapsed, 1),
        transactions=dict(outcome_counts),
        runs_committed=committed_runs,
        runs_by_status=dict(by_status),
        faults=dict(faults),
        duplicates_delivered=duplicates,
        duplicate_executions_prevented=prevented,
        lost=lost,
        wrong_status=wrong,
        phantom_runs=phantom,
        stuck=stuck,
        effect_errors=effect_errors,
        dlq_missing=dlq_missing,
        uncertain_split=split,
        parked=parked,
    )


def _dlq_run_ids(endpoint: str, settings: _Settings) -> set[str]:
    client = support.sqs_client(endpoint)
    found: set[str] = set()
    for queue in ("critical", "default", "bulk", "maintenance"):
        url = client.get_queue_url(QueueName=f"{settings.queue_prefix}{queue}-dlq")["QueueUrl"]
        for message in support.receive_all(client, url):
            attribute = message.get("MessageAttributes", {}).get("run_id", {})
            if attribute.get("StringValue"):
                found.add(attribute["StringValue"])
    return found


def print_report(report: ChaosReport) -> None:
    print("\nchaos report")
    print(f"  duration:          {report.duration_seconds} s")
    print(f"  transactions:      {report.transactions}")
    print(f"  committed runs:    {report.runs_committed}   by status: {report.runs_by_status}")
    print(f"  faults injected:   {report.faults}")
    print(f"  duplicates delivered (copies of a finished or in-flight run): {report.duplicates_delivered}")
    print(f"  duplicate executions prevented: {report.duplicate_executions_prevented}")
    for name in (
        "lost",
        "wrong_status",
        "phantom_runs",
        "stuck",
        "effect_errors",
        "dlq_missing",
        "uncertain_split",
        "purge_violations",
        "parked",
    ):
        values = getattr(report, name)
        print(f"  {name + ':':<18} {len(values)}" + (f"  e.g. {values[:3]}" if values else ""))
    print("  RESULT:", "OK" if report.ok else "FAILED")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--duration", type=float, default=300, help="seconds of faults")
    parser.add_argument("--rate", type=float, default=15, help="application transactions per second")
    parser.add_argument("--seed", type=int, default=11)
    parser.add_argument("--json", dest="json_path", help="also write the report here")
    parser.add_argument("--relays", type=int, default=2, help="relay processes (default 2)")
    parser.add_argument(
        "--relay-partitions",
        type=int,
        default=1,
        help="relay_partitions (default 1: one active relay; > 1: every relay active on a share)",
    )
    args = parser.parse_args()
    report = run(
        args.duration,
        rate=args.rate,
        seed=args.seed,
        relays=args.relays,
        relay_partitions=args.relay_partitions,
    )
    print_report(report)
    if args.json_path:
        Path(args.json_path).write_text(json.dumps({**dataclasses.asdict(report), "ok": report.ok}, indent=2))
    sys.exit(0 if report.ok else 1)


if __name__ == "__main__":
    main()
