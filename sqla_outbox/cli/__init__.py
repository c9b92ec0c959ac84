"""Command line: ``python -m sqla_outbox <command>`` and the ``python -m
sqla_outbox.relay|worker`` entry points (also installed as ``sqla-outbox``,
``sqla-outbox-relay`` and ``sqla-outbox-worker``).

Layout (imports run downward only):

* :mod:`~sqla_outbox.cli.main` — the command group; attaches every command module;
* one module per command group — ``relay``, ``worker``, ``provision``, ``migrate``,
  ``catalog``, ``config``, ``status``, ``runs``, ``dlq``, ``purge``, ``demo``;
* :mod:`~sqla_outbox.cli.options` (settings options with env twins, exit codes, error
  handling, signals) and :mod:`~sqla_outbox.cli.terminal` (console, tables, JSON), which
  import no command module.

Exit codes: 0 ok, 1 a check failed, 2 bad configuration, 3 a service could not be reached.
"""

from __future__ import annotations

from typing import Any

__all__ = ["main", "main_relay", "main_worker"]


def __getattr__(name: str) -> Any:
    """``main``, ``main_relay`` and ``main_worker`` on first use, so importing one command
    module (``python -m sqla_outbox.relay`` imports only :mod:`~sqla_outbox.cli.relay`)
    does not load every other command."""
    if name == "main":
        from sqla_outbox.cli.main import main

        return main
    if name == "main_relay":
        from sqla_outbox.cli.relay import main_relay

        return main_relay
    if name == "main_worker":
        from sqla_outbox.cli.worker import main_worker

        return main_worker
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
