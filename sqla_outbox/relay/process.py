"""The :class:`Relay`: when to pass (leadership, wakes, the sweep) around the pass itself.

:class:`Relay` competes for the outbox (or a share of its partitions:
:mod:`~sqla_outbox.relay.partitions`) on one connection, waits between passes for the first
reason to pass again, and runs each pass through its base
:class:`~sqla_outbox.relay.passes.PassRunner`. The narrative (election, what a pass does,
what ends a wait, stopping) is in :mod:`sqla_outbox.relay`.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path

import sqlalchemy as sa
from sqlalchemy.engine import Connection, Engine

from sqla_outbox import backoff, engines, metrics, migrations, presence
from sqla_outbox.catalog import Catalog
from sqla_outbox.config import OutboxSettings
from sqla_outbox.logging import error_fields, log_extra
from sqla_outbox.queues import BUILTIN_REGISTRY
from sqla_outbox.relay import claim, passes
from sqla_outbox.relay.fair import FairClaimer
from sqla_outbox.relay.listen import NotifyListener, forward_wake
from sqla_outbox.relay.partitions import RELAY_APPLICATION_PREFIX, Ownership
from sqla_outbox.relay.rescue import Rescuer
from sqla_outbox.relay.schedule import Scheduler
from sqla_outbox.relay.send import Sender
from sqla_outbox.wakeup import WakeListener

logger = logging.getLogger("sqla_outbox.relay")

_STATS_INTERVAL_SECONDS = 5.0

WAKE_HOLD_SECONDS = 0.05
"""After a wake-started pass that claimed nothing, the next wake is served no sooner than
this (at most 20 empty wake-driven passes a second, however fast the key is pushed)."""


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


class Relay(passes.PassRunner):
    """Relay process logic, usable in the foreground (:meth:`run`) or in a thread.

    Args:
        settings: Relay settings (sweep interval, batch size, backoff, lock id, ...).
        sender: What sends rows; default :class:`~sqla_outbox.relay.send.SqsSender` on a
            client from :func:`sqla_outbox.sqs.client.make_client`.
        engine: SQLAlchemy engine; default from ``settings.database_url``.
        name: Identifies this relay in logs (default ``<host>:<pid>``).
        catalog: Where scheduled tasks and declared queues are read (default: the file at
            ``catalog_path`` if it exists). Its schedules are ignored when
            ``relay_scheduler`` is off; its queues are the ones the relay's gauges report.
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
        name = name or f"{socket.gethostname()}:{os.getpid()}"
        if catalog is None and Path(settings.catalog_path).exists():
            catalog = Catalog.load(settings.catalog_path)
        super().__init__(
            settings,
            name=name,
            ownership=Ownership(settings, name),
            sender=sender,
            depth_reader=depth_reader,
            queues=catalog.queue_registry if catalog is not None else BUILTIN_REGISTRY,
        )
        self.engine = engine or engines.make_engine(
            settings, application_name=RELAY_APPLICATION_PREFIX + self.name
        )
        self._owns_engine = engine is None
        self.is_leader = False
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._stats_due = 0.0
        self._wakes_held_until = 0.0
        self._again = False
        """Pass again at once, for the relay's own reasons (a full batch, a scheduled run)."""
        self._thread: threading.Thread | None = None
        self.scheduler = _make_scheduler(settings, catalog)
        self.rescuer = Rescuer(settings, self.queues, name=self.name)
        self._next_slot_at: float | None = None
        self._backoff = backoff.Doubling(0.5, 10.0)
        """Wait between passes that failed in the database or stalled on SQS."""
        self._shown_throttled: set[int] = set()
        self._gauged: set[tuple[str, str]] = set()
        """(table, queue) pairs the pending gauges show."""
        self._rebalance_at = 0.0
        self._valkey_woken = False
        """The wake being served came through Valkey (pass it on to the other relays)."""
        self._valkey_listener: WakeListener | None = None

    # --- public control ------------------------------------------------------------------
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
        self._backoff.reset()
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
                            action="relay.db_error", **error_fields(exc), retry_in_s=self._backoff.current
                        ),
                    )
                    self._stop.wait(self._backoff.current)
                    self._backoff.grow()
        finally:
            self._set_leader(False)
            if self._sender is not None:
                self._sender.close()
            if self._owns_engine:
                self.engine.dispose()
            logger.info("relay stopped", extra=log_extra(action="relay.stopped", relay=self.name))

    def run_once(self) -> passes.PassResult:
        """One pass over what this relay can take (for ``--once`` and scripts): the lock of
        the outbox, or with several partitions every partition no running relay owns.

        Returns:
            The pass's counts; ``PassResult(leader=False)`` (all counts 0) when other
            relays own everything and nothing was done.
        """
        with self.engine.connect() as connection:
            if not self.ownership.take_all_free(connection):
                return passes.PassResult(leader=False)
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
            result = passes.PassResult()
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
                    self._stop.wait(self._backoff.current)
                    self._backoff.grow()
                else:
                    self._backoff.reset()
                if self.scheduler is not None and self.ownership.runs_singletons and self._slot_due():
                    if self.scheduler.tick(connection):
                        self._again = True
                    self._plan_next_slot(connection)
                if self.ownership.runs_singletons and self.rescuer.due() and self._rescue(connection):
                    self._again = True
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

    # --- waiting between passes ----------------------------------------------------------
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
            rescue_in = self.rescuer.seconds_until_due() if self.ownership.runs_singletons else None
            if rescue_in is not None:
                timeout = min(timeout, rescue_in)
            if self.ownership.count > 1:
                timeout = min(timeout, max(self._rebalance_at - time.monotonic(), 0.0))
            if not self._wake.wait(timeout):
                return False
        hold = self._wakes_held_until - time.monotonic()
        if hold > 0:
            self._stop.wait(hold)  # the last wake found nothing: a flood is not served faster
        self._wake.clear()
        return True

    def _rescue(self, connection: Connection) -> int:
        """One round of the rescuer (:mod:`sqla_outbox.relay.rescue`); returns runs rescued."""
        if self.holder is not None:
            self.holder.refresh(connection, self.ownership.params())
            coverage = self.holder.coverage
        else:
            coverage = presence.Coverage.of(presence.live_workers(connection))
        connection.commit()
        return self.rescuer.round(connection, coverage=coverage, visible=self.visible_messages).rescued

    def _slot_due(self) -> bool:
        return self._next_slot_at is None or time.monotonic() >= self._next_slot_at

    def _plan_next_slot(self, connection: Connection) -> None:
        assert self.scheduler is not None
        now = connection.execute(sa.text("SELECT clock_timestamp()")).scalar_one()
        connection.commit()
        wait = self.scheduler.seconds_until_next(now)
        self._next_slot_at = None if wait is None else time.monotonic() + wait

    # --- gauges ---------------------------------------------------------------------------
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
        counts every row once. A (table, queue) with nothing pending reads 0: every queue of
        the registry, and every queue the gauges showed before (a queue since removed from
        the catalog), so a drained queue never keeps its last backlog."""
        if not self.ownership.runs_singletons:
            metrics.RELAY_PENDING.clear()
            metrics.RELAY_OLDEST_PENDING_AGE.clear()
            self._gauged = set()
            return
        stats = claim.pending_stats(connection)
        connection.commit()
        seen = set()
        for stat in stats:
            seen.add((stat.table, stat.queue))
            metrics.RELAY_PENDING.labels(stat.table, stat.queue).set(stat.pending)
            metrics.RELAY_OLDEST_PENDING_AGE.labels(stat.table, stat.queue).set(stat.oldest_due_age_seconds)
        known = {(table, queue) for table in claim.TABLES for queue in self.queues.names}
        for table, queue in (known | self._gauged) - seen:
            metrics.RELAY_PENDING.labels(table, queue).set(0)
            metrics.RELAY_OLDEST_PENDING_AGE.labels(table, queue).set(0)
        self._gauged = known | seen
