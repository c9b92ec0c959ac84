"""``python -m sqla_outbox``: the ``sqla-outbox`` command."""

from sqla_outbox.cli import main

main()
