"""The relay: moves committed outbox rows to SQS. ``python -m sqla_outbox.relay``.

With ``relay_partitions = 1`` (the default) one relay is active per database. Relays
elect the active one with a PostgreSQL session-level advisory lock
(``pg_try_advisory_lock(relay_lock_id)``) held on the connection that also runs every
claim transaction; any other relay is a hot standby that retries the lock every
``relay_standby_poll_seconds`` and takes over as soon as the active relay's connection
ends (PostgreSQL releases session locks when a session ends, so a ``kill -9`` hands over
within about a second). With ``relay_partitions > 1`` up to that many relays are active at
once, each claiming the rows of the outbox partitions it owns
(:mod:`sqla_outbox.relay.partitions`); a relay that takes a Valkey wake passes it on to the
others with a ``NOTIFY``, since only one BLPOP receives each push.

A pass: in one transaction on that connection, claim due rows (``FOR UPDATE SKIP
LOCKED``): with ``relay_fairness`` (the default) up to ``relay_batch_size`` per queue,
shared across tenants by weight, priority first, within each queue's room in SQS and each
tenant's rate limit (:mod:`sqla_outbox.relay.fair`); without it up to ``relay_batch_size``
per outbox table, oldest first. Send them
(:mod:`sqla_outbox.relay.send`), mark accepted rows ``sent_at`` and back off the others
(``attempts + 1``, ``available_at`` pushed by capped exponential backoff), commit.

Between passes the relay waits for whichever comes first:

* a wake: BLPOP on the Valkey wake key (:mod:`sqla_outbox.wakeup`) and/or a PostgreSQL
  notification (``LISTEN`` on a connection of its own, :mod:`sqla_outbox.relay.listen`),
  each in a listener thread, as ``wake_mode`` says; except that right after a pass a wake
  started and that found nothing, the next wake waits :data:`WAKE_HOLD_SECONDS`: a flood
  of wakes (pushes on the wake key by anyone who may write to Valkey, or NOTIFYs) then
  costs at most 1 / WAKE_HOLD_SECONDS empty passes a second, and a wake that finds rows is
  served at once;
* the earliest future ``available_at`` it knows of (database clock), so delayed runs go
  out on time rather than at the next sweep;
* the sweep interval (``relay_sweep_interval_seconds``), the guarantee when wakes are lost;
* none at all when the last pass was full: a backlog drains at the queue's speed;
* (rows of a task that no live worker implements are held pending instead of sent:
  :mod:`sqla_outbox.relay.hold`, ``relay_hold_unserved``; so are rows of a paused task,
  tenant or queue: :mod:`sqla_outbox.relay.pauses`);
* while rows are due but cannot go (their queue holds ``relay_queue_depth`` messages in
  SQS, or their tenant is at its rate limit), the time the depth is re-read
  (``relay_depth_poll_seconds``) or the tenant's window reopens;
* the next slot of a scheduled task (:mod:`sqla_outbox.relay.schedule`), which the active
  relay (the owner of partition 0) dispatches itself;
* with several partitions, the next rebalance (every ``relay_standby_poll_seconds``).

Stopping (:meth:`Relay.stop`, SIGTERM/SIGINT in the CLI) lets the pass in progress finish
and commit, releases the lock and returns. Losing the database ends leadership; the relay
reconnects with backoff and competes for the lock again.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path

import sqlalchemy as sa
from sqlalchemy.engine import Connection, Engine

from sqla_outbox import charsets, engines, flow, metrics, migrations
from sqla_outbox.catalog import Catalog
from sqla_outbox.config import OutboxSettings
from sqla_outbox.logging import error_fields, log_extra
from sqla_outbox.relay import claim
from sqla_outbox.relay.claim import ClaimedRow
from sqla_outbox.relay.depth import DepthGauge, auto_depth
from sqla_outbox.relay.fair import FairClaimer
from sqla_outbox.relay.hold import Holder
from sqla_outbox.relay.listen import NotifyListener, forward_wake
from sqla_outbox.relay.partitions import RELAY_APPLICATION_PREFIX, Ownership
from sqla_outbox.relay.pauses import split as split_paused
from sqla_outbox.relay.ratelimit import RateWindows
from sqla_outbox.relay.schedule import Scheduler
from sqla_outbox.relay.send import ENTRY, REFUSED, Sender, SendFailure, SendResult
from sqla_outbox.types import QUEUE_NAMES
from sqla_outbox.wakeup import WakeListener

logger = logging.getLogger(__name__)

_STATS_INTERVAL_SECONDS = 5.0

WAKE_HOLD_SECONDS = 0.05
"""After a wake-started pass that claimed nothing, the next wake is served no sooner than
this (at most 20 empty wake-driven passes a second, however fast the key is pushed)."""


@dataclasses.dataclass
class PassResult:
    """Outcome of one claim → send → mark pass.

    Attributes:
        claimed: Rows claimed. sent: Rows SQS accepted. failed: Rows SQS did not take
            (backed off or parked). parked: Of those, rows parked (SQS refuses them).
        stalled: The failed rows could not be recorded (they stay due): the relay waits
            its backoff before the next pass instead of retrying them at once.
        held: Rows kept pending because no live worker implements their task, or paused.
        throttled: Tenants with due rows left in the outbox by their rate limit.
        depth_bound: Queues whose due rows waited because SQS held ``relay_queue_depth``.
        full: Some table returned a full batch (more may be waiting).
        leader: This relay owned the outbox (or some of its partitions) for the pass. False
            only from :meth:`Relay.run_once` when other relays own every partition: nothing
            was done (they send the rows).
    """

    claimed: int = 0
    sent: int = 0
    failed: int = 0
    held: int = 0
    parked: int = 0
    full: bool = False
    leader: bool = True
    stalled: bool = False
    throttled: list[int] = dataclasses.field(default_factory=list)
    depth_bound: list[str] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class RelayCounters:
    """Totals since the relay started (also exported as Prometheus metrics)."""

    passes: int = 0
    sent: int = 0
    failed: int = 0
    leader_terms: int = 0


def _make_scheduler(settings: OutboxSettings, catalog: Catalog | None) -> Scheduler | None:
    if not settings.relay_scheduler:
        return None
    if catalog is None:
        catalog = scheduling_catalog(settings)
    scheduler = Scheduler(
        catalog, max_message_bytes=settings.max_message_bytes, tenant_foreign_key=settings.tenant_foreign_key
    )
    return scheduler if scheduler.tasks else None


def scheduling_catalog(settings: OutboxSettings, *, warn: bool = True) -> Catalog:
    """The catalog whose schedules the relay runs: the file at ``catalog_path``, or, when
    there is none, sqla_outbox's built-in tasks (``maintenance.purge``) with a warning, so
    a relay deployed without ``tasks.json`` still purges but says what it is missing.

    Raises:
        CatalogError: The file exists but is not a valid catalog.
    """
    path = Path(settings.catalog_path)
    if path.exists():
        return Catalog.load(path)
    from sqla_outbox.maintenance import builtin_catalog

    if warn:
        logger.warning(
            "no task catalog at %s: only the built-in schedules run (maintenance.purge); "
            "write it with `python -m sqla_outbox catalog write` and set SQLA_OUTBOX_CATALOG_PATH",
            path,
            extra=log_extra(action="relay.no_catalog", path=str(path)),
        )
    return builtin_catalog()


ENGINE_CONNECT_ARGS = engines.ENGINE_CONNECT_ARGS
"""Re-exported from :mod:`sqla_outbox.engines`, where it lives."""

make_engine = engines.make_engine
"""Re-exported from :mod:`sqla_outbox.engines`, where it lives."""


class Relay:
    """Relay process logic, usable in the foreground (:meth:`run`) or in a thread.

    Args:
        settings: Relay settings (sweep interval, batch size, backoff, lock id, ...).
        sender: What sends rows; default :class:`~sqla_outbox.relay.send.SqsSender` on a
            client from :func:`sqla_outbox.sqs.client.make_client`.
        engine: SQLAlchemy engine; default from ``settings.database_url``.
        name: Identifies this relay in logs (default ``<host>:<pid>``).
        catalog: Where scheduled tasks are declared (default: the file at
            ``catalog_path`` if it exists). Ignored when ``relay_scheduler`` is off.
        depth_reader: ``queue -> visible messages`` for the queue-depth bound; default
            GetQueueAttributes on the default sender's client; None with an injected
            ``sender``: no bound.
    """

    def __init__(
        self,
        settings: OutboxSettings,
        *,
        sender: Sender | None = None,
        engine: Engine | None = None,
        name: str | None = None,
        catalog: Catalog | None = None,
        depth_reader: Callable[[str], int] | None = None,
    ) -> None:
        self.settings = settings
        self.name = name or f"{socket.gethostname()}:{os.getpid()}"
        self.engine = engine or make_engine(settings, application_name=RELAY_APPLICATION_PREFIX + self.name)
        self._owns_engine = engine is None
        self._sender = sender
        self.counters = RelayCounters()
        self.is_leader = False
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._stats_due = 0.0
        self._wakes_held_until = 0.0
        self._again = False
        """Pass again at once, for the relay's own reasons (a full batch, a scheduled run)."""
        self._thread: threading.Thread | None = None
        self.scheduler = _make_scheduler(settings, catalog)
        self._next_slot_at: float | None = None
        self.holder = Holder() if settings.relay_hold_unserved else None
        self._backoff = 0.5
        self.fair = FairClaimer() if settings.relay_fairness else None
        self.rates = RateWindows()
        self._depth_reader = depth_reader
        self._depth: DepthGauge | None = None
        self._tenant_flow: dict[int, flow.TenantFlow] = {}
        self._tenant_flow_read_at = float("-inf")
        self._retry_in: float | None = None
        """Due rows wait for queue room or a rate window: pass again after this (seconds)."""
        self.throttled: set[int] = set()
        self.pauses = flow.PauseCache(settings.flow_refresh_seconds)
        self._shown_throttled: set[int] = set()
        self._workers_seen = 0
        self.ownership = Ownership(settings, self.name)
        self._rebalance_at = 0.0
        self._valkey_woken = False
        """The wake being served came through Valkey (pass it on to the other relays)."""
        self._valkey_listener: WakeListener | None = None

    # --- public control ------------------------------------------------------------------
    @property
    def sender(self) -> Sender:
        if self._sender is None:
            from sqla_outbox.relay.send import SqsSender
            from sqla_outbox.sqs.client import QueueDirectory, make_client

            # SendMessageBatch answers in milliseconds: a short read timeout and one retry
            # bound how long a hung endpoint keeps a pass (and its row locks) open
            client = make_client(
                self.settings,
                max_pool_connections=max(10, self.settings.relay_send_concurrency * 2),
                read_timeout_seconds=10,
                max_attempts=2,
            )
            directory = QueueDirectory(client, self.settings)
            self._sender = SqsSender(client, directory, self.settings)
            if self._depth_reader is None:
                from sqla_outbox.sqs.client import visible_messages

                self._depth_reader = lambda queue: visible_messages(client, directory, queue)
        return self._sender

    @property
    def depth(self) -> DepthGauge | None:
        """The queue-depth gauge (None: no bound: ``relay_queue_depth`` 0, fairness off, or
        an injected sender without a ``depth_reader``)."""
        if self._depth is None and self.settings.relay_fairness and self.settings.relay_queue_depth != 0:
            self.sender  # noqa: B018 (builds the default depth reader with the client)
            if self._depth_reader is not None:
                self._depth = DepthGauge(
                    self._depth_reader, poll_seconds=self.settings.relay_depth_poll_seconds
                )
        return self._depth

    def stop(self) -> None:
        """Ask the relay to finish the pass in progress and return from :meth:`run`."""
        self._stop.set()
        self._wake.set()

    def wake(self) -> None:
        """Start the next pass now (what a wake signal does)."""
        self._wake.set()

    @property
    def stopping(self) -> bool:
        return self._stop.is_set()

    def start_in_thread(self) -> threading.Thread:
        """Run :meth:`run` in a daemon thread (the relay-inside-a-worker mode)."""
        self._thread = threading.Thread(target=self.run, name="sqla-outbox-relay", daemon=True)
        self._thread.start()
        return self._thread

    def join(self, timeout: float | None = None) -> None:
        if self._thread is not None:
            self._thread.join(timeout)

    # --- main loop -----------------------------------------------------------------------
    def run(self) -> None:
        """Compete for leadership and relay until :meth:`stop` is called."""
        self._backoff = 0.5
        logger.info(
            "relay started",
            extra=log_extra(
                action="relay.started", relay=self.name, batch_size=self.settings.relay_batch_size
            ),
        )
        try:
            while not self._stop.is_set():
                try:
                    with self.engine.connect() as connection:
                        try:
                            # a standby keeps its session (and membership lock) while it
                            # waits, so status and the other relays see it; with partitions
                            # a relay leads while it owns none, so the others give it a share
                            while not self._stop.is_set():
                                if self.ownership.join(connection) or self.ownership.count > 1:
                                    self._lead(connection)
                                    break
                                self._stop.wait(self.settings.relay_standby_poll_seconds)
                            self.ownership.release(connection)
                        except sa.exc.DBAPIError:
                            # end the session, so every advisory lock it may still hold ends
                            # with it (a pooled connection would keep them)
                            connection.invalidate()
                            raise
                except sa.exc.DBAPIError as exc:
                    self.ownership.lost()
                    self._set_leader(False)
                    # the backoff grows until a pass succeeds (not merely until the lock is
                    # taken again), so a statement that fails every time is not retried twice
                    # a second forever
                    if migrations.is_missing_outbox_table(exc):
                        message = f"the outbox tables are missing ({migrations.MIGRATE_ADVICE}); retrying"
                    elif exc.connection_invalidated or isinstance(
                        exc, sa.exc.OperationalError | sa.exc.InterfaceError
                    ):
                        message = "relay lost the database; retrying"
                    else:
                        message = "relay pass failed in the database; retrying"
                    logger.warning(
                        message,
                        extra=log_extra(
                            action="relay.db_error", **error_fields(exc), retry_in_s=self._backoff
                        ),
                    )
                    self._stop.wait(self._backoff)
                    self._backoff = min(self._backoff * 2, 10.0)
        finally:
            self._set_leader(False)
            if self._sender is not None:
                self._sender.close()
            if self._owns_engine:
                self.engine.dispose()
            logger.info("relay stopped", extra=log_extra(action="relay.stopped", relay=self.name))

    def run_once(self) -> PassResult:
        """One pass over what this relay can take (for ``--once`` and scripts): the lock of
        the outbox, or with several partitions every partition no running relay owns.

        Returns:
            The pass's counts; ``PassResult(leader=False)`` (all counts 0) when other
            relays own everything and nothing was done.
        """
        with self.engine.connect() as connection:
            if not self.ownership.take_all_free(connection):
                return PassResult(leader=False)
            try:
                return self.pass_once(connection)
            finally:
                self.ownership.release(connection)

    # --- leadership ----------------------------------------------------------------------
    def _set_leader(self, leader: bool) -> None:
        if leader != self.is_leader:
            self.is_leader = leader
            metrics.RELAY_LEADER.set(1 if leader else 0)

    def _lead(self, connection: Connection) -> None:
        self._become_active()
        partitioned = self.ownership.count > 1
        self._sync_wake_listener()
        notify_listener = NotifyListener(
            self.settings,
            self._wake.set,
            enabled=True if partitioned else None,
            own_payload=f"relay:{self.name}",
        )
        notify_listener.start()
        self._rebalance_at = time.monotonic() + self.settings.relay_standby_poll_seconds
        try:
            self._again = True  # first pass at once
            result = PassResult()
            while not self._stop.is_set():
                woken = self._wait_for_work(connection, last_claimed=result.claimed)
                if self._stop.is_set():
                    break
                self._rebalance(connection)  # (with one partition: only looks for a mismatch)
                if partitioned:
                    self._sync_wake_listener()
                    if self._valkey_woken:  # even a relay that owns nothing: it took the push
                        self._valkey_woken = False
                        if self.ownership.relays > 1:
                            forward_wake(connection, f"relay:{self.name}")
                    if not self.ownership.owned:
                        continue
                result = self.pass_once(connection)
                metrics.RELAY_PASSES.labels(
                    "wake" if woken else "timer", "yes" if result.claimed else "no"
                ).inc()
                if woken and not result.claimed:  # a wake for nothing: hold the next one
                    self._wakes_held_until = time.monotonic() + WAKE_HOLD_SECONDS
                if result.stalled:
                    self._stop.wait(self._backoff)
                    self._backoff = min(self._backoff * 2, 10.0)
                else:
                    self._backoff = 0.5
                if self.scheduler is not None and self.ownership.runs_singletons and self._slot_due():
                    if self.scheduler.tick(connection):
                        self._again = True
                    self._plan_next_slot(connection)
                if result.full:
                    self._again = True
        finally:
            if self._valkey_listener is not None:
                self._valkey_listener.stop()
                self._valkey_listener = None
            notify_listener.stop()
            self.rates.forget()  # the next active relay seeds the windows from sent_at
            self.ownership.release(connection)
            self._set_leader(False)

    def _become_active(self) -> None:
        if self.ownership.owned and not self.is_leader:
            self.counters.leader_terms += 1
            logger.info(
                "relay is active",
                extra=log_extra(
                    action="relay.leader",
                    relay=self.name,
                    partitions=len(self.ownership.owned),
                    of=self.ownership.count,
                ),
            )
        self._set_leader(bool(self.ownership.owned))

    def _sync_wake_listener(self) -> None:
        """BLPOP on the wake key only while this relay owns partitions: a relay that owns
        none (waiting for a share, or beside relays of another ``relay_partitions``) would
        take pushes from the relays that send."""
        if self.ownership.owned and self._valkey_listener is None:
            partitioned = self.ownership.count > 1
            self._valkey_listener = WakeListener(
                self.settings, self._wake_from_valkey if partitioned else self._wake.set
            )
            self._valkey_listener.start()
        elif not self.ownership.owned and self._valkey_listener is not None:
            self._valkey_listener.stop()
            self._valkey_listener = None

    def _wake_from_valkey(self) -> None:
        self._valkey_woken = True
        self._wake.set()

    def _rebalance(self, connection: Connection) -> None:
        """With several partitions: every ``relay_standby_poll_seconds``, move toward an even
        split with the other relays; state kept per tenant (rate windows, the fair cursor)
        is dropped when partitions change hands, and re-read from the database."""
        now = time.monotonic()
        if now < self._rebalance_at:
            return
        self._rebalance_at = now + self.settings.relay_standby_poll_seconds
        if self.ownership.rebalance(connection):
            self.rates.forget()
            if self.settings.relay_fairness:
                self.fair = FairClaimer()
            if self.holder is not None:
                self.holder.reread_soon()
            self._again = True
        self._become_active()

    def _wait_for_work(self, connection: Connection, *, last_claimed: int) -> bool:
        """Wait for the next reason to pass; True when it is a wake (the listener or
        :meth:`wake`), False for the relay's own reasons (sweep, a delayed run's due time, a
        schedule slot, a full batch, the first pass)."""
        self._refresh_stats(connection)
        if self._again:
            self._again = False
            return False
        if not self._wake.is_set():
            timeout = self.settings.relay_sweep_interval_seconds
            due = (
                claim.seconds_until_next_due(connection, self.ownership.params())
                if self.ownership.owned
                else None
            )
            connection.commit()
            if due is not None:
                if due > 0:
                    timeout = min(timeout, due)  # the next delayed run, to the millisecond
                elif self._retry_in is not None:
                    # due rows wait for room in their queue or their tenant's rate window
                    timeout = min(timeout, self._retry_in)
                elif last_claimed:
                    return False  # became due since the last pass: go now
                else:
                    # due but the last pass could claim nothing: locked by another
                    # transaction; look again shortly rather than spin
                    timeout = min(timeout, 0.02)
            if self._next_slot_at is not None and self.ownership.runs_singletons:
                timeout = min(timeout, max(self._next_slot_at - time.monotonic(), 0.0))
            if self.ownership.count > 1:
                timeout = min(timeout, max(self._rebalance_at - time.monotonic(), 0.0))
            if not self._wake.wait(timeout):
                return False
        hold = self._wakes_held_until - time.monotonic()
        if hold > 0:
            self._stop.wait(hold)  # the last wake found nothing: a flood is not served faster
        self._wake.clear()
        return True

    def _slot_due(self) -> bool:
        return self._next_slot_at is None or time.monotonic() >= self._next_slot_at

    def _plan_next_slot(self, connection: Connection) -> None:
        assert self.scheduler is not None
        now = connection.execute(sa.text("SELECT clock_timestamp()")).scalar_one()
        connection.commit()
        wait = self.scheduler.seconds_until_next(now)
        self._next_slot_at = None if wait is None else time.monotonic() + wait

    def pass_once(self, connection: Connection) -> PassResult:
        """Claim, send and mark one batch per table in one transaction."""
        started = time.perf_counter()
        result = PassResult()
        limit = self.settings.relay_batch_size
        with connection.begin():
            partitions = self.ownership.params()
            if self.holder is not None:
                self.holder.refresh(connection, partitions)  # first: rows it releases are claimed below
            rows: list[ClaimedRow] = []
            if self.fair is not None:
                rows = self._fair_claim(connection, result)
            else:
                self._retry_in = None
                for table in claim.TABLES:
                    claimed = claim.claim(connection, table, limit=limit, partitions=partitions)
                    result.full = result.full or len(claimed) == limit
                    rows.extend(claimed)
            if rows:
                sendable = split_paused(connection, rows, self.pauses.refresh(connection))
                result.held = len(rows) - len(sendable)
                rows = sendable
            if self.holder is not None:
                sendable = self.holder.split(connection, rows) if rows else rows
                result.held += len(rows) - len(sendable)
                rows = sendable
            if not rows:
                result.claimed = result.held
                return result
            outcome: SendResult = self.sender.send(rows)
            self._count_sent(outcome.sent)
            for table in claim.TABLES:
                claim.mark_sent(connection, table, [r.id for r in outcome.sent if r.table == table])
            if outcome.failed:
                parked = self._record_failures(connection, outcome.failed)
                result.stalled = parked is None
                result.parked = parked or 0
        result.claimed = len(rows) + result.held
        result.sent, result.failed = len(outcome.sent), len(outcome.failed)
        self.counters.passes += 1
        self.counters.sent += result.sent
        self.counters.failed += result.failed
        duration = time.perf_counter() - started
        metrics.RELAY_PASS_SECONDS.observe(duration)
        logger.debug(
            "pass done",
            extra=log_extra(
                action="relay.pass",
                claimed=result.claimed,
                sent=result.sent,
                failed=result.failed,
                duration_ms=round(duration * 1000, 2),
            ),
        )
        return result

    # --- flow control ----------------------------------------------------------------------
    def _flow_settings(self, connection: Connection) -> dict[int, flow.TenantFlow]:
        """Tenant weights and rate-limit overrides, re-read every ``flow_refresh_seconds``."""
        now = time.monotonic()
        if now - self._tenant_flow_read_at >= self.settings.flow_refresh_seconds:
            self._tenant_flow = flow.tenants(connection)
            self._tenant_flow_read_at = now
        return self._tenant_flow

    def _limit_of(self, tenant: int) -> int | None:
        return flow.effective_limit(self.settings.tenant_rate_limit_per_minute, self._tenant_flow.get(tenant))

    def _fair_claim(self, connection: Connection, result: PassResult) -> list[ClaimedRow]:
        """Claim this pass's rows queue by queue (:mod:`sqla_outbox.relay.fair`)."""
        assert self.fair is not None
        settings = self._flow_settings(connection)
        weights = {t: f.weight for t, f in settings.items() if f.weight != 1}
        allowance = _Allowance(self, connection)
        batch = self.settings.relay_batch_size
        partitions = self.ownership.params()
        due = self.fair.discover(connection, most=batch * len(QUEUE_NAMES), partitions=partitions)
        # the gauge needs the SQS client: build it only once rows are due (a relay with
        # nothing to send never reaches SQS, as before fairness)
        depth = self.depth if due else None
        bound = self.settings.relay_queue_depth
        if depth is not None and bound is None:
            # the default bound follows the live workers (the last count seen, so a restart
            # of every worker does not flood SQS); before any worker was ever recorded (or
            # presence not read: relay_hold_unserved off) nothing is bounded, as nothing is held
            if self.holder is not None and self.holder.coverage.workers:
                self._workers_seen = self.holder.coverage.workers
            bound = (
                auto_depth(self.settings.worker_concurrency, self._workers_seen) if self._workers_seen else 0
            )
        rows: list[ClaimedRow] = []
        retry: list[float] = []
        throttled: set[int] = set()
        served: set[tuple[str, int]] = set()
        for queue, found in due.items():
            budget = batch
            if depth is not None and bound:
                # with several relays each takes its partitions' share of the queue's room
                budget = min(batch, math.ceil(depth.room(queue, bound) * self.ownership.share))
                if budget <= 0:
                    result.depth_bound.append(queue)
                    retry.append(depth.poll_seconds)
                    continue
            got = self.fair.claim_queue(
                connection,
                queue,
                found,
                budget=budget,
                weights=weights,
                allowance=allowance,
                partitions=partitions,
            )
            allowance.spend(got.rows)
            rows.extend(got.rows)
            throttled.update(got.throttled)
            served.update((queue, t) for t in got.served)
            if got.rows and len(got.rows) == budget:
                if budget == batch:
                    result.full = True
                elif depth is not None:
                    retry.append(depth.poll_seconds)  # the queue's room is used up
        self.fair.advance(served)
        for tenant in throttled:
            limit = self._limit_of(tenant)
            if limit:
                retry.append(self.rates.reopens_in(tenant, limit))
        if throttled:
            metrics.TENANT_THROTTLED_PASSES.inc()
        for queue in result.depth_bound:
            metrics.RELAY_DEPTH_BOUND.labels(queue).inc()
        result.throttled = sorted(throttled)
        self.throttled = throttled
        self._retry_in = max(0.005, min(retry)) if retry else None
        return rows

    def _count_sent(self, sent: list[ClaimedRow]) -> None:
        """Feed what SQS accepted to the rate windows and the depth gauge."""
        by_queue: dict[str, int] = {}
        by_tenant: dict[int, int] = {}
        for row in sent:
            by_queue[row.queue] = by_queue.get(row.queue, 0) + 1
            if row.tenant_id is not None and self._limit_of(row.tenant_id):
                by_tenant[row.tenant_id] = by_tenant.get(row.tenant_id, 0) + 1
        for tenant, count in by_tenant.items():
            self.rates.record(tenant, count)
        if self._depth is not None:
            for queue, count in by_queue.items():
                self._depth.sent(queue, count)

    def _record_failures(
        self, connection: Connection, failed: list[tuple[ClaimedRow, SendFailure]]
    ) -> int | None:
        """Back off or park the rows SQS did not take; return how many were parked (None:
        nothing could be recorded).

        Runs in a savepoint of the pass's transaction, after SQS accepted the other rows:
        whatever goes wrong here (it should not) is logged and rolled back to the
        savepoint, and the pass still commits ``sent_at`` of what SQS accepted, so an
        error after a send can never make the relay send the same messages again and
        again. The failed rows then stay pending as they were and are retried.
        """
        limit = self.settings.relay_max_send_attempts
        try:
            with connection.begin_nested():
                parked = 0
                for table in claim.TABLES:
                    retry: list[tuple[ClaimedRow, str]] = []
                    refuse: list[tuple[ClaimedRow, str, str]] = []
                    for row, failure in failed:
                        if row.table != table:
                            continue
                        if failure.kind == REFUSED or (failure.kind == ENTRY and row.attempts + 1 >= limit):
                            code = charsets.for_postgres(failure.code)[:200]
                            refuse.append((row, code, charsets.for_postgres(failure.message)[:2000]))
                        else:
                            retry.append((row, charsets.for_postgres(failure.text)[:2000]))
                    claim.mark_failed(
                        connection,
                        table,
                        retry,
                        base_seconds=self.settings.relay_backoff_base_seconds,
                        max_seconds=self.settings.relay_backoff_max_seconds,
                    )
                    claim.park(connection, table, refuse, relay=self.name)
                    for row, code, _ in refuse:
                        parked += 1
                        metrics.RELAY_PARKED.labels(row.queue, code).inc()
                        logger.error(
                            "row parked: SQS refuses its message",
                            extra=log_extra(
                                action="relay.parked",
                                run_id=str(row.run_id),
                                queue=row.queue,
                                error_code=code,
                                send_attempts=row.attempts + 1,
                            ),
                        )
                return parked
        except Exception as exc:
            logger.error(
                "could not record failed sends; the rows stay pending and are retried",
                exc_info=True,
                extra=log_extra(
                    action="relay.record_failed", error_type=type(exc).__name__, rows=len(failed)
                ),
            )
            return None

    def _refresh_stats(self, connection: Connection) -> None:
        now = time.monotonic()
        if now < self._stats_due:
            return
        self._stats_due = now + _STATS_INTERVAL_SECONDS
        self._refresh_pending_gauges(connection)
        waits = claim.oldest_due_ages(connection, sorted(self.throttled)) if self.throttled else {}
        connection.commit()
        for tenant in self._shown_throttled - set(waits):
            metrics.TENANT_THROTTLED.remove(str(tenant))
            metrics.TENANT_THROTTLED_WAIT.remove(str(tenant))
        for tenant, wait in waits.items():
            metrics.TENANT_THROTTLED.labels(str(tenant)).set(1)
            metrics.TENANT_THROTTLED_WAIT.labels(str(tenant)).set(wait)
        self._shown_throttled = set(waits)

    def _refresh_pending_gauges(self, connection: Connection) -> None:
        """The pending-rows gauges cover the whole outbox: with several relays only the
        owner of partition 0 exports them (the others clear theirs), so a sum over relays
        counts every row once."""
        if not self.ownership.runs_singletons:
            metrics.RELAY_PENDING.clear()
            metrics.RELAY_OLDEST_PENDING_AGE.clear()
            return
        stats = claim.pending_stats(connection)
        connection.commit()
        seen = set()
        for stat in stats:
            seen.add((stat.table, stat.queue))
            metrics.RELAY_PENDING.labels(stat.table, stat.queue).set(stat.pending)
            metrics.RELAY_OLDEST_PENDING_AGE.labels(stat.table, stat.queue).set(stat.oldest_due_age_seconds)
        for table in claim.TABLES:
            for queue in ("critical", "default", "bulk", "maintenance"):
                if (table, queue) not in seen:
                    metrics.RELAY_PENDING.labels(table, queue).set(0)
                    metrics.RELAY_OLDEST_PENDING_AGE.labels(table, queue).set(0)


class _Allowance:
    """Rows each tenant may still be sent in this pass under its rate limit (the mapping
    :meth:`FairClaimer.claim_queue` reads): the window's allowance less what earlier
    queues of the same pass claimed. Tenants without a limit are absent."""

    def __init__(self, relay: Relay, connection: Connection) -> None:
        self._relay = relay
        self._connection = connection
        self._spent: dict[int, int] = {}
        self._known: dict[int, int | None] = {}

    def get(self, tenant: int, default: int | None = None) -> int | None:
        if tenant not in self._known:
            limit = self._relay._limit_of(tenant)
            if limit is None:
                self._known[tenant] = None
            else:
                self._relay.rates.seed(self._connection, [tenant])
                self._known[tenant] = self._relay.rates.allowance({tenant: limit})[tenant]
        left = self._known[tenant]
        if left is None:
            return default
        return max(0, left - self._spent.get(tenant, 0))

    def spend(self, rows: list[ClaimedRow]) -> None:
        for row in rows:
            if row.tenant_id is not None:
                self._spent[row.tenant_id] = self._spent.get(row.tenant_id, 0) + 1
