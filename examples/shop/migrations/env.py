"""The shop's Alembic env.py: an ordinary one, plus sqla_outbox's metadata.

The two lines that matter for sqla_outbox are marked. ``target_metadata`` holds the
shop's metadata and sqla_outbox's (with its tenant foreign key bound to the shop's
``tenants`` table), so ``alembic revision --autogenerate`` / ``alembic check`` see
sqla_outbox's tables as known and propose nothing for them.
"""

from __future__ import annotations

import logging.config
import os

from sqlalchemy import create_engine, pool

import sqla_outbox
from alembic import context
from examples.shop.models import Base
from sqla_outbox.migrations import target_metadata as outbox_target_metadata  # <-- sqla_outbox

config = context.config
if config.config_file_name is not None:
    logging.config.fileConfig(config.config_file_name, disable_existing_loggers=False)

target_metadata = outbox_target_metadata(Base.metadata)  # <-- [Base.metadata, sqla_outbox's]


def database_url() -> str:
    url = os.environ.get("SHOP_DATABASE_URL") or os.environ.get("DATABASE_URL")
    url = url or "postgresql://postgres@127.0.0.1:5432/postgres"
    return sqla_outbox.config.sqlalchemy_url(url)


def run_migrations_offline() -> None:
    context.configure(url=database_url(), target_metadata=target_metadata, literal_binds=True)
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_online() -> None:
    engine = create_engine(database_url(), poolclass=pool.NullPool)
    with engine.connect() as connection:
        context.configure(connection=connection, target_metadata=target_metadata)
        with context.begin_transaction():
            context.run_migrations()
    engine.dispose()


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
