"""``python -m sqla_outbox.worker``: see :mod:`sqla_outbox.worker`."""

from sqla_outbox.cli import main_worker

main_worker()
