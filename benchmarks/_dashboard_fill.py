"""Fill a benchmark database the way a busy deployment looks after a week (bench_dashboard.py).

Set-based SQL, so 1,000,000 runs take about a minute:

* 1,000 tenants; 20 tasks with a skewed mix (``task_00`` most frequent), each on a queue;
  10 % of the runs are platform runs (no tenant), the tenants skewed towards low ids;
* ``finished`` runs (``runs - pending``) spread over the last 7 days (the default purge
  age), ``recent`` of them in the last hour: 97.7 % succeeded, 2 % failed, the rest
  running or retrying; each with its sent outbox row and a trail (running, then its final
  status; failed runs have a retrying row with an error first);
* ``pending`` queued runs dispatched in the last 30 minutes whose outbox rows are not sent
  yet (a backlog), 90 % of them tenant rows;
* then VACUUM ANALYZE, as autovacuum would have done.
"""

from __future__ import annotations

import time

import psycopg

TASKS = 20
TENANTS = 1000


def _task(alias: str) -> str:
    return f"'task_' || lpad(floor(power({alias}.r1, 2) * {TASKS})::int::text, 2, '0')"


def _queue(task_sql: str) -> str:
    return (
        f"(ARRAY['default', 'critical', 'bulk', 'default', 'maintenance'])"
        f"[1 + mod(abs(hashtext({task_sql})), 5)]"
    )


def fill(url: str, *, runs: int = 1_000_000, pending: int = 100_000, recent: int = 60_000) -> float:
    """Fill the database at ``url`` (migrated, with ``tenants`` 1..20); return the seconds taken."""
    started = time.perf_counter()
    finished = runs - pending
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(
            f"INSERT INTO tenants SELECT g, 'tenant ' || g FROM generate_series(1, {TENANTS}) g "
            "ON CONFLICT (id) DO NOTHING"
        )
        # the finished part: created over 7 days, `recent` of them in the last hour
        conn.execute(
            f"""
CREATE UNLOGGED TABLE fill_runs AS
SELECT g, gen_random_uuid() AS run_id, t.task, {_queue("t.task")} AS queue,
       CASE WHEN x.r2 < 0.1 THEN NULL ELSE 1 + floor(power(x.r3, 3) * {TENANTS})::bigint END AS tenant_id,
       CASE WHEN g <= {recent}
            THEN clock_timestamp() - x.r4 * interval '1 hour'
            ELSE clock_timestamp() - interval '1 hour' - x.r4 * interval '6 days 23 hours' END AS created_at,
       CASE WHEN x.r5 < 0.977 THEN 'succeeded' WHEN x.r5 < 0.997 THEN 'failed'
            WHEN x.r5 < 0.999 THEN 'running' ELSE 'retrying' END AS status,
       0.02 + power(x.r6, 4) * 30 AS latency
FROM generate_series(1, {finished}) g
CROSS JOIN LATERAL (SELECT random() AS r1, random() AS r2, random() AS r3, random() AS r4,
                           random() AS r5, random() AS r6, g AS dep) x
CROSS JOIN LATERAL (SELECT {_task("x")} AS task) t
"""
        )
        conn.execute(
            """
INSERT INTO task_runs (run_id, task, queue, tenant_id, status, attempts, available_at, created_at,
                       updated_at, started_at, finished_at, lease_owner, lease_expires_at,
                       last_error_type, last_error, dead_lettered_at)
SELECT run_id, task, queue, tenant_id, status,
       CASE WHEN status = 'failed' THEN 5 ELSE 1 END,
       created_at, created_at,
       created_at + latency * interval '1 second',
       created_at + interval '10 milliseconds',
       CASE WHEN status IN ('succeeded', 'failed') THEN created_at + latency * interval '1 second' END,
       CASE WHEN status IN ('running', 'retrying') THEN 'worker-a:1' END,
       CASE WHEN status IN ('running', 'retrying') THEN created_at + interval '2 minutes' END,
       CASE WHEN status IN ('failed', 'retrying') THEN 'ConnectionError' END,
       CASE WHEN status IN ('failed', 'retrying') THEN 'upstream refused the connection' END,
       CASE WHEN status = 'failed' THEN created_at + latency * interval '1 second' END
FROM fill_runs ORDER BY created_at
"""
        )
        for table, where in (("outbox_messages", "IS NOT NULL"), ("platform_outbox_messages", "IS NULL")):
            tenant_col = "tenant_id, " if where == "IS NOT NULL" else ""
            conn.execute(
                f"""
INSERT INTO {table} ({tenant_col}run_id, queue, envelope, available_at, sent_at, created_at)
SELECT {tenant_col}run_id, queue,
       jsonb_build_object('v', 1, 'run_id', run_id::text, 'task', task, 'queue', queue,
                          'tenant_id', tenant_id, 'event', NULL, 'idempotency_key', NULL,
                          'payload', '{{"order_id": 7}}'),
       created_at, created_at + interval '3 milliseconds', created_at
FROM fill_runs WHERE tenant_id {where} ORDER BY created_at
"""
            )
        conn.execute(
            """
INSERT INTO task_run_trail (run_id, at, status, attempt, receive_count, worker_id, error_type,
                            error_message, detail)
SELECT run_id, at, status, attempt, attempt, 'worker-a:1', error_type, error_message, detail
FROM (
    SELECT run_id, created_at + interval '10 milliseconds' AS at, 'running' AS status, 1 AS attempt,
           NULL AS error_type, NULL AS error_message, NULL::jsonb AS detail, 1 AS k
    FROM fill_runs
    UNION ALL
    SELECT run_id, created_at + latency * interval '0.5 second', 'retrying', 1, 'ConnectionError',
           'upstream refused the connection', '{"backoff_seconds": 5}'::jsonb, 2
    FROM fill_runs WHERE status IN ('failed', 'retrying')
    UNION ALL
    SELECT run_id, created_at + latency * interval '1 second', status, 1,
           CASE WHEN status = 'failed' THEN 'ConnectionError' END,
           CASE WHEN status = 'failed' THEN 'upstream refused the connection' END,
           CASE WHEN status = 'failed' THEN '{"dlq_reason": "retries-exhausted"}'::jsonb END, 3
    FROM fill_runs WHERE status IN ('succeeded', 'failed')
) trail ORDER BY at, k
"""
        )
        conn.execute("DROP TABLE fill_runs")
        # the backlog: queued runs of the last 30 minutes whose outbox rows are pending
        conn.execute(
            f"""
CREATE UNLOGGED TABLE fill_pending AS
SELECT g, gen_random_uuid() AS run_id, t.task, {_queue("t.task")} AS queue,
       CASE WHEN x.r2 < 0.1 THEN NULL ELSE 1 + floor(power(x.r3, 3) * {TENANTS})::bigint END AS tenant_id,
       clock_timestamp() - x.r4 * interval '30 minutes' AS created_at
FROM generate_series(1, {pending}) g
CROSS JOIN LATERAL (SELECT random() AS r1, random() AS r2, random() AS r3, random() AS r4, g AS dep) x
CROSS JOIN LATERAL (SELECT {_task("x")} AS task) t
"""
        )
        conn.execute(
            """
INSERT INTO task_runs (run_id, task, queue, tenant_id, available_at, created_at, updated_at)
SELECT run_id, task, queue, tenant_id, created_at, created_at, created_at
FROM fill_pending ORDER BY created_at
"""
        )
        for table, where in (("outbox_messages", "IS NOT NULL"), ("platform_outbox_messages", "IS NULL")):
            tenant_col = "tenant_id, " if where == "IS NOT NULL" else ""
            conn.execute(
                f"""
INSERT INTO {table} ({tenant_col}run_id, queue, envelope, available_at, created_at)
SELECT {tenant_col}run_id, queue,
       jsonb_build_object('v', 1, 'run_id', run_id::text, 'task', task, 'queue', queue,
                          'tenant_id', tenant_id, 'event', NULL, 'idempotency_key', NULL,
                          'payload', '{{"order_id": 7}}'),
       created_at, created_at
FROM fill_pending WHERE tenant_id {where} ORDER BY created_at
"""
            )
        conn.execute("DROP TABLE fill_pending")
        for table in (
            "task_runs",
            "task_run_trail",
            "outbox_messages",
            "platform_outbox_messages",
            "tenants",
        ):
            conn.execute(f"VACUUM ANALYZE {table}")
    return time.perf_counter() - started
