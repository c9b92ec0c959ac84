"""``python -m sqla_outbox status``: pending rows, runs by status, stale runs, SQS depths."""

from __future__ import annotations

import datetime as dt
from typing import Any

import click

from sqla_outbox.cli.options import (
    common_options,
    duration,
    handle_errors,
    json_option,
    load_settings,
    outbox_connection,
    setup_logging,
    sqs_client,
)
from sqla_outbox.cli.terminal import console, jsonable, print_json, styled, table, text, when
from sqla_outbox.ops.durations import format_age


@click.command("status")
@common_options
@click.option(
    "--stale-after",
    callback=duration,
    metavar="DURATION",
    default="15m",
    show_default=True,
    help="Flag running runs whose lease expired longer ago than this.",
)
@click.option(
    "--unreceived-after",
    callback=duration,
    metavar="DURATION",
    default="1d",
    show_default=True,
    help="Flag queued runs whose message has waited in SQS longer than this (SQS drops messages "
    "past the queue's retention; `outbox resend` sends them again).",
)
@click.option(
    "--sqs/--no-sqs", "with_sqs", default=True, show_default=True, help="Also read the SQS queue depths."
)
@json_option
def status_command(
    verbose: int,
    log_format: str,
    traceback: bool,
    stale_after: dt.timedelta,
    unreceived_after: dt.timedelta,
    with_sqs: bool,
    as_json: bool,
    **options: Any,
) -> None:
    """Pending and parked outbox rows, runs by status (stale running and unreceived runs
    flagged), queue and DLQ depths."""
    setup_logging(verbose, log_format)
    with handle_errors(traceback):
        from sqla_outbox.catalog import Catalog
        from sqla_outbox.ops import status

        settings = load_settings(**options)
        registry = Catalog.queue_registry_at(settings.catalog_path)
        with outbox_connection(settings) as connection:
            report = status.collect(
                connection,
                settings,
                client=sqs_client(settings) if with_sqs else None,
                stale_after_seconds=stale_after.total_seconds(),
                unreceived_after=unreceived_after,
                queues=registry.names,
                registry=registry,
            )
        if as_json:
            print_json(jsonable(report))
            return
        _render_status(report)


def _render_status(report: Any) -> None:
    out = console()
    out.print(f"database time {when(report.database_time)} UTC")
    if report.pending:
        shown = table(
            "Pending outbox rows",
            ("table", "queue", "pending", "due", "oldest pending", "oldest due (lag)", "max send attempts"),
        )
        for p in report.pending:
            lag = format_age(p.oldest_due_age_seconds)
            shown.add_row(
                p.table,
                p.queue,
                str(p.pending),
                str(p.due),
                format_age(p.oldest_pending_age_seconds),
                lag,
                str(p.max_attempts),
            )
        out.print(shown)
    else:
        out.print("Pending outbox rows: none")
    runs = table("Runs by status", ("status", "runs"))
    for name, count in report.runs_by_status.items():
        runs.add_row(name, str(count))
    stale = f"running, lease expired > {format_age(report.stale_after_seconds)}"
    runs.add_row(
        styled(stale, "red") if report.stale_running_count else stale, str(report.stale_running_count)
    )
    parked = "failed by a send refusal (parked rows)"
    runs.add_row(styled(parked, "red") if report.parked_count else parked, str(report.parked_count))
    late = f"queued, unreceived > {format_age(report.unreceived_after_seconds)}"
    runs.add_row(styled(late, "red") if report.unreceived_count else late, str(report.unreceived_count))
    lost = "unfinished, no live copy past its queue's window"
    runs.add_row(
        styled(lost, "red") if report.without_live_copy_count else lost, str(report.without_live_copy_count)
    )
    runs.add_row("sent again by the rescuer (last 24 h)", str(report.rescued_last_day))
    out.print(runs)
    if report.without_live_copy:
        shown = table(
            "Unfinished runs without a live copy (the relay's rescuer sends them again)",
            ("run_id", "task", "queue", "tenant", "status", "sent (UTC)", "silent"),
        )
        for c in report.without_live_copy:
            shown.add_row(
                str(c.run_id), c.task, c.queue, text(c.tenant_id), c.status, when(c.sent_at),
                format_age(c.silent_seconds),
            )  # fmt: skip
        out.print(shown)
    if report.stale_running:
        shown = table(
            "Stale running runs", ("run_id", "task", "queue", "tenant", "lease owner", "lease expired")
        )
        for r in report.stale_running:
            shown.add_row(
                r.run_id,
                r.task,
                r.queue,
                text(r.tenant_id),
                text(r.lease_owner),
                format_age(r.lease_expired_seconds_ago) + " ago",
            )
        out.print(shown)
    _render_relays(out, report)
    _render_workers(out, report)
    _render_flow_control(out, report.flow_control)
    _render_flow(out, report)
    if report.parked:
        shown = table(
            f"Parked outbox rows: SQS refuses them ({report.parked_count}; `outbox unpark` after a fix)",
            ("run_id", "task", "queue", "run status", "parked at (UTC)", "SQS error"),
        )
        for p in report.parked:
            shown.add_row(str(p.run_id), p.task, p.queue, p.status, when(p.parked_at), text(p.last_error))
        out.print(shown)
    if report.unreceived:
        shown = table(
            "Unreceived runs: queued, message waiting in SQS > "
            f"{format_age(report.unreceived_after_seconds)} "
            f"({report.unreceived_count}; `outbox resend` sends them again)",
            ("run_id", "task", "queue", "tenant", "sent (UTC)", "waiting"),
        )
        for u in report.unreceived:
            shown.add_row(
                str(u.run_id),
                u.task,
                u.queue,
                text(u.tenant_id),
                when(u.sent_at),
                format_age(u.waiting_seconds),
            )
        out.print(shown)
    if report.queues is not None:
        shown = table("SQS queues", ("queue", "SQS name", "kind", "visible", "in flight", "delayed"))
        for q in report.queues:
            kind = "DLQ" if q.dead_letter else "source"
            if q.error:
                shown.add_row(q.queue, q.name, kind, styled(q.error, "red"), "", "")
                continue
            visible: Any = str(q.visible)
            if q.dead_letter and q.visible:
                visible = styled(visible, "red")
            shown.add_row(q.queue, q.name, kind, visible, str(q.not_visible), str(q.delayed))
        out.print(shown)


def _render_flow(out: Any, report: Any) -> None:
    """Paused targets, and tenants whose runs wait for their rate limit."""
    if report.pauses:
        shown = table(
            "Paused (runs kept pending in the outbox)", ("scope", "target", "since (UTC)", "by", "reason")
        )
        for p in report.pauses:
            shown.add_row(
                p.scope, styled(p.target, "yellow"), when(p.paused_at), text(p.paused_by), text(p.reason)
            )
        out.print(shown)
    if report.throttled:
        shown = table(
            "Throttled tenants (due runs wait in the outbox for the rate limit)",
            ("tenant", "limit / min", "sent last minute", "due runs", "oldest waiting"),
        )
        for t in report.throttled:
            shown.add_row(
                styled(str(t.tenant_id), "yellow"),
                str(t.limit_per_minute),
                str(t.sent_last_minute),
                str(t.due),
                format_age(t.waited_seconds),
            )
        out.print(shown)


def _render_relays(out: Any, report: Any) -> None:
    """The running relays: the active one, or every relay and the partitions it owns."""
    if not report.relays:
        out.print(styled("Relays: none active (nothing is sent to SQS)", "red"))
        return
    values = sorted({r.relay_partitions for r in report.relays})
    owning = sum(1 for r in report.relays if r.partitions)
    if len(values) > 1:
        title = styled(
            f"Relays disagree on relay_partitions ({', '.join(map(str, values))}): {owning} active, "
            "the others wait; set one value",
            "red",
        )
    elif values == [1]:
        title = "Relay (one active per database; the others stand by)"
    else:
        title = f"Relays ({owning} active on {values[0]} partitions)"
    shown = table(
        title,
        ("relay", "backend pid", "client", "connected since", "relay_partitions", "partitions", "due rows"),
    )
    for r in report.relays:
        if r.relay_partitions == 1:
            owned = "all" if r.partitions else "none (standby)"
        else:
            owned = ",".join(str(p) for p in r.partitions) if r.partitions else "none (waiting)"
        shown.add_row(
            text(r.name),
            str(r.pid),
            text(r.client),
            when(r.since) if r.since else "-",
            str(r.relay_partitions),
            owned,
            _due(r),
        )
    out.print(shown)


def _due(relay: Any) -> str:
    """``due rows`` of a relay: how many, and since when the oldest has been due."""
    if relay.due is None or not relay.partitions:
        return "-"
    if not relay.due:
        return "0"
    return f"{relay.due} (oldest {format_age(relay.oldest_due_age_seconds or 0.0)})"


def _render_workers(out: Any, report: Any) -> None:
    """Live workers, and the tasks whose due runs no live worker implements."""
    if report.workers:
        shown = table("Workers", ("worker", "queues", "tasks", "heartbeat"))
        for w in report.workers:
            shown.add_row(
                w.worker_id,
                ",".join(w.queues),
                str(len(w.tasks)),
                format_age(w.heartbeat_age_seconds) + " ago",
            )
        out.print(shown)
    else:
        out.print("Workers: none recorded (runs are sent whatever their task)")
    if report.waiting_for_a_worker:
        shown = table(
            "Waiting for a worker that implements the task (kept pending in the outbox)",
            ("task", "queue", "due runs", "waiting for"),
        )
        for w in report.waiting_for_a_worker:
            shown.add_row(styled(w.task, "red"), w.queue, str(w.pending), format_age(w.waited_seconds))
        out.print(shown)


BREAKER_STYLE = {"open": "red", "half_open": "yellow"}


def _render_flow_control(out: Any, flow: Any) -> None:
    """Per-task limits in use and circuit-breaker states (read from Valkey)."""
    if flow is None:
        return
    if flow.error:
        out.print(styled(f"Flow control: {flow.error}", "red"))
        return
    if flow.tasks:
        shown = table(
            "Per-task limits (all workers)",
            ("task", "running / concurrency", "admitted / rate limit", "breaker"),
        )
        for t in flow.tasks:
            running = f"{t.running} / {t.concurrency}" if t.concurrency else "-"
            if t.concurrency and t.running >= t.concurrency:
                running = styled(running, "yellow")
            rate = (
                f"{t.admitted_in_window} / {t.rate_count} per {format_age(t.period_seconds)}"
                if t.rate_count
                else "-"
            )
            shown.add_row(t.task, running, rate, text(t.breaker or "-"))
        out.print(shown)
    if flow.breakers:
        shown = table(
            "Circuit breakers",
            ("breaker", "state", "failures in a row", "probe in", "probes", "since", "settings"),
        )
        for b in flow.breakers:
            state = b.state.replace("_", "-")
            policy = b.settings
            settings = (
                f"{policy.failures} failure{'s' if policy.failures != 1 else ''} → open "
                f"{format_age(policy.open_seconds)}, "
                f"{policy.successes} success{'es' if policy.successes != 1 else ''} close"
            )
            if policy.max_outage_seconds:
                settings += f"; outages up to {format_age(policy.max_outage_seconds)} spend no tries"
            if b.outage_seconds is not None:
                settings += f" (outage for {format_age(b.outage_seconds)})"
            shown.add_row(
                b.key,
                styled(state, BREAKER_STYLE[b.state]) if b.state in BREAKER_STYLE else state,
                str(b.failures),
                format_age(b.open_for_seconds) if b.state == "open" else "-",
                str(b.probes),
                format_age(b.since_seconds) + " ago" if b.since_seconds is not None else "-",
                settings,
            )
        out.print(shown)
