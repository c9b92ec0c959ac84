"""``python -m sqla_outbox.worker``: see :mod:`sqla_outbox.worker` (the command is in
:mod:`sqla_outbox.cli.worker`; an entry-point shim, the one module of this package that
imports the CLI)."""

from sqla_outbox.cli.worker import main_worker

main_worker()
