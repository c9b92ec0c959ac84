"""Operations commands of the ``sqla-outbox`` CLI (registered on :data:`sqla_outbox.cli.main`)."""

from __future__ import annotations

from sqla_outbox.cli import main  # noqa: F401 - commands below attach to it
