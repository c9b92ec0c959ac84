"""``python -m sqla_outbox.relay``: see :mod:`sqla_outbox.relay`."""

from sqla_outbox.cli import main_relay

main_relay()
