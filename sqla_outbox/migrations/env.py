"""Alembic environment for sqla_outbox's own migrations (standalone use).

Uses the version table ``sqla_outbox_alembic_version`` so it never collides with an
application's ``alembic_version``. The database URL comes from, in order: a connection
passed in ``config.attributes["connection"]``, ``sqlalchemy.url`` in the config,
``SQLA_OUTBOX_DATABASE_URL``, ``DATABASE_URL``.
"""

from __future__ import annotations

from sqla_outbox.migrations.environment import run

run()
