"""``python -m sqla_outbox.worker``: run task handlers from SQS."""

from __future__ import annotations

import gc
import logging
import sys
from typing import Any

import click

from sqla_outbox.cli.options import (
    EXIT_CONFIG,
    EXIT_CONNECT,
    EXIT_OK,
    StopSignals,
    common_options,
    handle_errors,
    load_settings,
    setting,
    setup_logging,
    split_list,
)
from sqla_outbox.cli.terminal import print_check_report


@click.command("worker")
@common_options
@setting("worker_queues", "--queues", "-Q", callback=lambda ctx, param, value: split_list(value))
@setting("worker_concurrency", "--concurrency", "-c", type=int)
@setting("worker_imports", "--imports", "-I", callback=lambda ctx, param, value: split_list(value))
@setting("worker_wait_seconds", "--wait-seconds", type=int)
@setting("worker_stop_budget_seconds", "--stop-budget", type=float)
@setting("worker_run_relay", "--with-relay/--without-relay")
@setting("worker_id", "--worker-id")
@setting("health_port", "--health-port", type=int)
@setting("health_host", "--health-host")
@setting("catalog_path", "--catalog")
@click.option("--check", is_flag=True, help="Check the database, Valkey, SQS and the handlers, then exit.")
@click.option("--json", "as_json", is_flag=True, help="With --check: print JSON.")
def worker_command(
    verbose: int, log_format: str, traceback: bool, check: bool, as_json: bool, **options: Any
) -> None:
    """Run task handlers from SQS: heartbeats, retries, DLQ, run history, graceful stop."""
    setup_logging(verbose, log_format)
    signals = None if check else StopSignals()
    with handle_errors(traceback):
        settings = load_settings(**options)
        from sqla_outbox.worker.consumer import Worker, import_task_modules

        import_task_modules(settings.worker_imports)
        if check:
            from sqla_outbox import health

            report = health.check_services(settings, need_queues=True)
            handlers = health.check_handlers(settings)
            report.results.append(handlers)
            print_check_report(report, as_json=as_json)
            if not report.ok:  # 3: a service did not answer; 2: only the configuration is wrong
                sys.exit(EXIT_CONFIG if report.ok_without(handlers) else EXIT_CONNECT)
            sys.exit(EXIT_OK)
        _refuse_unmigrated_database(settings)
        from sqla_outbox.logging import log_extra
        from sqla_outbox.worker.registry import registry

        chosen = settings.worker_queues_chosen
        log = logging.getLogger("sqla_outbox.worker")
        for warning in registry.preflight(settings, queues=settings.worker_queues, queues_chosen=chosen):
            log.warning(warning, extra=log_extra(action="worker.preflight"))
        unserved = registry.unserved_queues(settings.worker_queues)
        if not chosen and unserved:
            log.info(
                "consuming the default queues; no registered task uses %s (a message there is "
                "handed back to the outbox; --queues chooses the queues)",
                ", ".join(unserved),
                extra=log_extra(action="worker.preflight"),
            )
        assert signals is not None  # --check has returned
        worker = Worker(settings)
        probe = None
        if settings.health_port is not None:
            from sqla_outbox.health import ProbeServer

            probe = ProbeServer(
                settings.health_port,
                ready=lambda: worker.ready and not worker.stopping,
                alive=worker.is_alive,
                host=settings.health_host,
                roles=("worker", "relay") if settings.worker_run_relay else ("worker",),
            )
            probe.start()
        try:
            worker.run(stop_requested=signals.requested)
        finally:
            if probe is not None:
                probe.stop()
            # the stop is done: spare the exit a garbage collection of every object the
            # process built (boto3's models, SQLAlchemy's caches), which took 0.5-2 s of
            # the time between "worker stopped" and the process ending
            gc.freeze()


def _refuse_unmigrated_database(settings: Any) -> None:
    """Stop before receiving anything when the database answers but lacks the outbox tables.

    A worker there would receive messages it can never record, spending one of each
    message's receives (the redrive policy's maxReceiveCount) per attempt. A database that
    does not answer yet is left to the worker, which waits for it as during any outage.

    Raises:
        ConfigurationError: the outbox tables (or some of them) are missing (exit code 2).
    """
    import sqlalchemy as sa

    from sqla_outbox import errors, migrations
    from sqla_outbox.config import redact_url

    engine = sa.create_engine(
        settings.sqlalchemy_url,
        poolclass=sa.pool.NullPool,
        hide_parameters=True,
        connect_args={"connect_timeout": 10, "application_name": "sqla_outbox-worker"},
    )
    try:
        with engine.connect() as connection:
            missing = migrations.missing_tables(connection)
            if missing:
                raise errors.ConfigurationError(
                    migrations.missing_tables_message(
                        redact_url(settings.database_url), missing, connection=connection
                    )
                )
    except sa.exc.OperationalError:
        return
    finally:
        engine.dispose()


def main_worker() -> None:
    """``python -m sqla_outbox.worker`` / ``sqla-outbox-worker``."""
    worker_command.main(args=sys.argv[1:], prog_name="python -m sqla_outbox.worker")
