"""Mapped classes for the outbox tables, the run table and the run trail.

The schema is created by the bundled Alembic migrations (``sqla_outbox/migrations``),
not by ``metadata.create_all``; this module mirrors it exactly so an application that
puts :data:`metadata` in its ``target_metadata`` gets an empty autogenerate diff for our
tables. ``tests/integration/test_migrations.py`` proves the two agree.

Tables:

* ``outbox_messages`` — work for a tenant; ``tenant_id`` references the application's
  tenants table (``SQLA_OUTBOX_TENANT_FOREIGN_KEY``, default ``tenants.id``, or none).
* ``platform_outbox_messages`` — work without a tenant (platform, system, schedules).
* ``task_runs`` — one row per run: status, attempts, lease, last error.
* ``task_run_trail`` — one row per status change or error of a run.
* ``webhook_endpoints`` — per tenant: where webhook events are delivered, and how signed.
* ``worker_presence`` — the running workers, the tasks they implement and their heartbeat.
* ``schedule_slots`` — the latest slot the relay dispatched per scheduled task.
* ``flow_pauses`` — paused tasks, tenants and queues (:mod:`sqla_outbox.flow`).
* ``tenant_flow`` — per-tenant relay weight and rate-limit override (:mod:`sqla_outbox.flow`).
"""

from __future__ import annotations

import datetime as dt
import os
import uuid
from typing import Any

from sqlalchemy import (
    BigInteger,
    Boolean,
    CheckConstraint,
    Column,
    DateTime,
    ForeignKey,
    ForeignKeyConstraint,
    Identity,
    Index,
    Integer,
    Interval,
    MetaData,
    PrimaryKeyConstraint,
    SmallInteger,
    Table,
    Text,
    func,
    text,
)
from sqlalchemy.dialects.postgresql import ARRAY, JSONB, UUID
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from sqla_outbox.types import FINISHED_STATUSES, QUEUE_NAMES, RUN_STATUSES, UNFINISHED_STATUSES

NAMING_CONVENTION = {
    "ix": "%(table_name)s_%(column_0_N_name)s_idx",
    "uq": "%(table_name)s_%(column_0_name)s_key",
    "ck": "%(table_name)s_%(constraint_name)s_check",
    "fk": "%(table_name)s_%(column_0_name)s_fkey",
    "pk": "%(table_name)s_pkey",
}

metadata = MetaData(naming_convention=NAMING_CONVENTION)
"""The sqla_outbox tables. Add it to your Alembic ``target_metadata`` list."""

_QUEUE_LIST = ", ".join(f"'{q}'" for q in QUEUE_NAMES)
_STATUS_LIST = ", ".join(f"'{s}'" for s in RUN_STATUSES)
_UNFINISHED_LIST = ", ".join(f"'{s}'" for s in UNFINISHED_STATUSES)
_FINISHED_LIST = ", ".join(f"'{s}'" for s in FINISHED_STATUSES)
TIMESTAMPTZ = DateTime(timezone=True)
CLOCK = text("clock_timestamp()")


class Base(DeclarativeBase):
    metadata = metadata


def _outbox_columns_doc() -> str:
    return """
    Columns:
        id: bigint identity (GENERATED ALWAYS); insertion order, used as a tie-breaker.
        run_id: The run this row delivers; UNIQUE.
        queue: Logical queue (critical, default, bulk, maintenance); CHECKed.
        envelope: The message body as jsonb (see ``sqla_outbox.envelope``); CHECKed to
            be an object.
        available_at: When the relay may send it; set on the database clock at dispatch
            (``clock_timestamp()`` + delay) and pushed forward by send backoff.
        sent_at: Set by the relay in the claiming transaction once SQS accepted the
            message; NULL means pending (or parked).
        attempts: Failed send attempts, incremented by the relay; CHECK >= 0.
        created_at: Insert time, ``clock_timestamp()``.
        parked_at: Set by the relay when SQS refused the message for good (a refusal
            that cannot succeed on retry, or ``relay_max_send_attempts`` refusals): the
            relay no longer claims it and its run is ``failed``. NULL otherwise; cleared
            by ``python -m sqla_outbox outbox unpark``. Never set together with sent_at.
        last_error: The last failed send, ``<SQS error code>: <message>``; NULL while
            no send failed. Written by the relay.
        priority: 1..10, lower first (default 3): when more rows are due than a relay
            pass sends, lower values of one queue go first (docs/flow-control.md).
    """


class OutboxMessage(Base):
    __tablename__ = "outbox_messages"
    __doc__ = "A pending or sent message for a tenant's run." + _outbox_columns_doc()

    id: Mapped[int] = mapped_column(BigInteger, Identity(always=True), primary_key=True)
    tenant_id: Mapped[int] = mapped_column(BigInteger)
    run_id: Mapped[uuid.UUID] = mapped_column(UUID(as_uuid=True), unique=True)
    queue: Mapped[str] = mapped_column(Text)
    envelope: Mapped[dict[str, Any]] = mapped_column(JSONB)
    available_at: Mapped[dt.datetime] = mapped_column(TIMESTAMPTZ)
    sent_at: Mapped[dt.datetime | None] = mapped_column(TIMESTAMPTZ)
    attempts: Mapped[int] = mapped_column(Integer, server_default=text("0"))
    created_at: Mapped[dt.datetime] = mapped_column(TIMESTAMPTZ, server_default=CLOCK)
    parked_at: Mapped[dt.datetime | None] = mapped_column(TIMESTAMPTZ)
    last_error: Mapped[str | None] = mapped_column(Text)
    priority: Mapped[int] = mapped_column(SmallInteger, server_default=text("3"))

    __table_args__ = (
        CheckConstraint("attempts >= 0", name="attempts"),
        CheckConstraint("jsonb_typeof(envelope) = 'object'", name="envelope"),
        CheckConstraint(f"queue IN ({_QUEUE_LIST})", name="queue"),
        CheckConstraint("sent_at IS NULL OR parked_at IS NULL", name="parked"),
        CheckConstraint("priority BETWEEN 1 AND 10", name="priority"),
        # sqlaob_0007: the relay's fair claim (per queue[, tenant], priority first)
        Index(
            "outbox_messages_fair_idx",
            "queue",
            "tenant_id",
            "priority",
            "available_at",
            "id",
            postgresql_where=text("sent_at IS NULL AND parked_at IS NULL"),
        ),
        Index(
            "outbox_messages_pending_idx",
            "available_at",
            "id",
            postgresql_where=text("sent_at IS NULL AND parked_at IS NULL"),
        ),
        Index(
            "outbox_messages_parked_idx",
            "parked_at",
            postgresql_where=text("parked_at IS NOT NULL"),
        ),
        Index(
            "outbox_messages_sent_at_idx",
            "sent_at",
            postgresql_where=text("sent_at IS NOT NULL"),
        ),
    )


class PlatformOutboxMessage(Base):
    __tablename__ = "platform_outbox_messages"
    __doc__ = "A pending or sent message for a run without a tenant." + _outbox_columns_doc()

    id: Mapped[int] = mapped_column(BigInteger, Identity(always=True), primary_key=True)
    run_id: Mapped[uuid.UUID] = mapped_column(UUID(as_uuid=True), unique=True)
    queue: Mapped[str] = mapped_column(Text)
    envelope: Mapped[dict[str, Any]] = mapped_column(JSONB)
    available_at: Mapped[dt.datetime] = mapped_column(TIMESTAMPTZ)
    sent_at: Mapped[dt.datetime | None] = mapped_column(TIMESTAMPTZ)
    attempts: Mapped[int] = mapped_column(Integer, server_default=text("0"))
    created_at: Mapped[dt.datetime] = mapped_column(TIMESTAMPTZ, server_default=CLOCK)
    parked_at: Mapped[dt.datetime | None] = mapped_column(TIMESTAMPTZ)
    last_error: Mapped[str | None] = mapped_column(Text)
    priority: Mapped[int] = mapped_column(SmallInteger, server_default=text("3"))

    __table_args__ = (
        CheckConstraint("attempts >= 0", name="attempts"),
        CheckConstraint("jsonb_typeof(envelope) = 'object'", name="envelope"),
        CheckConstraint(f"queue IN ({_QUEUE_LIST})", name="queue"),
        CheckConstraint("sent_at IS NULL OR parked_at IS NULL", name="parked"),
        CheckConstraint("priority BETWEEN 1 AND 10", name="priority"),
        # sqlaob_0007: the relay's fair claim (per queue[, tenant], priority first)
        Index(
            "platform_outbox_messages_fair_idx",
            "queue",
            "priority",
            "available_at",
            "id",
            postgresql_where=text("sent_at IS NULL AND parked_at IS NULL"),
        ),
        Index(
            "platform_outbox_messages_pending_idx",
            "available_at",
            "id",
            postgresql_where=text("sent_at IS NULL AND parked_at IS NULL"),
        ),
        Index(
            "platform_outbox_messages_parked_idx",
            "parked_at",
            postgresql_where=text("parked_at IS NOT NULL"),
        ),
        Index(
            "platform_outbox_messages_sent_at_idx",
            "sent_at",
            postgresql_where=text("sent_at IS NOT NULL"),
        ),
    )


class TaskRun(Base):
    """One unit of work, from dispatch to its final status.

    Columns:
        run_id: Primary key; the same UUID as the outbox row and the envelope.
        task: Task name. event: Published event it subscribes to, or NULL.
        queue: Logical queue. tenant_id: Tenant, NULL for platform work (no foreign key:
            history outlives tenants until purged).
        status: queued → running → succeeded | retrying → … → failed; or cancelled (a
            committed ``Cancel``). Written at dispatch (queued), by the worker, and by a
            cancel (``sqla_outbox.controls``).
        idempotency_key: Caller key; at most one unfinished run per task + tenant + key
            (partial unique indexes ``task_runs_idempotency_*_key``).
        attempts: Handler executions started (the worker increments it when it takes the
            run's lease).
        available_at: When the run may run (next), database clock: its due time at
            dispatch (or a ``Reschedule``, a requeue), and for a ``retrying`` run the
            next try's time (``running → retrying`` sets it from the backoff). A copy of
            the run received earlier is an early copy, never run. Holds and deferrals
            leave it alone: they move the outbox row's ``available_at`` only, and the
            worker checks their rule again for every copy it receives.
        created_at / updated_at / started_at / finished_at: Life-cycle timestamps.
        lease_owner / lease_expires_at: The worker executing the run and until when its
            lease holds; renewed by the heartbeat. Another worker may take the run over
            only after it expires.
        last_error_type / last_error: The most recent failure (type name, message).
        dead_lettered_at: When the worker sent the run's message to the DLQ.
        cancel_requested_at: When a committed ``Cancel`` asked the running run to stop
            (database clock); the worker's heartbeat reads it and the attempt ends
            ``cancelled``. NULL otherwise. Written by ``sqla_outbox.control_write``.
        result: The JSON value the handler returned, written by the worker in the
            transaction that marks the run ``succeeded`` (at most ``result_max_bytes``
            bytes of JSON); NULL when it returned None or did not succeed
            (``sqla_outbox.results``).
        group_id: The :class:`TaskGroup` the run is a member of, or NULL. Written at
            dispatch by ``sqla_outbox.Group``.
        priority: 1..10, lower first (default 3): the priority the run was dispatched
            with (sqlaob_0008), copied to its outbox row; a statement that writes the
            outbox row again after a purge takes it from here.
    """

    __tablename__ = "task_runs"

    run_id: Mapped[uuid.UUID] = mapped_column(UUID(as_uuid=True), primary_key=True)
    task: Mapped[str] = mapped_column(Text)
    event: Mapped[str | None] = mapped_column(Text)
    queue: Mapped[str] = mapped_column(Text)
    tenant_id: Mapped[int | None] = mapped_column(BigInteger)
    status: Mapped[str] = mapped_column(Text, server_default=text("'queued'"))
    idempotency_key: Mapped[str | None] = mapped_column(Text)
    attempts: Mapped[int] = mapped_column(Integer, server_default=text("0"))
    available_at: Mapped[dt.datetime] = mapped_column(TIMESTAMPTZ)
    created_at: Mapped[dt.datetime] = mapped_column(TIMESTAMPTZ, server_default=CLOCK)
    updated_at: Mapped[dt.datetime] = mapped_column(TIMESTAMPTZ, server_default=CLOCK)
    started_at: Mapped[dt.datetime | None] = mapped_column(TIMESTAMPTZ)
    finished_at: Mapped[dt.datetime | None] = mapped_column(TIMESTAMPTZ)
    lease_owner: Mapped[str | None] = mapped_column(Text)
    lease_expires_at: Mapped[dt.datetime | None] = mapped_column(TIMESTAMPTZ)
    last_error_type: Mapped[str | None] = mapped_column(Text)
    last_error: Mapped[str | None] = mapped_column(Text)
    dead_lettered_at: Mapped[dt.datetime | None] = mapped_column(TIMESTAMPTZ)
    # sqlaob_0005: cancel requests and handler results
    cancel_requested_at: Mapped[dt.datetime | None] = mapped_column(TIMESTAMPTZ)
    result: Mapped[Any | None] = mapped_column(JSONB)
    group_id: Mapped[uuid.UUID | None] = mapped_column(UUID(as_uuid=True))
    # sqlaob_0008: the run's own priority
    priority: Mapped[int] = mapped_column(SmallInteger, server_default=text("3"))

    __table_args__ = (
        CheckConstraint("attempts >= 0", name="attempts"),
        CheckConstraint(f"queue IN ({_QUEUE_LIST})", name="queue"),
        CheckConstraint(f"status IN ({_STATUS_LIST})", name="status"),
        CheckConstraint("priority BETWEEN 1 AND 10", name="priority"),
        Index(
            "task_runs_idempotency_tenant_key",
            "tenant_id",
            "task",
            "idempotency_key",
            unique=True,
            postgresql_where=text(
                f"idempotency_key IS NOT NULL AND tenant_id IS NOT NULL AND status IN ({_UNFINISHED_LIST})"
            ),
        ),
        Index(
            "task_runs_idempotency_platform_key",
            "task",
            "idempotency_key",
            unique=True,
            postgresql_where=text(
                f"idempotency_key IS NOT NULL AND tenant_id IS NULL AND status IN ({_UNFINISHED_LIST})"
            ),
        ),
        Index(
            "task_runs_finished_idx",
            "finished_at",
            postgresql_where=text(f"status IN ({_FINISHED_LIST})"),
        ),
        Index("task_runs_status_idx", "status", "updated_at"),
        # sqlaob_0003: run lists newest first (dashboard, runs list), filtered by task or tenant
        Index("task_runs_created_at_idx", "created_at"),
        Index("task_runs_task_created_at_idx", "task", "created_at"),
        Index("task_runs_tenant_id_created_at_idx", "tenant_id", "created_at"),
        # sqlaob_0005: Cancel/Reschedule by idempotency key, finished runs included
        Index(
            "task_runs_task_idempotency_key_idx",
            "task",
            "idempotency_key",
            postgresql_where=text("idempotency_key IS NOT NULL"),
        ),
        # sqlaob_0006: a group's members
        Index("task_runs_group_id_idx", "group_id", postgresql_where=text("group_id IS NOT NULL")),
    )


class TaskRunTrail(Base):
    """One status change or error of a run, with its context.

    Columns:
        id: bigint identity; order of events. run_id: The run (cascade-deleted with it).
        at: When, ``clock_timestamp()``. status: Status after this event.
        attempt: Handler attempt number. receive_count: SQS ApproximateReceiveCount.
        worker_id: Worker that recorded it. error_type / error_message / traceback:
            The failure, when there was one (traceback is an excerpt, at most 4,000
            characters). detail: Extra JSON context (DLQ reason, backoff seconds, ...).
    """

    __tablename__ = "task_run_trail"

    id: Mapped[int] = mapped_column(BigInteger, Identity(always=True), primary_key=True)
    run_id: Mapped[uuid.UUID] = mapped_column(
        UUID(as_uuid=True), ForeignKey("task_runs.run_id", ondelete="CASCADE")
    )
    at: Mapped[dt.datetime] = mapped_column(TIMESTAMPTZ, server_default=CLOCK)
    status: Mapped[str] = mapped_column(Text)
    attempt: Mapped[int | None] = mapped_column(Integer)
    receive_count: Mapped[int | None] = mapped_column(Integer)
    worker_id: Mapped[str | None] = mapped_column(Text)
    error_type: Mapped[str | None] = mapped_column(Text)
    error_message: Mapped[str | None] = mapped_column(Text)
    traceback: Mapped[str | None] = mapped_column(Text)
    detail: Mapped[dict[str, Any] | None] = mapped_column(JSONB)

    __table_args__ = (Index("task_run_trail_run_id_idx", "run_id", "id"),)


class WebhookEndpoint(Base):
    """Where a tenant's webhook events are delivered, and how they are signed.

    Create and change endpoints with :mod:`sqla_outbox.webhooks` (it checks URLs and
    events, generates and rotates secrets); query them like any mapped class, with a
    ``Session`` or an ``AsyncSession``.

    Columns:
        id: bigint identity; the ``endpoint_id`` a delivery run carries.
        tenant_id: The tenant whose published events go here (no foreign key, like
            ``task_runs``).
        url: ``http://`` or ``https://`` URL the events are POSTed to; read at every
            attempt, so an edit applies to deliveries already scheduled.
        events: Webhook events (catalog names) this endpoint receives.
        secrets: Signing secrets, newest first: ``[{"secret": "whsec_...", "created_at":
            ISO 8601, "expires_at": ISO 8601 or null}]``. The newest signs; an older one
            also signs until its ``expires_at`` (rotation). CHECKed to be a non-empty array.
        enabled: False: nothing is scheduled, and scheduled deliveries are not sent.
        disabled_at / disabled_reason: When and why it was disabled (sqlaob_0013), both
            None while enabled: ``operator`` (:func:`sqla_outbox.webhooks.disable_endpoint`)
            or ``gone`` (the receiver answered ``410 Gone``; the worker disabled it).
        description: Free text for humans.
        created_at / updated_at: ``clock_timestamp()``; ``updated_at`` is set by the ORM
            on every change.
    """

    __tablename__ = "webhook_endpoints"

    id: Mapped[int] = mapped_column(BigInteger, Identity(always=True), primary_key=True)
    tenant_id: Mapped[int] = mapped_column(BigInteger)
    url: Mapped[str] = mapped_column(Text)
    events: Mapped[list[str]] = mapped_column(ARRAY(Text), server_default=text("'{}'::text[]"))
    secrets: Mapped[list[dict[str, Any]]] = mapped_column(JSONB)
    enabled: Mapped[bool] = mapped_column(Boolean, server_default=text("true"))
    disabled_at: Mapped[dt.datetime | None] = mapped_column(TIMESTAMPTZ)
    disabled_reason: Mapped[str | None] = mapped_column(Text)
    description: Mapped[str | None] = mapped_column(Text)
    created_at: Mapped[dt.datetime] = mapped_column(TIMESTAMPTZ, server_default=CLOCK)
    updated_at: Mapped[dt.datetime] = mapped_column(
        TIMESTAMPTZ, server_default=CLOCK, onupdate=func.clock_timestamp()
    )

    __table_args__ = (
        CheckConstraint(
            "jsonb_typeof(secrets) = 'array' AND jsonb_array_length(secrets) >= 1", name="secrets"
        ),
        Index("webhook_endpoints_tenant_id_idx", "tenant_id", postgresql_where=text("enabled")),
    )

    def __repr__(self) -> str:  # never shows the secrets
        return (
            f"WebhookEndpoint(id={self.id}, tenant_id={self.tenant_id}, events={self.events}, "
            f"enabled={self.enabled})"
        )


class WorkerPresence(Base):
    """A running worker: what it can run, and when it last said it was alive.

    Written by the worker (at start, every ``PRESENCE_INTERVAL_SECONDS``, removed at a
    clean stop); read by the relay and ``python -m sqla_outbox status`` (see
    :mod:`sqla_outbox.presence`).

    Columns:
        worker_id: The worker's id (``<host>:<pid>`` by default).
        tasks: Tasks it has handlers for. queues: Queues it consumes.
        started_at: When it registered. heartbeat_at: Its last heartbeat (database clock).
    """

    __tablename__ = "worker_presence"

    worker_id: Mapped[str] = mapped_column(Text, primary_key=True)
    tasks: Mapped[list[str]] = mapped_column(ARRAY(Text))
    queues: Mapped[list[str]] = mapped_column(ARRAY(Text))
    started_at: Mapped[dt.datetime] = mapped_column(TIMESTAMPTZ, server_default=CLOCK)
    heartbeat_at: Mapped[dt.datetime] = mapped_column(TIMESTAMPTZ, server_default=CLOCK)


class ScheduleSlot(Base):
    """The latest slot the relay dispatched for one scheduled task.

    Columns:
        task: The scheduled task (primary key).
        last_slot: The latest slot dispatched (UTC); the relay dispatches only later
            slots, so a purged run's slot is never dispatched again.
        run_id: The run dispatched for ``last_slot``.
        updated_at: When the row last changed, ``clock_timestamp()``.

    Written by the active relay in the transaction that writes the slot's run; never
    deleted by ``maintenance.purge``.
    """

    __tablename__ = "schedule_slots"

    task: Mapped[str] = mapped_column(Text, primary_key=True)
    last_slot: Mapped[dt.datetime] = mapped_column(TIMESTAMPTZ)
    run_id: Mapped[uuid.UUID] = mapped_column(UUID(as_uuid=True))
    updated_at: Mapped[dt.datetime] = mapped_column(TIMESTAMPTZ, server_default=CLOCK)


class TaskGroup(Base):
    """A group of runs dispatched together, and the run that completes it.

    Written by ``session.add(sqla_outbox.Group(...))`` in the dispatching transaction;
    updated only by the trigger ``task_runs_group_finish`` (migration sqlaob_0006), in the
    transaction that moves a member out of the unfinished statuses.

    Columns:
        id: The group's UUID (``Group.group_id``).
        tenant_id: Tenant of the completion run, NULL for a platform completion.
        total: Members, >= 1. remaining: Members not finished yet, 0..total.
        statuses: ``{run_id: status}`` of each finished member, in the status it first
            finished with (a member requeued later is not counted again).
        completion_run_id / completion_task / completion_queue / completion_envelope /
            completion_delay: The completion run, prepared at dispatch and written (run
            row and outbox row) by the trigger when ``remaining`` reaches 0.
        created_at: Dispatch time. completed_at: When the last member finished.
    """

    __tablename__ = "task_groups"

    id: Mapped[uuid.UUID] = mapped_column(UUID(as_uuid=True), primary_key=True)
    tenant_id: Mapped[int | None] = mapped_column(BigInteger)
    total: Mapped[int] = mapped_column(Integer)
    remaining: Mapped[int] = mapped_column(Integer)
    statuses: Mapped[dict[str, Any]] = mapped_column(JSONB, server_default=text("'{}'::jsonb"))
    completion_run_id: Mapped[uuid.UUID] = mapped_column(UUID(as_uuid=True), unique=True)
    completion_task: Mapped[str] = mapped_column(Text)
    completion_queue: Mapped[str] = mapped_column(Text)
    completion_envelope: Mapped[dict[str, Any]] = mapped_column(JSONB)
    completion_delay: Mapped[dt.timedelta] = mapped_column(Interval, server_default=text("'0'::interval"))
    created_at: Mapped[dt.datetime] = mapped_column(TIMESTAMPTZ, server_default=CLOCK)
    completed_at: Mapped[dt.datetime | None] = mapped_column(TIMESTAMPTZ)

    __table_args__ = (
        CheckConstraint("total >= 1", name="total"),
        CheckConstraint("remaining >= 0 AND remaining <= total", name="remaining"),
        Index("task_groups_created_at_idx", "created_at"),
    )


class ScheduleTenantSlot(Base):
    """The latest slot the relay dispatched for one tenant of a tenant fan-out schedule.

    Columns:
        task / tenant_id: The scheduled task and the tenant (primary key).
        last_slot: The latest slot dispatched for this tenant (UTC).
        run_id: The run dispatched for ``last_slot``.
        updated_at: When the row last changed, ``clock_timestamp()``.

    Written by the active relay in the transaction that writes the slot's runs.
    """

    __tablename__ = "schedule_tenant_slots"

    task: Mapped[str] = mapped_column(Text, primary_key=True)
    tenant_id: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    last_slot: Mapped[dt.datetime] = mapped_column(TIMESTAMPTZ)
    run_id: Mapped[uuid.UUID] = mapped_column(UUID(as_uuid=True))
    updated_at: Mapped[dt.datetime] = mapped_column(TIMESTAMPTZ, server_default=CLOCK)


class FlowPause(Base):
    """A paused task, tenant or queue: its runs stay pending in the outbox until resumed.

    Columns:
        scope: ``task``, ``tenant`` or ``queue``. target: The task name, the tenant id
            (as text) or the queue name. paused_at: When. paused_by: Who (CLI user,
            dashboard user, API caller). reason: Free text.

    Written by :func:`sqla_outbox.flow.pause` / :func:`~sqla_outbox.flow.resume`; read by
    the relay (each pass) and the workers (every ``flow_refresh_seconds``).
    """

    __tablename__ = "flow_pauses"

    scope: Mapped[str] = mapped_column(Text)
    target: Mapped[str] = mapped_column(Text)
    paused_at: Mapped[dt.datetime] = mapped_column(TIMESTAMPTZ, server_default=CLOCK)
    paused_by: Mapped[str | None] = mapped_column(Text)
    reason: Mapped[str | None] = mapped_column(Text)

    __table_args__ = (
        PrimaryKeyConstraint("scope", "target"),
        CheckConstraint("scope IN ('task', 'tenant', 'queue')", name="scope"),
    )


class TenantFlow(Base):
    """One tenant's flow settings, read by the relay.

    Columns:
        tenant_id: The tenant (no foreign key, like ``task_runs``).
        weight: 1..1000 (default 1): the tenant's share of a relay pass relative to the
            other tenants with due rows.
        rate_limit_per_minute: Override of ``tenant_rate_limit_per_minute``: runs sent per
            sliding minute; 0 means unlimited; NULL the global default.
        updated_at / updated_by: Last change, and who made it.
    """

    __tablename__ = "tenant_flow"

    tenant_id: Mapped[int] = mapped_column(BigInteger, primary_key=True, autoincrement=False)
    weight: Mapped[int] = mapped_column(Integer, server_default=text("1"))
    rate_limit_per_minute: Mapped[int | None] = mapped_column(Integer)
    updated_at: Mapped[dt.datetime] = mapped_column(TIMESTAMPTZ, server_default=CLOCK)
    updated_by: Mapped[str | None] = mapped_column(Text)

    __table_args__ = (
        CheckConstraint("weight BETWEEN 1 AND 1000", name="weight"),
        CheckConstraint("rate_limit_per_minute >= 0", name="rate_limit"),
    )


class DashboardSession(Base):
    """A signed-in dashboard browser (sqlaob_0009), written by ``sqla_outbox.dashboard``.

    Columns:
        id: SHA-256 (hex) of the random key the browser's cookie holds; the key itself is
            stored nowhere.
        operator: The operator's name (what actions record as ``dashboard:<name>``).
        method: How they signed in: ``token``, ``user`` (their own token), ``basic``,
            ``proxy`` (a reverse proxy named them) or ``host`` (the mounting application).
        credential: A fingerprint (HMAC-SHA256) of the credential that opened the session;
            a session whose credential changed since (a rotated token) is refused.
        csrf_token: The session's token for forms.
        created_at / expires_at: When it began and ends (``dashboard_session_max_age_seconds``
            later); the dashboard refuses it after ``expires_at`` (database clock) and
            deletes expired rows when a session is created.
    """

    __tablename__ = "dashboard_sessions"

    id: Mapped[str] = mapped_column(Text, primary_key=True)
    operator: Mapped[str] = mapped_column(Text)
    method: Mapped[str] = mapped_column(Text)
    credential: Mapped[str] = mapped_column(Text)
    csrf_token: Mapped[str] = mapped_column(Text)
    created_at: Mapped[dt.datetime] = mapped_column(TIMESTAMPTZ, server_default=CLOCK)
    expires_at: Mapped[dt.datetime] = mapped_column(TIMESTAMPTZ, index=True)


outbox_messages: Table = OutboxMessage.__table__  # type: ignore[assignment]
platform_outbox_messages: Table = PlatformOutboxMessage.__table__  # type: ignore[assignment]
task_runs: Table = TaskRun.__table__  # type: ignore[assignment]
task_run_trail: Table = TaskRunTrail.__table__  # type: ignore[assignment]
webhook_endpoints: Table = WebhookEndpoint.__table__  # type: ignore[assignment]
worker_presence: Table = WorkerPresence.__table__  # type: ignore[assignment]
schedule_slots: Table = ScheduleSlot.__table__  # type: ignore[assignment]
task_groups: Table = TaskGroup.__table__  # type: ignore[assignment]
schedule_tenant_slots: Table = ScheduleTenantSlot.__table__  # type: ignore[assignment]
flow_pauses: Table = FlowPause.__table__  # type: ignore[assignment]
tenant_flow: Table = TenantFlow.__table__  # type: ignore[assignment]
dashboard_sessions: Table = DashboardSession.__table__  # type: ignore[assignment]


def set_tenant_foreign_key(target: str | Column[Any] | None) -> None:
    """Point ``outbox_messages.tenant_id`` at ``target``, or at nothing.

    Args:
        target: ``"table.column"`` (resolved lazily, by name), a ``Column`` object of
            the application's tenants table (what Alembic's autogenerate needs, since it
            resolves foreign keys; see :func:`sqla_outbox.migrations.target_metadata`), or
            None for no foreign key.

    The default comes from ``SQLA_OUTBOX_TENANT_FOREIGN_KEY`` (``tenants.id``) when this
    module is first imported; the migrations read the same variable.
    """
    for constraint in list(outbox_messages.foreign_key_constraints):
        outbox_messages.constraints.discard(constraint)
        for element in constraint.elements:
            element.parent.foreign_keys.discard(element)
        outbox_messages.foreign_keys.difference_update(constraint.elements)
    if target is not None:
        outbox_messages.append_constraint(
            ForeignKeyConstraint(["tenant_id"], [target], name="outbox_messages_tenant_id_fkey")
        )


def tenant_foreign_key_target() -> str | None:
    """The ``table.column`` (or ``schema.table.column``) the tenant FK references, if any."""
    for constraint in outbox_messages.foreign_key_constraints:
        return constraint.elements[0].target_fullname
    return None


def tenant_foreign_key_from_env() -> str | None:
    """The tenant foreign key target named by ``SQLA_OUTBOX_TENANT_FOREIGN_KEY``."""
    raw = os.environ.get("SQLA_OUTBOX_TENANT_FOREIGN_KEY", "tenants.id").strip()
    return None if raw.lower() in {"", "none", "null", "off"} else raw


set_tenant_foreign_key(tenant_foreign_key_from_env())
