"""The bundled migrations: standalone, inside an application's Alembic, from a wheel."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import psycopg
import pytest
import sqlalchemy as sa
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext

from sqla_outbox import migrations, models
from tests import support

ROOT = Path(__file__).resolve().parents[2]
OUR_TABLES = {
    "outbox_messages",
    "platform_outbox_messages",
    "task_runs",
    "task_run_trail",
    "webhook_endpoints",
    "worker_presence",
    "schedule_slots",
    "task_groups",
    "schedule_tenant_slots",
    "flow_pauses",
    "tenant_flow",
    "dashboard_sessions",
}


def alembic(
    args: list[str],
    *,
    url: str,
    config: Path,
    env: dict[str, str] | None = None,
    python: str = sys.executable,
    extra_path: str | None = None,
    cwd: Path = ROOT,
) -> subprocess.CompletedProcess[str]:
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("SQLA_OUTBOX_")}
    full_env.update({"SQLA_OUTBOX_DATABASE_URL": url, "SHOP_DATABASE_URL": url, "DATABASE_URL": url})
    if extra_path:
        full_env["PYTHONPATH"] = extra_path
    full_env.update(env or {})
    result = subprocess.run(
        [python, "-m", "alembic", "-c", str(config), *args],
        capture_output=True,
        text=True,
        env=full_env,
        cwd=cwd,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def tables(url: str) -> set[str]:
    with psycopg.connect(url) as conn:
        rows = conn.execute("SELECT tablename FROM pg_tables WHERE schemaname = 'public'").fetchall()
    return {r[0] for r in rows}


def constraints(url: str, table: str) -> dict[str, str]:
    with psycopg.connect(url) as conn:
        rows = conn.execute(
            "SELECT conname, pg_get_constraintdef(oid) FROM pg_constraint WHERE conrelid = %s::regclass",
            (table,),
        ).fetchall()
    return dict(rows)


def with_tenants(url: str, table: str = "tenants") -> None:
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(f"CREATE TABLE {table} (id bigint PRIMARY KEY)")


def test_standalone_upgrade_downgrade_and_offline_sql(empty_db: str) -> None:
    with_tenants(empty_db)
    config = ROOT / "alembic.ini"
    alembic(["upgrade", "head"], url=empty_db, config=config)
    assert OUR_TABLES <= tables(empty_db)
    with psycopg.connect(empty_db) as conn:
        version = conn.execute("SELECT version_num FROM sqla_outbox_alembic_version").fetchall()
    assert [v for (v,) in version] == list(migrations.head_revisions())
    offline = alembic(["upgrade", "head", "--sql"], url=empty_db, config=config)
    assert "CREATE TABLE outbox_messages" in offline.stdout
    assert "CONSTRAINT outbox_messages_envelope_check" in offline.stdout
    assert "GENERATED ALWAYS AS IDENTITY" in offline.stdout
    alembic(["downgrade", "base"], url=empty_db, config=config)
    assert not OUR_TABLES & tables(empty_db)


def test_schema_is_what_the_spec_says(database_url: str) -> None:
    url = database_url.replace("+psycopg", "")
    for table in ("outbox_messages", "platform_outbox_messages"):
        found = constraints(url, table)
        assert found[f"{table}_attempts_check"] == "CHECK ((attempts >= 0))"
        assert found[f"{table}_envelope_check"] == "CHECK ((jsonb_typeof(envelope) = 'object'::text))"
        assert (
            "'critical'::text, 'default'::text, 'bulk'::text, 'maintenance'::text"
            in found[f"{table}_queue_check"]
        )
        assert found[f"{table}_pkey"] == "PRIMARY KEY (id)"
        assert found[f"{table}_run_id_key"] == "UNIQUE (run_id)"
    assert constraints(url, "outbox_messages")["outbox_messages_tenant_id_fkey"] == (
        "FOREIGN KEY (tenant_id) REFERENCES tenants(id)"
    )
    with psycopg.connect(url) as conn:
        columns = conn.execute(
            "SELECT table_name, column_name, data_type, is_nullable, column_default, "
            "is_identity, identity_generation FROM information_schema.columns "
            "WHERE table_name IN ('outbox_messages', 'platform_outbox_messages')"
        ).fetchall()
        index = conn.execute(
            "SELECT indexdef FROM pg_indexes WHERE indexname = 'outbox_messages_pending_idx'"
        ).fetchone()
    spec = {
        "id": ("bigint", "NO"),
        "tenant_id": ("bigint", "NO"),
        "run_id": ("uuid", "NO"),
        "queue": ("text", "NO"),
        "envelope": ("jsonb", "NO"),
        "available_at": ("timestamp with time zone", "NO"),
        "sent_at": ("timestamp with time zone", "YES"),
        "attempts": ("integer", "NO"),
        "created_at": ("timestamp with time zone", "NO"),
        "parked_at": ("timestamp with time zone", "YES"),
        "last_error": ("text", "YES"),
        "priority": ("smallint", "NO"),
    }
    for table, column, data_type, nullable, default, is_identity, generation in columns:
        assert (data_type, nullable) == spec[column], (table, column)
        if column == "id":
            assert (is_identity, generation) == ("YES", "ALWAYS")
        if column == "created_at":
            assert default == "clock_timestamp()"
        if column == "attempts":
            assert default == "0"
        if column == "priority":
            assert default == "3"
    assert {c[1] for c in columns if c[0] == "platform_outbox_messages"} == set(spec) - {"tenant_id"}
    assert (
        index is not None
        and "(available_at, id) WHERE ((sent_at IS NULL) AND (parked_at IS NULL))" in index[0]
    )
    assert constraints(url, "outbox_messages")["outbox_messages_parked_check"] == (
        "CHECK (((sent_at IS NULL) OR (parked_at IS NULL)))"
    )


def test_models_match_the_migrations(database_url: str) -> None:
    engine = sa.create_engine(database_url)
    tenants = sa.Table("tenants", sa.MetaData(), autoload_with=engine)
    models.set_tenant_foreign_key(tenants.c.id)
    try:
        with engine.connect() as conn:
            context = MigrationContext.configure(
                conn,
                opts={
                    "compare_type": True,
                    "include_name": lambda name, type_, parent: type_ != "table" or name in OUR_TABLES,
                },
            )
            diff = compare_metadata(context, models.metadata)
    finally:
        models.set_tenant_foreign_key("tenants.id")
        engine.dispose()
    assert diff == []


def _run_list_indexes(url: str) -> dict[str, bool]:
    with psycopg.connect(url) as conn:
        rows = conn.execute(
            "SELECT c.relname, i.indisvalid FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid "
            "WHERE i.indrelid = 'task_runs'::regclass AND c.relname LIKE '%created_at_idx'"
        ).fetchall()
    return dict(rows)


def test_run_list_indexes_are_built_concurrently_on_a_large_table(
    empty_db: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """sqlaob_0003 on a table past the threshold: CREATE INDEX CONCURRENTLY outside the
    migration's transaction (dispatches keep flowing), and an index a cancelled concurrent
    build left INVALID is dropped and built again."""
    with_tenants(empty_db)
    url = "postgresql+psycopg://" + empty_db.removeprefix("postgresql://")
    migrations.upgrade(url, "sqlaob_0002")  # the revision before the run-list indexes
    with psycopg.connect(empty_db, autocommit=True) as conn:
        conn.execute(
            "INSERT INTO task_runs (run_id, task, queue, status, available_at) SELECT gen_random_uuid(), "
            "'t', 'default', 'queued', clock_timestamp() FROM generate_series(1, 50)"
        )
        conn.execute("ANALYZE task_runs")
        with pytest.raises(psycopg.errors.UniqueViolation):  # leaves an INVALID index behind
            conn.execute("CREATE UNIQUE INDEX CONCURRENTLY task_runs_created_at_idx ON task_runs (status)")
    assert _run_list_indexes(empty_db) == {"task_runs_created_at_idx": False}
    monkeypatch.setattr(migrations, "CONCURRENT_INDEX_MIN_ROWS", 10)
    statements: list[str] = []
    engine = sa.create_engine(url)
    sa.event.listen(engine, "before_cursor_execute", lambda *args: statements.append(args[2].strip()))
    try:
        with engine.connect() as conn:
            migrations.upgrade(conn, "sqlaob_0003")
    finally:
        engine.dispose()
    built = [s for s in statements if s.startswith("CREATE INDEX") and "_created_at_idx" in s]
    assert len(built) == 3 and all(s.startswith("CREATE INDEX CONCURRENTLY IF NOT EXISTS") for s in built)
    dropped = [s for s in statements if s.startswith("DROP INDEX")]
    assert dropped == ["DROP INDEX CONCURRENTLY task_runs_created_at_idx"]
    assert _run_list_indexes(empty_db) == {
        "task_runs_created_at_idx": True,
        "task_runs_task_created_at_idx": True,
        "task_runs_tenant_id_created_at_idx": True,
    }
    assert migrations.current_revisions(url) == ("sqlaob_0003",)
    migrations.downgrade(url, "sqlaob_0002")
    assert _run_list_indexes(empty_db) == {}


@pytest.mark.parametrize(
    ("setting", "expected"), [("accounts.id", "REFERENCES accounts(id)"), ("none", None)]
)
def test_tenant_foreign_key_is_configurable(empty_db: str, setting: str, expected: str | None) -> None:
    with_tenants(empty_db, "accounts")
    alembic(
        ["upgrade", "head"],
        url=empty_db,
        config=ROOT / "alembic.ini",
        env={"SQLA_OUTBOX_TENANT_FOREIGN_KEY": setting},
    )
    found = constraints(empty_db, "outbox_messages")
    fkey = found.get("outbox_messages_tenant_id_fkey")
    if expected is None:
        assert fkey is None
    else:
        assert fkey is not None and expected in fkey


def _shop_recipe(
    url: str, *, python: str = sys.executable, root: Path = ROOT, extra_path: str | None = None
) -> None:
    config = root / "examples" / "shop" / "alembic.ini"
    kwargs = {"url": url, "config": config, "python": python, "extra_path": extra_path, "cwd": root}
    alembic(["upgrade", "heads"], **kwargs)
    assert OUR_TABLES | {"tenants", "products", "orders", "shop_effects", "alembic_version"} <= tables(url)
    with psycopg.connect(url) as conn:
        runs = conn.execute("SELECT task, tenant_id, status FROM task_runs ORDER BY tenant_id").fetchall()
        outbox = conn.execute("SELECT count(*) FROM outbox_messages").fetchone()
    assert runs == [("welcome_tenant", t, "queued") for t in (1, 2, 3)]  # the data migration
    assert outbox == (3,)
    check = alembic(["check"], **kwargs)
    assert "No new upgrade operations detected" in check.stdout + check.stderr
    alembic(["downgrade", "base"], **kwargs)
    assert not (OUR_TABLES | {"tenants", "orders"}) & tables(url)


def test_application_alembic_environment_recipe(empty_db: str) -> None:
    _shop_recipe(empty_db, extra_path=str(ROOT))


def test_a_data_migration_that_dispatches_works_offline_and_across_a_downgrade_upgrade_cycle(
    empty_db: str,
) -> None:
    """docs/alembic.md "A data migration that dispatches": ``--sql`` used to break (a
    Session on the offline mock connection); deterministic run ids keep a second upgrade
    from dispatching again while the first upgrade's runs exist."""
    kwargs: dict[str, Any] = {
        "url": empty_db,
        "config": ROOT / "examples" / "shop" / "alembic.ini",
        "extra_path": str(ROOT),
    }
    offline = alembic(["upgrade", "heads", "--sql"], **kwargs)
    assert "INSERT INTO tenants" in offline.stdout
    assert "-- shop_0002: the welcome_tenant dispatches need an online upgrade" in offline.stdout

    def welcomes() -> tuple[list[tuple[Any, ...]], int]:
        with psycopg.connect(empty_db) as conn:
            found = conn.execute(
                "SELECT run_id, status FROM task_runs WHERE task = 'welcome_tenant' ORDER BY tenant_id"
            ).fetchall()
            rows = conn.execute("SELECT count(*) FROM outbox_messages").fetchone()
        assert rows is not None
        return found, int(rows[0])

    alembic(["upgrade", "heads"], **kwargs)
    first, rows = welcomes()
    assert len(first) == 3 and rows == 3
    alembic(["downgrade", "shop_0001"], **kwargs)  # not sent yet: withdrawn with the seed
    assert welcomes() == ([], 0)
    alembic(["upgrade", "heads"], **kwargs)
    assert welcomes() == (first, 3)  # the same run ids again
    with psycopg.connect(empty_db, autocommit=True) as conn:  # sent and run, as a relay and worker would
        conn.execute("UPDATE outbox_messages SET sent_at = clock_timestamp()")
        conn.execute("UPDATE task_runs SET status = 'succeeded', finished_at = clock_timestamp()")
    alembic(["downgrade", "shop_0001"], **kwargs)
    alembic(["upgrade", "heads"], **kwargs)
    assert welcomes() == ([(run_id, "succeeded") for run_id, _ in first], 0)  # nobody welcomed twice


def test_migrations_work_from_an_installed_wheel(empty_db: str, tmp_path: Path) -> None:
    wheel = support.wheel_environment(tmp_path)
    fresh, venv = wheel.python, tmp_path / "venv"
    # dependencies come from the test environment; sqla_outbox itself only from the wheel
    deps = wheel.dependencies
    app = tmp_path / "app"
    shutil.copytree(ROOT / "examples", app / "examples", ignore=shutil.ignore_patterns("__pycache__"))
    where = subprocess.run(
        [fresh, "-c", "import sqla_outbox, sqla_outbox.migrations as m; print(sqla_outbox.__file__)"],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": f"{app}:{deps}"},
        cwd=app,
        check=True,
    )
    assert where.stdout.startswith(str(venv)), where.stdout
    _shop_recipe(empty_db, python=fresh, root=app, extra_path=f"{app}:{deps}")
