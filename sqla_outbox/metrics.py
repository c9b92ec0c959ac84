"""Prometheus metrics of the relay, the worker and the application-side wake.

All metrics live in ``prometheus_client``'s default registry and carry the
``sqla_outbox_`` prefix. Relay and worker serve them on ``/metrics`` of their HTTP probe
(``SQLA_OUTBOX_HEALTH_PORT``), each only its own (:func:`served`: a worker shows no relay
gauges unless it runs the relay too) beside whatever else the default registry holds (the
handlers' own metrics, the process collectors); an application process can expose the
wake counters with its own ``prometheus_client`` endpoint. The alerts worth setting are in
``docs/runbook.md``.
"""

from __future__ import annotations

from collections.abc import Collection, Iterator

from prometheus_client import REGISTRY, Counter, Gauge, Histogram
from prometheus_client.metrics_core import Metric

# --- application side ------------------------------------------------------------------
WAKES = Counter(
    "sqla_outbox_wakes",
    "Wake signals after commits, by outcome (sent, failed, skipped while Valkey is down).",
    ["outcome"],
)

# --- relay -------------------------------------------------------------------------------
RELAY_SENT = Counter(
    "sqla_outbox_relay_messages_sent", "Outbox rows SQS accepted and the relay marked sent.", ["queue"]
)
RELAY_FAILED = Counter(
    "sqla_outbox_relay_messages_failed",
    "Outbox rows SQS did not accept (they stay pending with backoff).",
    ["queue", "error_code"],
)
RELAY_PARKED = Counter(
    "sqla_outbox_relay_messages_parked",
    "Outbox rows SQS refused for good: parked, their runs failed (`python -m sqla_outbox outbox unpark`).",
    ["queue", "error_code"],
)
RELAY_BATCH_SIZE = Histogram(
    "sqla_outbox_relay_batch_size",
    "Entries per SendMessageBatch call.",
    buckets=(1, 2, 3, 4, 5, 6, 7, 8, 9, 10),
)
RELAY_PASS_SECONDS = Histogram(
    "sqla_outbox_relay_pass_seconds",
    "Duration of one claim → send → mark pass.",
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
)
RELAY_PENDING = Gauge("sqla_outbox_relay_pending_rows", "Unsent outbox rows, due or not.", ["table", "queue"])
RELAY_OLDEST_PENDING_AGE = Gauge(
    "sqla_outbox_relay_oldest_pending_age_seconds",
    "Age of the oldest due, unsent outbox row (0 when none is due): the relay's lag.",
    ["table", "queue"],
)
RELAY_LEADER = Gauge(
    "sqla_outbox_relay_leader", "1 while this relay owns at least one outbox partition and sends."
)
RELAY_PARTITIONS_OWNED = Gauge(
    "sqla_outbox_relay_partitions_owned", "Outbox partitions this relay owns (relay_partitions)."
)
RELAY_PARTITIONS_DISAGREE = Gauge(
    "sqla_outbox_relay_partitions_disagree",
    "1 while relays with another relay_partitions run on this relay's database.",
)
RELAY_PASSES = Counter(
    "sqla_outbox_relay_passes",
    "Claim passes (each one database transaction), by what started them: wake or timer "
    "(sweep, a delayed run's due time, a schedule slot, a full batch), and whether they claimed rows.",
    ["trigger", "claimed"],
)
WAKE_LISTENER_ERRORS = Counter(
    "sqla_outbox_relay_wake_errors",
    "Failed BLPOPs of the relay's wake listener: outage (Valkey unreachable) or unusable "
    "(the wake key is not a list, is refused, or held an oversized element).",
    ["kind"],
)
RELAY_LISTEN_ALIVE = Gauge(
    "sqla_outbox_relay_listen_alive",
    "1 while the relay's LISTEN session (the PostgreSQL wake) returned its last probe in time; "
    "0 while it reconnects, missed a probe, or cannot hold a LISTEN (a transaction-mode pooler). "
    "Only exported while the relay listens.",
    ["channel"],
)
RELAY_LISTEN_PROBE_AGE = Gauge(
    "sqla_outbox_relay_listen_probe_age_seconds",
    "Seconds since a probe of the relay's LISTEN session last came back (it grows while the "
    "session is dead); only exported while the relay listens, once a probe came back.",
    ["channel"],
)
RELAY_LISTEN_RECONNECTS = Counter(
    "sqla_outbox_relay_listen_reconnects",
    "Times the relay's wake listener dropped its LISTEN session and connected again, by reason: "
    "lost (the connection failed) or stalled (a probe did not come back in time).",
    ["reason"],
)

# --- worker ------------------------------------------------------------------------------
RUNS_FINISHED = Counter(
    "sqla_outbox_worker_runs_finished",
    "Attempts finished, by task and resulting status (succeeded, retrying, failed, queued, cancelled).",
    ["task", "status"],
)
HANDLER_SECONDS = Histogram(
    "sqla_outbox_worker_handler_seconds",
    "Handler duration per attempt.",
    ["task"],
    buckets=(0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300, 900),
)
HEARTBEAT_FAILURES = Counter(
    "sqla_outbox_worker_heartbeat_failures",
    "Visibility extensions or lease renewals that failed.",
    ["queue"],
)
RUNS_RESCUED = Counter(
    "sqla_outbox_runs_rescued",
    "Unfinished runs without a live copy that the relay's rescuer sent again (docs/lifecycle.md).",
    ["queue", "reason"],
)
VISIBILITY_CAP_REACHED = Counter(
    "sqla_outbox_worker_visibility_cap_reached",
    "Messages whose handler was still running as SQS's 12-hour visibility ceiling came near.",
    ["queue"],
)
DLQ_SENDS = Counter(
    "sqla_outbox_worker_dlq_sends", "Messages the worker sent to a dead-letter queue.", ["queue", "reason"]
)
IN_FLIGHT = Gauge("sqla_outbox_worker_in_flight", "Messages being handled right now.")

# --- holding work back (rolling deploys) ------------------------------------------------
RELAY_HELD = Counter(
    "sqla_outbox_relay_held_total",
    "Due outbox rows the relay kept pending because no live worker implements their task.",
    ["task"],
)
RELAY_PAUSED = Counter(
    "sqla_outbox_relay_paused_total",
    "Due outbox rows the relay kept pending because their task, tenant or queue is paused.",
    ["scope"],
)
TENANT_THROTTLED = Gauge(
    "sqla_outbox_tenant_throttled",
    "1 while a tenant has due runs waiting in the outbox for its rate limit (label removed after).",
    ["tenant"],
)
TENANT_THROTTLED_WAIT = Gauge(
    "sqla_outbox_tenant_throttled_wait_seconds",
    "How long the oldest due run of a throttled tenant has waited in the outbox.",
    ["tenant"],
)
TENANT_THROTTLED_PASSES = Counter(
    "sqla_outbox_tenant_throttled_passes_total",
    "Relay passes in which a tenant had due runs but no rate-limit allowance left.",
)
RELAY_DEPTH_BOUND = Counter(
    "sqla_outbox_relay_depth_bound_total",
    "Relay passes that left due rows in the outbox because SQS held relay_queue_depth messages.",
    ["queue"],
)
RUNS_DEFERRED = Counter(
    "sqla_outbox_runs_deferred_total",
    "Runs a worker handed back to the outbox instead of running them (no attempt spent).",
    ["task", "reason"],
)

# --- flow control (per-task limits and circuit breakers; sqla_outbox.worker.gate) ----------
GATE_REFUSALS = Counter(
    "sqla_outbox_worker_throttled_total",
    "Runs the admission gate held back (then deferred through the outbox), by task and reason "
    "(rate-limit, concurrency, breaker-open, breaker-probing, tenant-share).",
    ["task", "reason"],
)
SLOTS_HELD = Gauge(
    "sqla_outbox_worker_limited_runs",
    "Runs of tasks with flow control that this worker admitted and is running now.",
    ["task"],
)
BREAKER_STATE = Gauge(
    "sqla_outbox_breaker_state",
    "Circuit breaker state as this worker last saw it: 0 closed, 1 half-open, 2 open.",
    ["breaker"],
)
BREAKER_TRANSITIONS = Counter(
    "sqla_outbox_breaker_transitions_total",
    "Circuit breaker transitions this worker made (from, to: closed, half_open, open).",
    ["breaker", "from_state", "to_state"],
)
GATE_VALKEY_ERRORS = Counter(
    "sqla_outbox_worker_limits_valkey_errors_total",
    "Flow-control calls to Valkey that failed (limits then hold per process).",
)


# --- which process serves which ---------------------------------------------------------
_RELAY_METRICS = (
    RELAY_SENT,
    RELAY_FAILED,
    RELAY_PARKED,
    RELAY_BATCH_SIZE,
    RELAY_PASS_SECONDS,
    RELAY_PENDING,
    RELAY_OLDEST_PENDING_AGE,
    RELAY_LEADER,
    RELAY_PARTITIONS_OWNED,
    RELAY_PARTITIONS_DISAGREE,
    RELAY_PASSES,
    WAKE_LISTENER_ERRORS,
    RELAY_LISTEN_ALIVE,
    RELAY_LISTEN_PROBE_AGE,
    RELAY_LISTEN_RECONNECTS,
    RELAY_HELD,
    RELAY_PAUSED,
    TENANT_THROTTLED,
    TENANT_THROTTLED_WAIT,
    TENANT_THROTTLED_PASSES,
    RELAY_DEPTH_BOUND,
    RUNS_RESCUED,
)
_WORKER_METRICS = (
    RUNS_FINISHED,
    HANDLER_SECONDS,
    HEARTBEAT_FAILURES,
    VISIBILITY_CAP_REACHED,
    DLQ_SENDS,
    IN_FLIGHT,
    RUNS_DEFERRED,
    GATE_REFUSALS,
    SLOTS_HELD,
    BREAKER_STATE,
    BREAKER_TRANSITIONS,
    GATE_VALKEY_ERRORS,
)
_FAMILIES = {
    "relay": frozenset(family.name for metric in _RELAY_METRICS for family in metric.describe()),
    "worker": frozenset(family.name for metric in _WORKER_METRICS for family in metric.describe()),
}
ROLES = tuple(_FAMILIES)
"""The roles a process can serve metrics for: ``relay`` and ``worker``."""


class _Served:
    """The default registry without the families of the roles a process does not play."""

    def __init__(self, hidden: frozenset[str]) -> None:
        self._hidden = hidden

    def collect(self) -> Iterator[Metric]:
        for family in REGISTRY.collect():
            if family.name not in self._hidden:
                yield family


def served(roles: Collection[str]) -> _Served:
    """What a process playing ``roles`` serves on ``/metrics``: pass the result to
    ``prometheus_client.generate_latest``.

    Args:
        roles: Some of :data:`ROLES` (a worker with ``worker_run_relay`` plays both).

    Raises:
        ValueError: A role that is not one of :data:`ROLES`.
    """
    unknown = set(roles) - set(ROLES)
    if unknown:
        raise ValueError(f"unknown metrics roles {sorted(unknown)}: choose from {list(ROLES)}")
    hidden = frozenset().union(*(names for role, names in _FAMILIES.items() if role not in roles))
    return _Served(hidden)
