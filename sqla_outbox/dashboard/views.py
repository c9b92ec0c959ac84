"""What the pages show, prepared from query results: filters read from URLs, a run's attempts,
the envelope without its payload, template filters. No I/O here."""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

from sqla_outbox import flow, presence
from sqla_outbox.dashboard import charts, queries
from sqla_outbox.ops.durations import format_age, parse_duration
from sqla_outbox.ops.runs import DEFAULT_LIMIT, RunCursor, RunFilter, RunRecord, TrailEntry, run_id_range
from sqla_outbox.types import QUEUE_NAMES, RUN_STATUSES

RUNS_PAGE_SIZE = DEFAULT_LIMIT
TASK_NAME_MAX_CHARS = 200


class FilterError(ValueError):
    """A filter in the URL is invalid (the page says which, with status 400)."""


# --- runs list filters ---------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class RunsQuery:
    """The Runs page's filters as given in the URL (kept as text to refill the form) and
    the :class:`~sqla_outbox.ops.runs.RunFilter` they mean."""

    values: dict[str, str]
    filters: RunFilter


def _utc(text: str, field: str) -> dt.datetime:
    """``2026-11-30T10:15`` (a datetime-local input: UTC) or an ISO time with an offset."""
    try:
        parsed = dt.datetime.fromisoformat(text)
    except ValueError:
        raise FilterError(f"{field}: {text!r} is not a date and time (2026-11-30T10:15)") from None
    return parsed if parsed.tzinfo else parsed.replace(tzinfo=dt.UTC)


def _storable(values: Mapping[str, str]) -> None:
    """Refuse filter text PostgreSQL ``text`` cannot hold (NUL; PostgreSQL "Character
    Types"), which it would answer with an error rather than with no rows.

    Raises:
        FilterError: Naming the parameter.
    """
    for name, text in values.items():
        if "\x00" in text:
            raise FilterError(f"{name}: contains a NUL character")


def runs_query(
    params: Mapping[str, str], *, limit: int = RUNS_PAGE_SIZE, queues: Sequence[str] = QUEUE_NAMES
) -> RunsQuery:
    """Read the Runs page's query parameters.

    Args:
        params: ``run`` (a run id or its first hex digits), ``task``, ``tenant`` (an id or
            ``platform``), ``queue``, ``status``, ``since`` / ``until`` (UTC), ``sort``
            (``oldest`` for oldest first), ``before`` / ``after`` (cursors).
        limit: Rows asked for (the page size plus one, to know if there is more).
        queues: The queues a ``queue`` filter may name (the four, plus declared ones).

    Raises:
        FilterError: A parameter is invalid; the message names it.
    """
    values = {
        k: params.get(k, "").strip()
        for k in ("run", "task", "tenant", "queue", "status", "since", "until", "sort")
    }
    if values["sort"] not in ("", "oldest"):
        raise FilterError(f"sort: {values['sort']!r} is not one of newest (the default), oldest")
    if values["run"]:
        try:
            run_id_range(values["run"])
        except ValueError as exc:
            raise FilterError(f"run: {exc}") from None
    tenant: int | str | None = None
    if values["tenant"]:
        if values["tenant"] == "platform":
            tenant = "platform"
        else:
            try:
                tenant = int(values["tenant"], 10)
            except ValueError:
                raise FilterError(
                    f"tenant: {values['tenant']!r} is neither a tenant id nor 'platform'"
                ) from None
            if not -(2**63) <= tenant < 2**63:  # tenant_id is a PostgreSQL bigint
                raise FilterError(f"tenant: {values['tenant']!r} is outside the range of a tenant id")
    _storable(values)
    if values["queue"] and values["queue"] not in queues:
        raise FilterError(f"queue: {values['queue']!r} is not one of {', '.join(queues)}")
    if values["status"] and values["status"] not in RUN_STATUSES:
        raise FilterError(f"status: {values['status']!r} is not one of {', '.join(RUN_STATUSES)}")
    if len(values["task"]) > TASK_NAME_MAX_CHARS:
        raise FilterError(f"task: at most {TASK_NAME_MAX_CHARS} characters")
    cursors: dict[str, RunCursor | None] = {}
    for name in ("before", "after"):
        raw = params.get(name, "").strip()
        try:
            cursors[name] = RunCursor.decode(raw) if raw else None
        except Exception:
            raise FilterError(f"{name}: not a position in the run list") from None
    if cursors["before"] is not None and cursors["after"] is not None:
        raise FilterError("give one of before and after")
    filters = RunFilter(
        run_id_prefix=values["run"] or None,
        oldest_first=values["sort"] == "oldest",
        tasks=(values["task"],) if values["task"] else (),
        statuses=(values["status"],) if values["status"] else (),
        queues=(values["queue"],) if values["queue"] else (),
        tenant_id=tenant,
        created_after=_utc(values["since"], "since") if values["since"] else None,
        created_before=_utc(values["until"], "until") if values["until"] else None,
        before=cursors["before"],
        after=cursors["after"],
        limit=limit,
    )
    return RunsQuery(values=values, filters=filters)


# --- DLQ filters ---------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class DlqQuery:
    values: dict[str, str]
    queues: tuple[str, ...]
    tasks: tuple[str, ...]
    older_than: dt.timedelta | None


def dlq_query(params: Mapping[str, str], *, queues: Sequence[str] = QUEUE_NAMES) -> DlqQuery:
    """The DLQ page's filters: ``queue`` (one of ``queues``: the four, plus declared ones),
    ``task``, ``older_than`` (``10m``, ``2h``, ``7d``), ``include_unverified=yes`` (offer
    requeues of copies nothing vouches for too) and ``messages=yes`` (read the DLQ messages
    themselves, which receives them, instead of the ledger's dead-lettered runs).

    Raises:
        FilterError: A parameter is invalid.
    """
    values = {
        k: params.get(k, "").strip()
        for k in ("queue", "task", "older_than", "include_unverified", "messages")
    }
    values["include_unverified"] = "yes" if values["include_unverified"] == "yes" else ""
    values["messages"] = "yes" if values["messages"] == "yes" else ""
    _storable(values)
    if values["queue"] and values["queue"] not in queues:
        raise FilterError(f"queue: {values['queue']!r} is not one of {', '.join(queues)}")
    if len(values["task"]) > TASK_NAME_MAX_CHARS:
        raise FilterError(f"task: at most {TASK_NAME_MAX_CHARS} characters")
    older_than = None
    if values["older_than"]:
        try:
            older_than = parse_duration(values["older_than"])
        except Exception:
            raise FilterError(
                f"older than: {values['older_than']!r} is not a duration (90s, 10m, 2h, 7d)"
            ) from None
    return DlqQuery(
        values=values,
        queues=(values["queue"],) if values["queue"] else (),
        tasks=(values["task"],) if values["task"] else (),
        older_than=older_than,
    )


# --- a run's attempts ----------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class AttemptView:
    """One handler attempt, folded from the trail rows that carry its number."""

    number: int
    started_at: dt.datetime | None
    ended_at: dt.datetime
    outcome: str
    worker_id: str | None
    receive_count: int | None
    error_type: str | None
    error_message: str | None


def attempts(trail: Sequence[TrailEntry]) -> list[AttemptView]:
    """The run's attempts, oldest first. An operator's requeue belongs to none: its trail row
    carries the number of the attempt it follows (the count it keeps), not a new outcome
    of that attempt; nor do rows without an attempt number."""
    grouped: dict[int, list[TrailEntry]] = {}
    for entry in trail:
        if isinstance(entry.detail, Mapping) and "requeued_by" in entry.detail:
            continue
        if entry.attempt is not None and entry.attempt > 0:
            grouped.setdefault(entry.attempt, []).append(entry)
    out = []
    for number, entries in sorted(grouped.items()):
        started = next((e.at for e in entries if e.status == "running"), None)
        failure = next((e for e in reversed(entries) if e.error_type or e.error_message), None)
        last = entries[-1]
        out.append(
            AttemptView(
                number=number,
                started_at=started,
                ended_at=last.at,
                outcome=last.status,
                worker_id=last.worker_id,
                receive_count=last.receive_count,
                error_type=None if failure is None else failure.error_type,
                error_message=None if failure is None else failure.error_message,
            )
        )
    return out


# --- the envelope --------------------------------------------------------------------------
ENVELOPE_FIELDS = ("v", "run_id", "task", "queue", "tenant_id", "event", "idempotency_key")


def envelope_metadata(envelope: Mapping[str, Any]) -> list[tuple[str, str]]:
    """The envelope's fields except the payload, as ``(name, text)`` (trace context included)."""
    shown = [(name, _text(envelope.get(name))) for name in ENVELOPE_FIELDS if name in envelope]
    trace = envelope.get("trace")
    if isinstance(trace, Mapping):
        shown += [(f"trace.{key}", _text(value)) for key, value in sorted(trace.items())]
    extra = sorted(set(envelope) - set(ENVELOPE_FIELDS) - {"trace", "payload"})
    shown += [(name, _text(envelope[name])) for name in extra]
    return shown


def payload_text(envelope: Mapping[str, Any]) -> str | None:
    """The payload, pretty-printed when it is JSON text (the envelope keeps it as text)."""
    payload = envelope.get("payload")
    if payload is None:
        return None
    if isinstance(payload, str):
        try:
            return json.dumps(json.loads(payload), indent=2, ensure_ascii=False, sort_keys=True)
        except ValueError:
            return payload
    return json.dumps(payload, indent=2, ensure_ascii=False, sort_keys=True)


def _text(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, str):
        return value
    return json.dumps(value, ensure_ascii=False)


# --- overview charts -----------------------------------------------------------------------
def activity_charts(activity: queries.Activity) -> tuple[charts.Chart, charts.Chart]:
    """The throughput chart (dispatched, finished, failed per minute) and the latency chart
    (p50, p95, p99 commit → finish of the runs that succeeded), over the whole minutes only:
    the current minute is left out until it is over (drawn as it fills, it read as a
    collapse early in every minute). The table beside them still shows it."""
    settled = activity.minutes[:-1] if len(activity.minutes) > 1 else activity.minutes
    minutes = [m.minute for m in settled]
    throughput = charts.counts_chart(
        "Runs per minute",
        minutes,
        [
            ("dispatched", "s-dispatched", [m.dispatched for m in settled]),
            ("finished", "s-finished", [m.finished for m in settled]),
            ("failed", "s-failed", [m.failed for m in settled]),
        ],
    )
    names = [f"p{round(p * 100)}" for p in queries.LATENCY_PERCENTILES]
    latency = charts.latency_chart(
        "Commit → finish latency (succeeded runs)",
        minutes,
        [
            (
                name,
                f"s-{name}",
                [m.latency_seconds[i] if m.latency_seconds else None for m in settled],
            )
            for i, name in enumerate(names)
        ],
    )
    return throughput, latency


# --- template filters ----------------------------------------------------------------------
def when(value: dt.datetime | None) -> str:
    """``2026-11-30 13:45:12Z`` (UTC, to the second); ``-`` for None."""
    if value is None:
        return "-"
    return value.astimezone(dt.UTC).strftime("%Y-%m-%d %H:%M:%SZ")


def age(seconds: float | None) -> str:
    return format_age(seconds)


def count(value: int | None) -> str:
    return "-" if value is None else f"{value:,}"


def pretty_json(value: Any) -> str:
    if value is None:
        return ""
    return json.dumps(value, indent=2, ensure_ascii=False, sort_keys=True, default=str)


def short_id(value: uuid.UUID | str | None) -> str:
    return "-" if value is None else str(value)[:8]


HIDDEN_ANSWER = "(hidden: a receiver's answer is shown where payloads are)"


def without_answers(trail: Sequence[TrailEntry]) -> list[TrailEntry]:
    """``trail`` with what webhook receivers answered (content type and body excerpt in
    ``detail.webhook.response``) replaced by a note: a receiver is written by a tenant and
    may be an internal service, so its answer is shown only to whom payloads are shown."""
    out = []
    for step in trail:
        detail = step.detail
        webhook = detail.get("webhook") if isinstance(detail, dict) else None
        response = webhook.get("response") if isinstance(webhook, dict) else None
        if not isinstance(response, dict) or not ({"body", "content_type"} & response.keys()):
            out.append(step)
            continue
        shown = {k: v for k, v in response.items() if k not in ("body", "content_type", "body_truncated")}
        shown["body"] = HIDDEN_ANSWER
        assert isinstance(detail, dict) and isinstance(webhook, dict)
        out.append(dataclasses.replace(step, detail={**detail, "webhook": {**webhook, "response": shown}}))
    return out


# --- why a run waits -------------------------------------------------------------------------
def waiting_reasons(
    run: RunRecord,
    outbox: queries.OutboxState | None,
    pauses: flow.Pauses,
    coverage: presence.Coverage,
    now: dt.datetime,
    *,
    flow_state: Any = None,
    tenant_rate: tuple[int, int] | None = None,
) -> list[str]:
    """Why an unfinished run has not run yet, as sentences for its page (empty for a run
    that is running or finished).

    Args:
        run: The run. outbox: Its outbox row, if it still has one.
        pauses: The pauses in force (:func:`sqla_outbox.flow.current`).
        coverage: What live workers implement (:class:`sqla_outbox.presence.Coverage`).
        now: The database's clock (UTC).
        flow_state: The per-task limits and breakers as Valkey holds them
            (:func:`sqla_outbox.worker.gate.snapshot`); None when not read.
        tenant_rate: ``(limit per minute, rows sent in the last minute)`` of the run's
            tenant when a tenant rate limit is in force; None otherwise.
    """
    if run.status not in ("queued", "retrying"):
        return []
    reasons = []
    paused = pauses.blocking(run.task, run.tenant_id, run.queue)
    if paused is not None:
        reasons.append(f"paused: {paused} (resume it on the Controls page)")
    if tenant_rate is not None and tenant_rate[1] >= tenant_rate[0]:
        reasons.append(
            f"tenant {run.tenant_id}'s rate limit is used up: {tenant_rate[1]} of {tenant_rate[0]} "
            "sent in the last minute"
        )
    reasons += _limit_reasons(run.task, flow_state)
    if not coverage.serves(run.task, run.queue):
        reasons.append(
            f"no live worker implements {run.task} on the {run.queue} queue: the relay holds it "
            "until one starts"
        )
    if run.status == "retrying" and run.available_at > now:
        reasons.append(f"retrying: next try at {when(run.available_at)}")
    if outbox is not None and outbox.sent_at is None:
        if outbox.available_at > now:
            reasons.append(
                f"in the outbox until {when(outbox.available_at)} "
                "(a delay, a retry, or held back by flow control)"
            )
        elif not reasons:
            reasons.append("in the outbox, due: the relay sends it on its next pass")
    elif outbox is not None and not reasons:
        reasons.append(f"sent to SQS at {when(outbox.sent_at)}: waiting for a worker to receive it")
    return reasons


def _limit_reasons(task: str, flow_state: Any) -> list[str]:
    """The task's own limits that hold it now: an open circuit breaker, a full concurrency
    cap, a spent rate limit (``flow_state``: :class:`sqla_outbox.worker.gate.FlowControlState`)."""
    if flow_state is None or getattr(flow_state, "error", None):
        return []
    reasons = []
    for limits in flow_state.tasks:
        if limits.task != task:
            continue
        if limits.concurrency is not None and limits.running >= limits.concurrency:
            reasons.append(
                f"the task's concurrency cap is full: {limits.running} of {limits.concurrency} running"
            )
        if limits.rate_count is not None and limits.admitted_in_window >= limits.rate_count:
            reasons.append(
                f"the task's rate limit is used up: {limits.admitted_in_window} of {limits.rate_count} "
                f"in {limits.period_seconds} s"
            )
        for breaker in flow_state.breakers:
            if breaker.key == limits.breaker and breaker.state != "closed":
                reasons.append(
                    f"circuit breaker {breaker.key} is {breaker.state.replace('_', '-')}"
                    + (f" for {format_age(breaker.open_for_seconds)} more" if breaker.state == "open" else "")
                )
    return reasons
