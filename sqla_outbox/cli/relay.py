"""``python -m sqla_outbox.relay``: move committed outbox rows to SQS (one active relay)."""

from __future__ import annotations

import dataclasses
import gc
import sys
from typing import Any

import click

from sqla_outbox.cli.options import (
    EXIT_CONFIG,
    EXIT_CONNECT,
    EXIT_OK,
    Abandon,
    StopSignals,
    common_options,
    handle_errors,
    load_settings,
    setting,
    setup_logging,
)
from sqla_outbox.cli.terminal import echo, print_check_report, print_json


@click.command("relay")
@common_options
@setting("relay_sweep_interval_seconds", "--sweep-interval", type=float)
@setting("relay_batch_size", "--batch-size", type=int)
@setting("relay_send_concurrency", "--send-concurrency", type=int)
@setting("health_port", "--health-port", type=int)
@setting("health_host", "--health-host")
@click.option(
    "--once",
    is_flag=True,
    help="Run one pass and exit; when another relay is active (with relay_partitions > 1: "
    "when running relays own every partition), do nothing (exit code 0, "
    '"leader": false in --json); otherwise pass over the partitions no relay owns.',
)
@click.option("--check", is_flag=True, help="Check the database, Valkey and SQS, then exit.")
@click.option("--json", "as_json", is_flag=True, help="With --once/--check: print JSON.")
def relay_command(
    verbose: int, log_format: str, traceback: bool, once: bool, check: bool, as_json: bool, **options: Any
) -> None:
    """Move committed outbox rows to SQS (one active relay, others stand by; with
    relay_partitions > 1, every relay active on a share of the outbox)."""
    setup_logging(verbose, log_format)
    signals = None if once or check else StopSignals()
    with handle_errors(traceback):
        settings = load_settings(**options)
        if check:
            from sqla_outbox import health

            report = health.check_services(settings, need_queues=True)
            schedules = health.check_schedules(settings)
            partitions = health.check_partitions(settings)
            report.results += [schedules, partitions]
            print_check_report(report, as_json=as_json)
            if not report.ok:  # 3: a service did not answer; 2: only the configuration is wrong
                sys.exit(EXIT_CONFIG if report.ok_without(schedules, partitions) else EXIT_CONNECT)
            sys.exit(EXIT_OK)
        from sqla_outbox.relay import Relay

        relay = Relay(settings)
        if once:
            result = relay.run_once()
            if as_json:
                print_json(dataclasses.asdict(result))
            elif not result.leader and settings.relay_partitions > 1:
                echo("running relays own every partition; nothing done (they send the pending rows)")
            elif not result.leader:
                echo("another relay is active; nothing done (it sends the pending rows)")
            else:
                line = f"claimed {result.claimed}, sent {result.sent}, failed {result.failed}"
                if result.held:  # no live worker implements their task (docs/deployment.md)
                    line += f", held {result.held} (no live worker implements their task)"
                if result.parked:
                    line += f" ({result.parked} parked: `python -m sqla_outbox outbox parked`)"
                echo(line)
            return  # exit code 0 either way: the active relay does the work
        probe = None
        if settings.health_port is not None:
            from sqla_outbox.health import ProbeServer

            probe = ProbeServer(
                settings.health_port,
                ready=lambda: not relay.stopping,
                host=settings.health_host,
                roles=("relay",),
            )
            probe.start()
        assert signals is not None  # --check and --once have returned
        signals.attach(relay.stop)  # a stop asked for during start-up: before the first pass
        try:
            relay.run()
        except Abandon:
            echo("relay: abandoned the batch in progress (its rows stay pending)", err=True)
        finally:
            if probe is not None:
                probe.stop()
            gc.freeze()  # as the worker: no whole-heap collection at exit after the stop


def main_relay() -> None:
    """``python -m sqla_outbox.relay`` / ``sqla-outbox-relay``."""
    relay_command.main(args=sys.argv[1:], prog_name="python -m sqla_outbox.relay")
