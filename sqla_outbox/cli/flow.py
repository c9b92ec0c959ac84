"""``python -m sqla_outbox pause|resume`` and ``flow list|tenant|tenant-clear``: flow control.

Pauses and tenant settings live in PostgreSQL (:mod:`sqla_outbox.flow`); these commands
write them in one transaction each and, on resume, wake the relay (the ``NOTIFY`` in the
transaction, and a Valkey wake when the Valkey wake is in force) so released runs leave
at once. Who did it is recorded as ``cli:<OS user>`` unless ``--by`` says otherwise.
"""

from __future__ import annotations

import getpass
from collections.abc import Callable
from typing import Any

import click

from sqla_outbox.cli.options import (
    common_options,
    handle_errors,
    json_option,
    load_settings,
    outbox_connection,
    outbox_engine,
    refuse_unknown_names,
    setup_logging,
)
from sqla_outbox.cli.terminal import console, jsonable, print_json, styled, table, text, when


def _target_options(func: Callable[..., Any]) -> Callable[..., Any]:
    for decorator in reversed(
        [
            click.option("--task", help="A task name."),
            click.option("--tenant", "tenant_id", type=int, help="A tenant id."),
            click.option("--queue", help="A queue (default or declared in the catalog)."),
            click.option("--by", help="Who does it (recorded; default cli:<OS user>)."),
        ]
    ):
        func = decorator(func)
    return func


def _who(by: str | None) -> str:
    if by:
        return by
    try:
        return f"cli:{getpass.getuser()}"
    except (KeyError, OSError):  # no user name in a bare container
        return "cli"


@click.command("pause")
@common_options
@_target_options
@click.option("--reason", help="Why (shown by `status`, `flow list` and the dashboard).")
@json_option
def pause_command(
    verbose: int,
    log_format: str,
    traceback: bool,
    task: str | None,
    tenant_id: int | None,
    queue: str | None,
    by: str | None,
    reason: str | None,
    as_json: bool,
    **options: Any,
) -> None:
    """Pause one task, tenant or queue: its runs stay pending in the outbox (no attempt
    spent); messages already in SQS are deferred back by the workers without running."""
    setup_logging(verbose, log_format)
    with handle_errors(traceback):
        from sqla_outbox import flow

        what = flow.target(task=task, tenant_id=tenant_id, queue=queue)
        settings = load_settings(**options)
        refuse_unknown_names(settings, task=task, queue=queue)
        with outbox_engine(settings) as engine, engine.begin() as connection:
            new = flow.pause(
                connection, task=task, tenant_id=tenant_id, queue=queue, by=_who(by), reason=reason
            )
        if as_json:
            print_json(
                {"scope": what.scope, "target": what.target, "paused": True, "already_paused": not new}
            )
            return
        console().print(f"paused {what}" + ("" if new else " (it was paused already)"))


@click.command("resume")
@common_options
@_target_options
@json_option
def resume_command(
    verbose: int,
    log_format: str,
    traceback: bool,
    task: str | None,
    tenant_id: int | None,
    queue: str | None,
    by: str | None,
    as_json: bool,
    **options: Any,
) -> None:
    """Resume one task, tenant or queue: its held runs become due now and the relay is woken."""
    setup_logging(verbose, log_format)
    with handle_errors(traceback):
        from sqla_outbox import flow
        from sqla_outbox.wakeup import Waker

        what = flow.target(task=task, tenant_id=tenant_id, queue=queue)
        settings = load_settings(**options)
        with outbox_engine(settings) as engine, engine.begin() as connection:
            was_paused, released = flow.resume(connection, task=task, tenant_id=tenant_id, queue=queue)
        waker = Waker(settings)
        try:
            waker.wake()
            waker.drain(2.0)
        finally:
            waker.close()
        if as_json:
            print_json(
                {
                    "scope": what.scope,
                    "target": what.target,
                    "was_paused": was_paused,
                    "released": released,
                    "by": _who(by),
                }
            )
            return
        if was_paused:
            console().print(f"resumed {what}: {released} held run(s) released")
        else:
            console().print(f"{what} was not paused ({released} held run(s) released)")


@click.group("flow")
def flow_group() -> None:
    """Flow control: pauses, tenant weights and rate limits, throttled tenants."""


@flow_group.command("list")
@common_options
@json_option
def list_command(verbose: int, log_format: str, traceback: bool, as_json: bool, **options: Any) -> None:
    """Paused targets, tenant settings and the tenants waiting for their rate limit."""
    setup_logging(verbose, log_format)
    with handle_errors(traceback):
        from sqla_outbox import flow

        settings = load_settings(**options)
        with outbox_connection(settings) as connection:
            pauses = flow.list_pauses(connection)
            tenants = flow.tenants(connection)
            throttled = flow.throttled_tenants(connection, settings.tenant_rate_limit_per_minute)
        if as_json:
            print_json(
                jsonable(
                    {
                        "fairness": settings.relay_fairness,
                        "default_rate_limit_per_minute": settings.tenant_rate_limit_per_minute,
                        "pauses": pauses,
                        "tenants": list(tenants.values()),
                        "throttled": throttled,
                    }
                )
            )
            return
        out = console()
        limit = settings.tenant_rate_limit_per_minute
        out.print(
            f"fairness {'on' if settings.relay_fairness else 'off'}; "
            f"default tenant rate limit: {f'{limit}/min' if limit else 'none'}"
        )
        shown = table(f"Paused ({len(pauses)})", ("scope", "target", "since (UTC)", "by", "reason"))
        for p in pauses:
            shown.add_row(
                p.scope, styled(p.target, "yellow"), when(p.paused_at), text(p.paused_by), text(p.reason)
            )
        out.print(shown)
        shown = table(f"Tenant settings ({len(tenants)})", ("tenant", "weight", "rate limit / min", "set by"))
        for t in tenants.values():
            rate = "default" if t.rate_limit_per_minute is None else (str(t.rate_limit_per_minute) or "0")
            shown.add_row(
                str(t.tenant_id), str(t.weight), "unlimited" if rate == "0" else rate, text(t.updated_by)
            )
        out.print(shown)
        shown = table(
            f"Throttled tenants ({len(throttled)})",
            ("tenant", "limit / min", "sent last minute", "due runs", "oldest waiting (s)"),
        )
        for th in throttled:
            shown.add_row(
                str(th.tenant_id),
                str(th.limit_per_minute),
                str(th.sent_last_minute),
                str(th.due),
                f"{th.waited_seconds:.1f}",
            )
        out.print(shown)


@flow_group.command("tenant")
@common_options
@click.argument("tenant_id", type=int)
@click.option("--weight", type=click.IntRange(1, 1000), help="Share of each relay pass (1..1000, default 1).")
@click.option(
    "--rate-limit",
    "rate_limit",
    type=click.IntRange(min=0),
    help="Runs sent per sliding minute (0: unlimited).",
)
@click.option("--default-rate-limit", is_flag=True, help="Back to the global default rate limit.")
@click.option("--by", help="Who does it (recorded; default cli:<OS user>).")
@json_option
def tenant_command(
    verbose: int,
    log_format: str,
    traceback: bool,
    tenant_id: int,
    weight: int | None,
    rate_limit: int | None,
    default_rate_limit: bool,
    by: str | None,
    as_json: bool,
    **options: Any,
) -> None:
    """Set a tenant's weight and/or rate-limit override."""
    setup_logging(verbose, log_format)
    with handle_errors(traceback):
        from sqla_outbox import errors, flow

        if rate_limit is not None and default_rate_limit:
            raise errors.InvalidFlowControl("give --rate-limit or --default-rate-limit, not both")
        limit: dict[str, Any] = {}
        if rate_limit is not None:
            limit["rate_limit_per_minute"] = rate_limit
        elif default_rate_limit:
            limit["rate_limit_per_minute"] = None
        settings = load_settings(**options)
        with outbox_engine(settings) as engine, engine.begin() as connection:
            saved = flow.set_tenant(connection, tenant_id, weight=weight, by=_who(by), **limit)
        if as_json:
            print_json(jsonable(saved))
            return
        rate = saved.rate_limit_per_minute
        shown = "default" if rate is None else ("unlimited" if rate == 0 else f"{rate}/min")
        console().print(f"tenant {saved.tenant_id}: weight {saved.weight}, rate limit {shown}")


@flow_group.command("tenant-clear")
@common_options
@click.argument("tenant_id", type=int)
@json_option
def tenant_clear_command(
    verbose: int, log_format: str, traceback: bool, tenant_id: int, as_json: bool, **options: Any
) -> None:
    """Forget a tenant's settings (weight 1, the global default rate limit)."""
    setup_logging(verbose, log_format)
    with handle_errors(traceback):
        from sqla_outbox import flow

        settings = load_settings(**options)
        with outbox_engine(settings) as engine, engine.begin() as connection:
            cleared = flow.clear_tenant(connection, tenant_id)
        if as_json:
            print_json({"tenant_id": tenant_id, "cleared": cleared})
            return
        console().print(f"tenant {tenant_id}: " + ("settings cleared" if cleared else "had no settings"))
