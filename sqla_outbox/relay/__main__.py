"""``python -m sqla_outbox.relay``: see :mod:`sqla_outbox.relay` (the command is in
:mod:`sqla_outbox.cli.relay`; an entry-point shim, the one module of this package that
imports the CLI)."""

from sqla_outbox.cli.relay import main_relay

main_relay()
