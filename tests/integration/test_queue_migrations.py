"""Queues of your own in an application's Alembic environment: autogenerate writes the
queue CHECK change, upgrade applies it, downgrade reverts it, ``--sql`` renders it."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
import sqlalchemy as sa

from sqla_outbox import errors
from sqla_outbox.config import sqlalchemy_url
from sqla_outbox.migrations import head_revisions
from sqla_outbox.migrations import queues as outbox_queues
from tests import support
from tests.integration.test_alembic_recipes import APP_0001, ROOT, run, write_ini

ENV_PY = """\
import os

import sqlalchemy as sa
from alembic import context

import sqla_outbox.migrations
from sqla_outbox.migrations import queues as outbox_queues

metadata = sa.MetaData()
sa.Table("tenants", metadata, sa.Column("id", sa.BigInteger, primary_key=True))
DECLARED = [q for q in os.environ.get("RECIPE_QUEUES", "").split(",") if q]


def run_migrations_online() -> None:
    engine = sa.create_engine(os.environ["RECIPE_DATABASE_URL"], poolclass=sa.pool.NullPool)
    with engine.connect() as connection:
        context.configure(
            connection=connection,
            target_metadata=sqla_outbox.migrations.target_metadata(metadata),
            process_revision_directives=outbox_queues.autogenerate(DECLARED),
        )
        with context.begin_transaction():
            context.run_migrations()
    engine.dispose()


def run_migrations_offline() -> None:
    context.configure(url=os.environ["RECIPE_DATABASE_URL"], literal_binds=True)
    with context.begin_transaction():
        context.run_migrations()


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
"""


@pytest.fixture
def queue_env(tmp_path: Path, pg_url: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[Path, str]]:
    name = f"q_{uuid.uuid4().hex[:12]}"
    support.create_database(pg_url, name)
    (tmp_path / "migrations" / "versions").mkdir(parents=True)
    (tmp_path / "migrations" / "env.py").write_text(ENV_PY)
    (tmp_path / "migrations" / "script.py.mako").write_text((ROOT / "alembic" / "script.py.mako").read_text())
    (tmp_path / "migrations" / "versions" / "app_0001_tenants.py").write_text(APP_0001)
    write_ini(tmp_path, with_ours=True)
    yield tmp_path, support.database_url(pg_url, name)
    support.drop_database(pg_url, name)


def insert_run(url: str, queue: str) -> None:
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(
            "INSERT INTO task_runs (run_id, task, queue, available_at) VALUES (%s, 'remind', %s, now())",
            (uuid.uuid4(), queue),
        )


def test_autogenerate_upgrade_downgrade_of_a_declared_queue(
    queue_env: tuple[Path, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    directory, url = queue_env
    run(directory, url, "upgrade", "heads")
    with pytest.raises(psycopg.errors.CheckViolation):
        insert_run(url, "reminders")

    monkeypatch.setenv("RECIPE_QUEUES", "reminders")
    run(directory, url, "revision", "--autogenerate", "-m", "reminders queue", "--head", "app@head")
    (revision,) = [p for p in (directory / "migrations" / "versions").glob("*.py") if "reminders" in p.name]
    source = revision.read_text()
    assert "import sqla_outbox.migrations.queues" in source
    assert "op.set_outbox_queues(['reminders'], previous=[])" in source
    assert "op.set_outbox_queues([], previous=['reminders'])" in source
    (ours,) = head_revisions()  # a database built from scratch creates the CHECK first
    assert f"depends_on = '{ours}'" in source or f"depends_on = ('{ours}',)" in source
    run(directory, url, "upgrade", "heads")
    insert_run(url, "reminders")
    engine = sa.create_engine(sqlalchemy_url(url), poolclass=sa.pool.NullPool)
    with engine.connect() as conn:
        assert outbox_queues.current_queues(conn) == ("reminders",)

    # nothing left to generate: the database matches the catalog
    run(directory, url, "revision", "--autogenerate", "-m", "again", "--head", "app@head")
    (again,) = [p for p in (directory / "migrations" / "versions").glob("*.py") if "again" in p.name]
    assert "set_outbox_queues" not in again.read_text()
    again.unlink()

    offline = run(directory, url, "upgrade", "app_0001:app@head", "--sql")
    assert "outbox_messages_queue_check" in offline and "'reminders'" in offline

    with psycopg.connect(url, autocommit=True) as conn:  # downgrade needs the rows gone
        conn.execute("DELETE FROM task_runs WHERE queue = 'reminders'")
    run(directory, url, "downgrade", "app@-1")
    with pytest.raises(psycopg.errors.CheckViolation):
        insert_run(url, "reminders")
    insert_run(url, "bulk")  # the defaults stay


def test_queue_names_in_the_operation_are_checked() -> None:
    with pytest.raises(errors.ConfigurationError, match="not a queue name"):
        outbox_queues.SetOutboxQueuesOp(["bad'name"])
    op = outbox_queues.SetOutboxQueuesOp(["critical", "reminders", "reminders"], previous=[])
    assert op.queues == ("reminders",)
    assert op.reverse().queues == () and op.reverse().previous == ("reminders",)
    assert outbox_queues.check_condition(["reminders"]) == (
        "queue IN ('critical', 'default', 'bulk', 'maintenance', 'reminders')"
    )
