"""The ``python -m sqla_outbox`` command group: every command module attached to one group.

Command modules (``relay``, ``worker``, ``provision``, ``migrate``, ``catalog``,
``config``, ``status``, ``runs``, ``dlq``, ``outbox``, ``pause``/``resume``/``flow``,
``purge``, ``dashboard``, ``demo``) each define their
command or group and import only :mod:`sqla_outbox.cli.options` and
:mod:`sqla_outbox.cli.terminal` from the CLI; this module is the only one that imports
them, so the CLI's imports run one way (docs/architecture.md).
"""

from __future__ import annotations

import click

from sqla_outbox.cli.catalog import catalog_group
from sqla_outbox.cli.config import config_command
from sqla_outbox.cli.dashboard import dashboard_command
from sqla_outbox.cli.demo import demo_command
from sqla_outbox.cli.dlq import dlq_group
from sqla_outbox.cli.flow import flow_group, pause_command, resume_command
from sqla_outbox.cli.groups import groups_group
from sqla_outbox.cli.migrate import migrate_command
from sqla_outbox.cli.outbox import outbox_group
from sqla_outbox.cli.provision import provision_command
from sqla_outbox.cli.purge import purge_command
from sqla_outbox.cli.relay import main_relay, relay_command
from sqla_outbox.cli.runs import runs_group
from sqla_outbox.cli.status import status_command
from sqla_outbox.cli.worker import main_worker, worker_command


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(package_name="sqla-outbox")
def main() -> None:
    """sqla_outbox: transactional outbox for SQLAlchemy, relayed to AWS SQS.

    Relay and worker run as `python -m sqla_outbox.relay` and `python -m
    sqla_outbox.worker`; every other command as `python -m sqla_outbox <command>`
    (also installed as the `sqla-outbox` script).
    """


for _command in (
    relay_command,
    worker_command,
    provision_command,
    migrate_command,
    catalog_group,
    config_command,
    status_command,
    runs_group,
    groups_group,
    dlq_group,
    outbox_group,
    pause_command,
    resume_command,
    flow_group,
    purge_command,
    dashboard_command,
    demo_command,
):
    main.add_command(_command)

__all__ = ["main", "main_relay", "main_worker"]
