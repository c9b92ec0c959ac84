"""``python -m sqla_outbox <command>``: the command group (:mod:`sqla_outbox.cli.main`)."""

from sqla_outbox.cli.main import main

main()
