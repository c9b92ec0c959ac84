"""pytest plugin: an ``outbox`` fixture for applications' tests (entry point ``sqla_outbox``).

Installing sqla_outbox registers this module with pytest (``pytest11`` entry point), so
an application's tests can use the fixtures below once they say which database to use
by overriding ``outbox_session_factory`` in their ``conftest.py``::

    @pytest.fixture
    def outbox_session_factory(session_factory):     # your installed sessionmaker
        return session_factory

    def test_order(session_factory, outbox):
        with session_factory.begin() as session:
            place_order(session, ...)
        outbox.assert_dispatched("send_receipt", tenant_id=1)
        outbox.run_pending().assert_all_succeeded()

The fixtures are function-scoped and none is autouse: a project that does not request
them pays only for importing this module, which adds nothing to what ``import
sqla_outbox`` loads (the helpers in :mod:`sqla_outbox.testing` are imported when the
``outbox`` fixture is first used, and boto3 never is). Disable the plugin with
``-p no:sqla_outbox``.

Where CI has no database service, ``outbox_postgres_server`` gives a server (the one at
``DATABASE_URL`` when it answers, else an embedded one) and ``outbox_database_url`` a
database on it with sqla_outbox's migrations applied.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from sqla_outbox.catalog import Catalog
    from sqla_outbox.config import OutboxSettings
    from sqla_outbox.testing import Outbox
    from sqla_outbox.worker.registry import Registry


@pytest.fixture
def outbox_session_factory() -> Any:
    """The application's installed ``sessionmaker`` (or an ``Engine``). Override it.

    Handlers' sync sessions come from it; its sqla_outbox installation supplies the
    settings and catalog for follow-up dispatches.
    """
    pytest.fail(
        "the sqla_outbox `outbox` fixture needs a database: override the "
        "`outbox_session_factory` fixture in your conftest.py to return your installed "
        "sessionmaker (or an Engine)",
        pytrace=False,
    )


@pytest.fixture
def outbox_registry() -> Registry | None:
    """Registry of the handlers ``outbox.run_pending()`` runs; None: the ``@task`` registry.

    Import your task modules (or override this fixture) so the handlers are registered.
    """
    return None


@pytest.fixture
def outbox_catalog() -> Catalog | None:
    """Catalog for follow-up dispatches; None: the installation's (or the registry's)."""
    return None


@pytest.fixture
def outbox_settings() -> OutboxSettings | None:
    """Settings for ``run_pending``; None: the installation's (or no wake signal)."""
    return None


@pytest.fixture
def outbox(
    outbox_session_factory: Any,
    outbox_registry: Registry | None,
    outbox_catalog: Catalog | None,
    outbox_settings: OutboxSettings | None,
) -> Outbox:
    """A :class:`sqla_outbox.testing.Outbox` bound to ``outbox_session_factory``.

    ``outbox.dispatched(...)``, ``outbox.assert_dispatched(...)``,
    ``outbox.assert_not_dispatched(...)``, ``outbox.assert_published(...)`` (pass
    ``session=`` to read inside an open transaction) and ``outbox.run_pending(...)``.
    """
    from sqla_outbox.testing import Outbox

    return Outbox(
        outbox_session_factory, registry=outbox_registry, catalog=outbox_catalog, settings=outbox_settings
    )


@pytest.fixture(scope="session")
def outbox_postgres_server() -> Iterator[str]:
    """A PostgreSQL server for the session: the one at ``DATABASE_URL`` (default
    ``postgresql://postgres@127.0.0.1:5432/postgres``) when it answers, otherwise an
    embedded server in a temporary folder, removed at the end (needs
    ``pip install 'sqla-outbox[embedded]'``).

    Yields the libpq URL (``postgresql://...``) of a database to connect to for
    ``CREATE DATABASE``; create your test databases beside it
    (:func:`sqla_outbox.config.with_database` names them).
    """
    from sqla_outbox.testing.database import database_server

    configured = os.environ.get("DATABASE_URL", "postgresql://postgres@127.0.0.1:5432/postgres")
    with database_server(configured) as url:
        yield url


@pytest.fixture(scope="session")
def outbox_database_url(outbox_postgres_server: str) -> Iterator[str]:
    """SQLAlchemy URL of a fresh database on ``outbox_postgres_server`` with sqla_outbox's
    migrations at head (no tenant foreign key), dropped at the end of the session.

    For suites that do not run their own Alembic environment; one that does (ours
    included, docs/alembic.md) creates its database on ``outbox_postgres_server`` instead.
    """
    from sqla_outbox.testing.database import embedded_database

    with embedded_database(outbox_postgres_server) as url:
        yield url
