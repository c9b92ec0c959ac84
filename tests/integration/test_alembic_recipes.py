"""The Alembic recipes of docs/alembic.md, run against a real Alembic (issue 11, item 10).

Each test writes a small application Alembic environment (``alembic.ini``, ``env.py`` and
a revision creating ``tenants``) into a temporary directory, in the two shapes the docs
describe, and runs the ``alembic`` commands an application developer would.
"""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest

from tests import support

ROOT = Path(__file__).resolve().parents[2]

ENV_PY = """\
import os

import sqlalchemy as sa
from alembic import context

import sqla_outbox.migrations

metadata = sa.MetaData()
sa.Table("tenants", metadata, sa.Column("id", sa.BigInteger, primary_key=True))
target_metadata = metadata  # the application's own tables only: it does not import ours
FILTER = os.environ.get("RECIPE_FILTER") == "1"


def run_migrations_online() -> None:
    engine = sa.create_engine(os.environ["RECIPE_DATABASE_URL"], poolclass=sa.pool.NullPool)
    with engine.connect() as connection:
        context.configure(
            connection=connection,
            target_metadata=target_metadata,
            # docs/alembic.md: keeps sqla_outbox's tables (and its standalone version table)
            # out of this application's autogenerate
            include_object=sqla_outbox.migrations.include_object if FILTER else None,
        )
        with context.begin_transaction():
            context.run_migrations()
    engine.dispose()


run_migrations_online()
"""

APP_0001 = """\
import sqlalchemy as sa
from alembic import op

revision = "app_0001"
down_revision = None
branch_labels = ("app",)
depends_on = None


def upgrade() -> None:
    op.create_table("tenants", sa.Column("id", sa.BigInteger(), primary_key=True))


def downgrade() -> None:
    op.drop_table("tenants")
"""


@pytest.fixture
def app_env(tmp_path: Path, pg_url: str) -> Iterator[tuple[Path, str]]:
    name = f"r_{uuid.uuid4().hex[:12]}"
    support.create_database(pg_url, name)
    (tmp_path / "migrations" / "versions").mkdir(parents=True)
    (tmp_path / "migrations" / "env.py").write_text(ENV_PY)
    (tmp_path / "migrations" / "script.py.mako").write_text((ROOT / "alembic" / "script.py.mako").read_text())
    (tmp_path / "migrations" / "versions" / "app_0001_tenants.py").write_text(APP_0001)
    yield tmp_path, support.database_url(pg_url, name)
    support.drop_database(pg_url, name)


def write_ini(directory: Path, *, with_ours: bool) -> Path:
    ours = " sqla_outbox:migrations/versions" if with_ours else ""
    depends = "sqla_outbox_depends_on = app_0001\n" if with_ours else ""
    ini = directory / "alembic.ini"
    ini.write_text(
        "[alembic]\n"
        "script_location = %(here)s/migrations\n"
        f"version_locations = %(here)s/migrations/versions{ours}\n"
        "path_separator = space\n"
        f"{depends}"
    )
    return ini


def run(directory: Path, url: str, *args: str, filtered: bool = False, check: bool = True) -> str:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SQLA_OUTBOX_")}
    env.update(
        RECIPE_DATABASE_URL=url.replace("postgresql://", "postgresql+psycopg://"),
        RECIPE_FILTER="1" if filtered else "0",
        SQLA_OUTBOX_DATABASE_URL=url,
        PYTHONPATH=str(ROOT),
    )
    result = subprocess.run(
        [sys.executable, "-m", "alembic", "-c", str(directory / "alembic.ini"), *args],
        capture_output=True,
        text=True,
        env=env,
        cwd=directory,
        timeout=120,
    )
    if check:
        assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout + result.stderr


def sqla_outbox_migrate(url: str) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SQLA_OUTBOX_")}
    env["SQLA_OUTBOX_DATABASE_URL"] = url
    result = subprocess.run(
        [sys.executable, "-m", "sqla_outbox", "migrate"], capture_output=True, text=True, env=env, timeout=120
    )
    assert result.returncode == 0, result.stderr


def test_an_app_that_does_not_import_our_metadata_needs_include_object(app_env: tuple[Path, str]) -> None:
    directory, url = app_env
    write_ini(directory, with_ours=True)
    run(directory, url, "upgrade", "heads")
    unfiltered = run(directory, url, "check", check=False)
    assert "remove_table" in unfiltered and "outbox_messages" in unfiltered  # it would drop our tables
    assert "No new upgrade operations detected" in run(directory, url, "check", filtered=True)


def test_tables_made_by_sqla_outbox_migrate_need_include_object_in_the_apps_autogenerate(
    app_env: tuple[Path, str],
) -> None:
    """Our tables and our standalone version table sit beside the application's, which
    knows nothing of them: without the filter its autogenerate drops them all."""
    directory, url = app_env
    write_ini(directory, with_ours=False)
    run(directory, url, "upgrade", "heads")
    sqla_outbox_migrate(url)
    unfiltered = run(directory, url, "check", check=False)
    assert "sqla_outbox_alembic_version" in unfiltered and "task_runs" in unfiltered
    assert "No new upgrade operations detected" in run(directory, url, "check", filtered=True)


def test_moving_a_database_from_sqla_outbox_migrate_to_the_apps_alembic_needs_a_stamp(
    app_env: tuple[Path, str],
) -> None:
    directory, url = app_env
    write_ini(directory, with_ours=False)
    run(directory, url, "upgrade", "heads")
    sqla_outbox_migrate(url)  # our tables, recorded in sqla_outbox_alembic_version
    write_ini(directory, with_ours=True)  # now the application's environment holds ours too
    refused = run(directory, url, "upgrade", "heads", check=False)
    assert "DuplicateTable" in refused  # it would create our tables again
    with psycopg.connect(url) as conn:
        (ours,) = conn.execute("SELECT version_num FROM sqla_outbox_alembic_version").fetchone() or ("",)
    run(directory, url, "stamp", ours)  # docs/alembic.md: record our head in the app's table
    run(directory, url, "upgrade", "heads")
    assert "No new upgrade operations detected" in run(directory, url, "check", filtered=True)
    with psycopg.connect(url) as conn:
        heads = {row[0] for row in conn.execute("SELECT version_num FROM alembic_version")}
    assert heads == {ours}  # app_0001 is implied: our base revision depends on it
