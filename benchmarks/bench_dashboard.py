"""Issue 16 — dashboard pages answer in <= 200 ms with 1,000,000 runs and 100,000 pending rows.

The database is filled as a busy week looks (``_dashboard_fill.py``: 1,000,000
``task_runs`` rows over 7 days, 60,000 of them in the last hour, 2 % failed, with their
sent outbox rows and trails; a backlog of 100,000 pending outbox rows dispatched in the
last 30 minutes; 1,000 tenants, 20 tasks), then VACUUM ANALYZEd as autovacuum would.

The dashboard runs as it does in production: ``create_app`` served by uvicorn (in a
thread of this process), read over HTTP with httpx, one request at a time. Each page is
requested ``--requests`` times; the figures are the median, p95 and max of the
response time (request sent → body read). The overview page carries the numbers (runs
by status, the backlog by queue and tenant); its charts are a fragment the page loads at
once (``/overview/charts``): ``charts, first load`` forgets the settled minutes the
dashboard caches before each request (the first view of a fresh dashboard process),
``charts refresh`` is the live refresh that follows, as is ``numbers refresh``. The DLQ page reads moto's DLQs
(``--dlq-messages`` dead letters), so it measures SQS calls as much as the dashboard.

Baseline, side by side: the same pages on the same data without the run-list indexes
of ``sqlaob_0003`` (the schema before this issue: downgraded to ``sqlaob_0002``),
``--baseline-requests`` requests each.

Judged by: the slowest page's p95 <= 200 ms (with the indexes).
"""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import _common as common
import _dashboard_fill
import httpx
import psycopg

TARGET_MS = 200.0


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextlib.contextmanager
def served(app: Any) -> Iterator[str]:
    import uvicorn

    config = uvicorn.Config(app, host="127.0.0.1", port=free_port(), log_config=None, access_log=False)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if time.monotonic() > deadline:
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{config.port}"
    finally:
        server.should_exit = True
        thread.join(15)


def scheduled_catalog() -> dict[str, Any]:
    """The fill's 20 tasks; three of them scheduled (the Schedules page reads each one's last run)."""
    tasks: dict[str, Any] = {f"task_{i:02d}": {"queue": "default"} for i in range(20)}
    tasks["task_05"] = {"queue": "maintenance", "scope": "platform", "schedule": {"cron": "17 3 * * *"}}
    tasks["task_11"] = {"queue": "default", "scope": "platform", "schedule": {"every_seconds": 300}}
    tasks["task_17"] = {"queue": "bulk", "scope": "platform", "schedule": {"every_seconds": 3600}}
    return {"version": 1, "tasks": tasks, "events": {}}


def pages(db_url: str) -> dict[str, str]:
    """Page name → path, with ids and cursors taken from the data."""
    with psycopg.connect(db_url) as conn:
        failed = conn.execute(
            "SELECT run_id FROM task_runs WHERE status = 'failed' ORDER BY created_at DESC LIMIT 1"
        ).fetchone()
        middle = conn.execute(
            "SELECT created_at, run_id FROM task_runs "
            "WHERE created_at < clock_timestamp() - interval '3 days' "
            "ORDER BY created_at DESC, run_id DESC LIMIT 1"
        ).fetchone()
        busiest = conn.execute(
            "SELECT tenant_id FROM task_runs WHERE tenant_id IS NOT NULL "
            "GROUP BY 1 ORDER BY count(*) DESC LIMIT 1"
        ).fetchone()
    assert failed and middle and busiest
    from sqla_outbox.ops.runs import RunCursor

    cursor = RunCursor(middle[0], middle[1]).encode()
    hour_ago = time.strftime("%Y-%m-%dT%H:%M", time.gmtime(time.time() - 3600))
    return {
        "overview": "/",
        "overview: numbers refresh": "/overview/live",
        "overview: charts, first load": "/overview/charts",
        "overview: charts refresh": "/overview/charts?refresh",
        "runs: newest": "/runs",
        "runs: a page 3 days back (keyset)": f"/runs?before={cursor}",
        "runs: task=task_07": "/runs?task=task_07",
        "runs: rare task (task_19)": "/runs?task=task_19",
        f"runs: busiest tenant ({busiest[0]})": f"/runs?tenant={busiest[0]}",
        "runs: tenant 999": "/runs?tenant=999",
        "runs: platform": "/runs?tenant=platform",
        "runs: status=failed": "/runs?status=failed",
        "runs: status=retrying": "/runs?status=retrying",
        "runs: task_03 + failed": "/runs?task=task_03&status=failed",
        "runs: queue=bulk, last hour": f"/runs?queue=bulk&since={hour_ago}",
        "runs: a task that never ran": "/runs?task=no_such_task",
        "run page (failed, with trail)": f"/runs/{failed[0]}",
        "schedules": "/schedules",
        "controls": "/controls",
        "DLQ (moto)": "/dlq",
    }


def measure(app: Any, paths: dict[str, str], requests: int) -> dict[str, list[float]]:
    from sqla_outbox.dashboard import queries

    times: dict[str, list[float]] = {name: [] for name in paths}
    with served(app) as base, httpx.Client(base_url=base, timeout=60) as client:
        for path in paths.values():  # connect the pool, warm the server's caches of code
            client.get(path).raise_for_status()
        for _ in range(requests):
            for name, path in paths.items():
                if name == "overview: charts, first load":
                    app.state.dashboard.activity_cache = queries.ActivityCache()
                started = time.perf_counter()
                response = client.get(path)
                elapsed = (time.perf_counter() - started) * 1000
                if response.status_code != 200:
                    raise RuntimeError(f"{path}: {response.status_code} {response.text[:300]}")
                times[name].append(elapsed)
    return times


def screenshots(app: Any, directory: Path) -> None:
    """The overview and the runs list of the filled database, in Debian's Chromium."""
    import tempfile

    from tests.e2e.browser import chromium

    directory.mkdir(parents=True, exist_ok=True)
    with served(app) as base, tempfile.TemporaryDirectory() as profile, chromium(Path(profile)) as browser:
        page = browser.new_page()
        page.goto(base + "/")
        page.wait_for_selector("#chart-throughput")
        page.screenshot(path=str(directory / "dashboard-overview-busy.png"), full_page=True)


@contextlib.contextmanager
def database(args: Any) -> Iterator[common.BenchDatabase]:
    if not args.reuse_db:
        with common.bench_database(args, "bench_dashboard") as db:
            yield db
        return
    server = common.libpq_url(args.pg_url)
    url = common._with_database(server, "bench_dashboard")
    yield common.BenchDatabase(server, "bench_dashboard", url, common.sqlalchemy_url(url))


def main() -> None:
    p = common.parser(__doc__, rounds=1)
    p.add_argument("--runs", type=int, default=1_000_000, help="task_runs rows (default 1,000,000)")
    p.add_argument("--pending", type=int, default=100_000, help="pending outbox rows (default 100,000)")
    p.add_argument("--recent", type=int, default=60_000, help="runs of the last hour (default 60,000)")
    p.add_argument("--requests", type=int, default=30, help="requests per page (default 30)")
    p.add_argument(
        "--baseline-requests", type=int, default=5, help="per page without the indexes (default 5)"
    )
    p.add_argument("--dlq-messages", type=int, default=50, help="dead letters in moto (default 50)")
    p.add_argument("--screenshots", metavar="DIR", help="also save a screenshot of the busy overview in DIR")
    p.add_argument(
        "--reuse-db",
        action="store_true",
        help="measure the database a --keep-db run left (bench_dashboard) instead of filling a new one",
    )
    p.add_argument("--no-baseline", action="store_true", help="skip the pages without sqlaob_0003's indexes")
    args = p.parse_args()
    report = common.Report(
        "bench_dashboard",
        args,
        {
            "runs": args.runs,
            "pending": args.pending,
            "recent": args.recent,
            "requests": args.requests,
            "baseline_requests": args.baseline_requests,
            "dlq_messages": args.dlq_messages,
        },
    )
    from sqla_outbox import migrations
    from sqla_outbox.dashboard import create_app

    with database(args) as db, common.moto_server() as moto:
        if args.reuse_db:
            migrations.upgrade(db.sa_url)  # a baseline run left it at sqlaob_0002
            report.note("reused the database of an earlier --keep-db run")
        else:
            fill_seconds = _dashboard_fill.fill(
                db.url, runs=args.runs, pending=args.pending, recent=args.recent
            )
            report.note(f"fill: {fill_seconds:.0f} s")
        settings = common.settings(db, None, sqs_endpoint_url=moto.endpoint)
        catalog_path = Path(settings.catalog_path)
        catalog_path.write_text(json.dumps(scheduled_catalog()))
        settings = settings.replace(catalog_path=str(catalog_path))
        client = common.sqs_client(moto.endpoint)
        urls = common.provision(client, settings)
        for i in range(args.dlq_messages):
            client.send_message(
                QueueUrl=urls["default-dlq"],
                MessageBody="{}",
                MessageAttributes={
                    "run_id": {"DataType": "String", "StringValue": str(uuid.uuid4())},
                    "task": {"DataType": "String", "StringValue": f"task_{i % 20:02d}"},
                    "reason": {"DataType": "String", "StringValue": "permanent-error"},
                },
            )
        paths = pages(db.url)

        app = create_app(settings)
        try:
            after = measure(app, paths, args.requests)
            if args.screenshots:
                screenshots(app, Path(args.screenshots))
        finally:
            app.state.dashboard.close()
        before: dict[str, list[float]] = {name: [] for name in paths}
        if not args.no_baseline:
            migrations.downgrade(db.sa_url, "sqlaob_0002")
            common.vacuum(db.url, "task_runs")
            app = create_app(settings)
            try:
                before = measure(app, paths, args.baseline_requests)
            finally:
                app.state.dashboard.close()

    rows = []
    for name in paths:
        rows.append(
            [
                name,
                round(common.median(after[name]), 1),
                round(common.percentile(after[name], 95), 1),
                round(max(after[name]), 1),
                round(common.median(before[name]), 1),
            ]
        )
    report.table(
        f"Response time, ms ({args.requests} requests per page; baseline {args.baseline_requests})",
        ["page", "p50", "p95", "max", "p50 without sqlaob_0003"],
        rows,
    )
    report.results = {"with_indexes_ms": after, "without_indexes_ms": before}
    slowest = max((common.percentile(after[n], 95), n) for n in paths if n != "DLQ (moto)")
    report.ratio(
        "slowest database page p95, ms",
        round(slowest[0], 1),
        TARGET_MS,
        higher_is_better=False,
        note=slowest[1],
    )
    report.ratio(
        "DLQ page p95, ms (moto)",
        round(common.percentile(after["DLQ (moto)"], 95), 1),
        TARGET_MS,
        higher_is_better=False,
    )
    report.emit()


if __name__ == "__main__":
    main()
