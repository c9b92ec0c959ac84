"""This repository's Alembic environment: the bundled sqla_outbox revisions, standalone.

Same behaviour as the environment shipped in the package (``sqla_outbox:migrations``):
version table ``sqla_outbox_alembic_version``, URL from ``SQLA_OUTBOX_DATABASE_URL`` or
``DATABASE_URL``, online and offline (``--sql``) modes.
"""

from __future__ import annotations

import logging.config

from alembic import context
from sqla_outbox.migrations.environment import run

if context.config.config_file_name is not None:
    logging.config.fileConfig(context.config.config_file_name, disable_existing_loggers=False)

run()
