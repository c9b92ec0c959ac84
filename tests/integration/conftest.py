"""Fixtures shared by the integration tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import sqlalchemy as sa
from sqlalchemy.orm import Session, sessionmaker

import sqla_outbox
from sqla_outbox.catalog import Catalog
from sqla_outbox.config import OutboxSettings


@pytest.fixture
def factory(engine: sa.Engine, settings: OutboxSettings, catalog: Catalog) -> Iterator[sessionmaker[Session]]:
    """A ``sessionmaker`` on the test database with the sqla_outbox listeners installed."""
    maker = sessionmaker(engine)
    sqla_outbox.install(maker, settings, catalog=catalog)
    yield maker
    sqla_outbox.uninstall(maker)
