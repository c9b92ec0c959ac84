"""``python -m sqla_outbox status``: what is waiting, what is running, what is stuck, how deep the queues are.

Four readings, each a small query or API call:

* **pending outbox rows** per table and queue (:func:`pending_rows`): how many, how many
  are already due, the age of the oldest one (since ``created_at``) and how late the
  oldest due one is (since ``available_at``: the relay's lag, the number to alert on);
* **runs by status** (:func:`runs_by_status`): every status, zeros included;
* **stale running runs** (:func:`stale_running`): ``running`` runs whose lease expired
  more than ``stale_after`` ago. A live worker renews its lease with the heartbeat, and a
  dead worker's message comes back after one visibility timeout (the lease length), so a
  lease expired for much longer means the message is gone (deleted, or moved by the SQS
  redrive without the run being told). They are flagged, never changed;
* **workers and the tasks waiting for one** (:mod:`sqla_outbox.presence`): the live
  workers (what they implement, how fresh their heartbeat is) and the due pending runs
  whose task no live worker implements on their queue (a rolling deploy in progress, or a
  task no deployed code has), with how long the oldest has waited since it became due;
* **parked outbox rows** (:func:`sqla_outbox.ops.resend.parked_runs`): rows SQS refused
  for good; their runs are ``failed`` with the SQS error (``outbox unpark`` puts them back);
* **unreceived runs** (:func:`sqla_outbox.ops.resend.unreceived`): ``queued`` runs whose
  message has waited in SQS longer than ``unreceived_after`` (default 1 day). SQS drops a
  message nobody received within the queue's retention (``sqs_message_retention_seconds``)
  without a trace; ``outbox resend`` sends such runs again;
* **flow control** (:func:`sqla_outbox.worker.gate.snapshot`, from Valkey): per task with
  a rate limit or concurrency cap, how much of it is in use; each circuit breaker's state
  (closed, open with the time left until its half-open probe, half-open);
* **flow control** (:mod:`sqla_outbox.flow`): the paused tasks, tenants and queues, and
  the tenants at their rate limit with how long their oldest due run has waited;
* **SQS depths** (:func:`queue_depths`): ``ApproximateNumberOfMessages`` (visible),
  ``...NotVisible`` (in flight) and ``...Delayed`` for each source queue and DLQ. SQS
  documents these as approximate (eventually consistent, about a minute).
"""

from __future__ import annotations

import dataclasses
import datetime as dt
from collections.abc import Sequence
from typing import Any

from sqlalchemy import Float, Integer, bindparam, text
from sqlalchemy.engine import Connection

from sqla_outbox import flow, presence
from sqla_outbox.config import OutboxSettings
from sqla_outbox.lifecycle import rescue
from sqla_outbox.ops import resend
from sqla_outbox.queues import BUILTIN_REGISTRY, QueueRegistry
from sqla_outbox.relay import partitions
from sqla_outbox.relay import rescue as relay_rescue
from sqla_outbox.sqs.client import error_code
from sqla_outbox.types import QUEUE_NAMES, RUN_STATUSES
from sqla_outbox.worker import gate

DEFAULT_STALE_AFTER_SECONDS = 900.0
"""A lease expired this long ago (15 min, the longest queue visibility) flags the run."""

_PENDING = text(
    """
SELECT 'outbox_messages' AS tbl, queue, count(*) AS pending,
       count(*) FILTER (WHERE available_at <= clock_timestamp()) AS due,
       EXTRACT(EPOCH FROM clock_timestamp() - min(created_at))::float8 AS oldest_age,
       EXTRACT(EPOCH FROM clock_timestamp()
           - min(available_at) FILTER (WHERE available_at <= clock_timestamp()))::float8 AS due_age,
       max(attempts) AS max_attempts
FROM outbox_messages WHERE sent_at IS NULL AND parked_at IS NULL GROUP BY queue
UNION ALL
SELECT 'platform_outbox_messages', queue, count(*),
       count(*) FILTER (WHERE available_at <= clock_timestamp()),
       EXTRACT(EPOCH FROM clock_timestamp() - min(created_at))::float8,
       EXTRACT(EPOCH FROM clock_timestamp()
           - min(available_at) FILTER (WHERE available_at <= clock_timestamp()))::float8,
       max(attempts)
FROM platform_outbox_messages WHERE sent_at IS NULL AND parked_at IS NULL GROUP BY queue
ORDER BY 1, 2
"""
)
_BY_STATUS = text("SELECT status, count(*) AS n FROM task_runs GROUP BY status")
_STALE_WHERE = """
status = 'running'
AND (lease_expires_at IS NULL OR lease_expires_at < clock_timestamp() - make_interval(secs => :stale))
"""
_STALE = text(
    f"""
SELECT run_id, task, queue, tenant_id, lease_owner, attempts,
       EXTRACT(EPOCH FROM clock_timestamp() - lease_expires_at)::float8 AS expired_for
FROM task_runs WHERE {_STALE_WHERE}
ORDER BY lease_expires_at NULLS FIRST
LIMIT :limit
"""
).bindparams(bindparam("stale", type_=Float), bindparam("limit", type_=Integer))
_STALE_COUNT = text(f"SELECT count(*) FROM task_runs WHERE {_STALE_WHERE}").bindparams(
    bindparam("stale", type_=Float)
)
_DEPTH_ATTRIBUTES = (
    "ApproximateNumberOfMessages",
    "ApproximateNumberOfMessagesNotVisible",
    "ApproximateNumberOfMessagesDelayed",
)


@dataclasses.dataclass(frozen=True)
class PendingRows:
    """Unsent rows of one outbox table and queue.

    Attributes:
        table: ``outbox_messages`` or ``platform_outbox_messages``.
        queue: Logical queue.
        pending: Rows with ``sent_at IS NULL`` (including delayed ones).
        due: Of those, rows whose ``available_at`` has passed (the relay should send them).
        oldest_pending_age_seconds: Now minus the oldest pending row's ``created_at``.
        oldest_due_age_seconds: Now minus the oldest due row's ``available_at`` (how late
            the relay is); None when nothing is due.
        max_attempts: Most failed send attempts among the pending rows.
    """

    table: str
    queue: str
    pending: int
    due: int
    oldest_pending_age_seconds: float
    oldest_due_age_seconds: float | None
    max_attempts: int


@dataclasses.dataclass(frozen=True)
class StaleRun:
    """A ``running`` run whose lease expired long ago.

    Attributes:
        run_id / task / queue / tenant_id: The run.
        lease_owner: The worker that last held it.
        attempts: Attempts started.
        lease_expired_seconds_ago: Seconds since the lease expired (None: no lease).
    """

    run_id: str
    task: str
    queue: str
    tenant_id: int | None
    lease_owner: str | None
    attempts: int
    lease_expired_seconds_ago: float | None


@dataclasses.dataclass(frozen=True)
class QueueDepth:
    """Approximate message counts of one SQS queue.

    Attributes:
        queue: Logical queue. name: SQS queue name. dead_letter: True for the DLQ.
        visible / not_visible / delayed: ``ApproximateNumberOfMessages``,
            ``...NotVisible`` (received, in flight), ``...Delayed``; None when the
            queue could not be read.
        error: SQS error code when the queue could not be read (e.g.
            ``AWS.SimpleQueueService.NonExistentQueue``: not provisioned).
    """

    queue: str
    name: str
    dead_letter: bool
    visible: int | None = None
    not_visible: int | None = None
    delayed: int | None = None
    error: str | None = None


@dataclasses.dataclass(frozen=True)
class StatusReport:
    """Everything ``python -m sqla_outbox status`` shows.

    Attributes:
        database_time: Database clock when the report was taken (UTC).
        pending: :class:`PendingRows` per table and queue that has pending rows.
        runs_by_status: Count per status, every status present (0 when none).
        stale_after_seconds: Threshold used for stale running runs.
        stale_running_count: How many ``running`` runs are stale.
        stale_running: Up to ``stale_limit`` of them, longest expired first.
        queues: Depth of every source queue and DLQ; None when SQS was not asked.
        workers: Live workers (heartbeat within ``presence.PRESENCE_TTL_SECONDS``).
        waiting_for_a_worker: Due pending runs no live worker implements, per task and queue.
        parked_count / parked: Parked outbox rows, and up to ``stale_limit`` of their runs.
        unreceived_after_seconds: Threshold used for unreceived runs.
        unreceived_count / unreceived: ``queued`` runs whose message has waited in SQS
            longer than that, and up to ``stale_limit`` of them, longest first.
        flow_control: Per-task limits in use and breaker states (None: no ``valkey_url``
            or not asked; ``error`` set when Valkey did not answer).
        pauses: Paused tasks, tenants and queues.
        throttled: Tenants whose due runs wait for their rate limit.
        relay_partitions: The ``relay_partitions`` the running relays use (read from their
            locks, whatever this command's own setting); None when no relay runs or they
            disagree (each relay's value is in ``relays``).
        relays: The running relays: the active one, or with partitions every relay and
            what it owns, with the due rows of its partitions.
        without_live_copy_count / without_live_copy: Unfinished runs whose sent message
            shows no sign of life past their queue's window (the relay's rescuer sends them
            again when their queue has no backlog and a worker serves them, or their message
            is past the retention: docs/lifecycle.md), and up to ``stale_limit`` of them.
        rescued_last_day: Runs the rescuer sent again in the last 24 hours.
    """

    database_time: dt.datetime
    pending: list[PendingRows]
    runs_by_status: dict[str, int]
    stale_after_seconds: float
    stale_running_count: int
    stale_running: list[StaleRun]
    queues: list[QueueDepth] | None
    workers: list[presence.LiveWorker] = dataclasses.field(default_factory=list)
    waiting_for_a_worker: list[presence.WaitingTask] = dataclasses.field(default_factory=list)
    parked_count: int = 0
    parked: list[resend.ParkedRun] = dataclasses.field(default_factory=list)
    unreceived_after_seconds: float = resend.DEFAULT_UNRECEIVED_AFTER.total_seconds()
    unreceived_count: int = 0
    unreceived: list[resend.UnreceivedRun] = dataclasses.field(default_factory=list)
    flow_control: gate.FlowControlState | None = None
    pauses: list[flow.Pause] = dataclasses.field(default_factory=list)
    throttled: list[flow.ThrottledTenant] = dataclasses.field(default_factory=list)
    relay_partitions: int | None = None
    relays: list[partitions.ActiveRelay] = dataclasses.field(default_factory=list)
    without_live_copy_count: int = 0
    without_live_copy: list[rescue.Candidate] = dataclasses.field(default_factory=list)
    rescued_last_day: int = 0


def pending_rows(connection: Connection) -> list[PendingRows]:
    """Pending rows per table and queue (only pairs that have some), sorted by table, queue."""
    return [
        PendingRows(
            table=r.tbl,
            queue=r.queue,
            pending=int(r.pending),
            due=int(r.due),
            oldest_pending_age_seconds=float(r.oldest_age),
            oldest_due_age_seconds=None if r.due_age is None else float(r.due_age),
            max_attempts=int(r.max_attempts),
        )
        for r in connection.execute(_PENDING)
    ]


def runs_by_status(connection: Connection) -> dict[str, int]:
    """``{status: count}`` for every status of :data:`~sqla_outbox.types.RUN_STATUSES`."""
    counts = dict.fromkeys(RUN_STATUSES, 0)
    for row in connection.execute(_BY_STATUS):
        counts[str(row.status)] = int(row.n)
    return counts


def stale_running(
    connection: Connection, *, stale_after_seconds: float, limit: int = 20
) -> tuple[int, list[StaleRun]]:
    """``running`` runs whose lease expired more than ``stale_after_seconds`` ago.

    Returns:
        ``(total count, up to limit runs, longest expired first)``.
    """
    params = {"stale": stale_after_seconds}
    total = int(connection.execute(_STALE_COUNT, params).scalar_one())
    runs = [
        StaleRun(
            run_id=str(r.run_id),
            task=r.task,
            queue=r.queue,
            tenant_id=r.tenant_id,
            lease_owner=r.lease_owner,
            attempts=int(r.attempts),
            lease_expired_seconds_ago=None if r.expired_for is None else float(r.expired_for),
        )
        for r in connection.execute(_STALE, {**params, "limit": limit})
    ]
    return total, runs


def queue_depths(
    client: Any, settings: OutboxSettings, queues: Sequence[str] = QUEUE_NAMES
) -> list[QueueDepth]:
    """Approximate depths of the source queues (default the four; the catalog's declared
    queues too when given) and their DLQs (never raises for SQS errors: they are reported
    per queue in :attr:`QueueDepth.error`)."""
    depths: list[QueueDepth] = []
    for queue in queues:
        for name, dead_letter in (
            (settings.queue_url_name(queue), False),
            (settings.dlq_url_name(queue), True),
        ):
            try:
                url = client.get_queue_url(QueueName=name)["QueueUrl"]
                attributes = client.get_queue_attributes(
                    QueueUrl=url, AttributeNames=list(_DEPTH_ATTRIBUTES)
                )["Attributes"]
            except Exception as exc:  # reported per queue; the other readings still matter
                depths.append(QueueDepth(queue, name, dead_letter, error=error_code(exc)))
                continue
            depths.append(
                QueueDepth(
                    queue,
                    name,
                    dead_letter,
                    visible=int(attributes.get("ApproximateNumberOfMessages", 0)),
                    not_visible=int(attributes.get("ApproximateNumberOfMessagesNotVisible", 0)),
                    delayed=int(attributes.get("ApproximateNumberOfMessagesDelayed", 0)),
                )
            )
    return depths


def _relays(connection: Connection, settings: OutboxSettings) -> dict[str, Any]:
    relays = partitions.with_due_rows(connection, partitions.active_relays(connection, settings))
    values = {r.relay_partitions for r in relays}
    return {"relays": relays, "relay_partitions": values.pop() if len(values) == 1 else None}


def collect(
    connection: Connection,
    settings: OutboxSettings,
    *,
    client: Any = None,
    stale_after_seconds: float = DEFAULT_STALE_AFTER_SECONDS,
    stale_limit: int = 20,
    unreceived_after: dt.timedelta = resend.DEFAULT_UNRECEIVED_AFTER,
    with_valkey: bool = True,
    queues: Sequence[str] = QUEUE_NAMES,
    registry: QueueRegistry = BUILTIN_REGISTRY,
) -> StatusReport:
    """Take the whole report.

    Args:
        connection: Connection to the outbox database (read-only queries).
        settings: Queue names come from ``queue_prefix``.
        client: boto3 SQS client; None skips the SQS depths.
        stale_after_seconds: See :func:`stale_running`.
        stale_limit: Most stale, parked and unreceived runs listed.
        unreceived_after: Flag ``queued`` runs whose message waited in SQS longer.
        with_valkey: Read the flow-control state from Valkey (``valkey_url``).
        queues: Logical queues whose depths are read (the catalog's
            :meth:`~sqla_outbox.catalog.Catalog.queue_names` includes declared ones).
        registry: The queues' properties, for the rescuer's windows
            (:meth:`~sqla_outbox.catalog.Catalog.queue_registry`).

    Raises:
        sqlalchemy.exc.DBAPIError: The database could not be read.
    """
    database_time: dt.datetime = connection.execute(text("SELECT clock_timestamp()")).scalar_one()
    count, stale = stale_running(connection, stale_after_seconds=stale_after_seconds, limit=stale_limit)
    workers = presence.live_workers(connection)
    listed = resend.Selection(limit=stale_limit)
    silent = rescue.candidates(
        connection,
        windows=relay_rescue.windows(registry, settings),
        retention_seconds=settings.sqs_message_retention_seconds,
        limit=10_000,
    )
    return StatusReport(
        without_live_copy_count=len(silent),
        without_live_copy=silent[:stale_limit],
        rescued_last_day=rescue.rescued_since(connection, 86_400),
        parked_count=resend.parked_count(connection),
        parked=resend.parked_runs(connection, listed),
        unreceived_after_seconds=unreceived_after.total_seconds(),
        unreceived_count=resend.unreceived_count(connection, older_than=unreceived_after),
        unreceived=resend.unreceived(connection, older_than=unreceived_after, selection=listed),
        database_time=database_time,
        pending=pending_rows(connection),
        runs_by_status=runs_by_status(connection),
        stale_after_seconds=stale_after_seconds,
        stale_running_count=count,
        stale_running=stale,
        queues=None if client is None else queue_depths(client, settings, queues),
        workers=workers,
        waiting_for_a_worker=presence.waiting_for_a_worker(connection, presence.Coverage.of(workers)),
        flow_control=gate.snapshot(settings) if with_valkey else None,
        pauses=flow.list_pauses(connection),
        throttled=flow.throttled_tenants(connection, settings.tenant_rate_limit_per_minute),
        **_relays(connection, settings),
    )
