"""One relay pass: claim due rows, send them to SQS, mark them, commit.

:class:`PassRunner` holds what a pass needs and keeps between passes (the sender, the
queue-depth gauge, the tenants' rate windows and flow settings, the fair cursor, the hold
on unserved tasks); :class:`~sqla_outbox.relay.Relay` adds when to pass (leadership, wakes,
the sweep) around it. The narrative is in :mod:`sqla_outbox.relay`.

The pass runs in one transaction on the connection that holds the relay's lock: claim
(``FOR UPDATE SKIP LOCKED``: :mod:`~sqla_outbox.relay.fair` with ``relay_fairness``, else
:mod:`~sqla_outbox.relay.claim` per outbox table), set aside paused rows
(:mod:`~sqla_outbox.relay.pauses`) and rows no live worker serves
(:mod:`~sqla_outbox.relay.hold`), send (:mod:`~sqla_outbox.relay.send`), mark accepted rows
``sent_at`` and back off or park the others, commit.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import Callable

from sqlalchemy.engine import Connection

from sqla_outbox import charsets, flow, metrics
from sqla_outbox.config import OutboxSettings
from sqla_outbox.logging import log_extra
from sqla_outbox.queues import BUILTIN_REGISTRY, QueueRegistry
from sqla_outbox.relay import claim
from sqla_outbox.relay.claim import ClaimedRow
from sqla_outbox.relay.depth import DepthGauge, auto_depth
from sqla_outbox.relay.fair import FairClaimer
from sqla_outbox.relay.hold import Holder
from sqla_outbox.relay.partitions import Ownership
from sqla_outbox.relay.pauses import split as split_paused
from sqla_outbox.relay.ratelimit import RateWindows
from sqla_outbox.relay.send import ENTRY, REFUSED, Sender, SendFailure, SendResult

logger = logging.getLogger("sqla_outbox.relay")


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
            only from :meth:`~sqla_outbox.relay.Relay.run_once` when other relays own every
            partition: nothing was done (they send the rows).
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


class PassRunner:
    """The pass and the state it keeps between passes; the base of
    :class:`~sqla_outbox.relay.Relay`, which decides when to call :meth:`pass_once`.

    Args:
        settings: Relay settings (batch size, fairness, rate limits, backoff, ...).
        name: Identifies the relay in logs and in parked rows (``<host>:<pid>``).
        ownership: The outbox partitions the relay owns; claims are limited to them.
        sender: What sends rows; None: :class:`~sqla_outbox.relay.send.SqsSender` on a
            client from :func:`sqla_outbox.sqs.client.make_client`, built on first use.
        depth_reader: ``queue -> visible messages`` for the queue-depth bound; None with
            the default sender: GetQueueAttributes on its client; None with an injected
            ``sender``: no bound.
        queues: The queues the relay knows (built-in and the catalog's declared ones).
    """

    def __init__(
        self,
        settings: OutboxSettings,
        *,
        name: str,
        ownership: Ownership,
        sender: Sender | None,
        depth_reader: Callable[[str], int] | None,
        queues: QueueRegistry = BUILTIN_REGISTRY,
    ) -> None:
        self.settings = settings
        self.queues = queues
        self.name = name
        self.ownership = ownership
        self._sender = sender
        self.counters = RelayCounters()
        self.holder = Holder() if settings.relay_hold_unserved else None
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
        self._workers_seen = 0

    # --- sending -------------------------------------------------------------------------
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

    def visible_messages(self, queue: str) -> int | None:
        """SQS's ``ApproximateNumberOfMessages`` of ``queue``; None when it cannot be read
        (or an injected sender came without a ``depth_reader``)."""
        self.sender  # noqa: B018 (builds the default depth reader with the client)
        if self._depth_reader is None:
            return None
        try:
            return int(self._depth_reader(queue))
        except Exception:
            return None

    # --- the pass ------------------------------------------------------------------------
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
        due = self.fair.discover(connection, most=batch * len(self.queues), partitions=partitions)
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


class _Allowance:
    """Rows each tenant may still be sent in this pass under its rate limit (the mapping
    :meth:`FairClaimer.claim_queue` reads): the window's allowance less what earlier
    queues of the same pass claimed. Tenants without a limit are absent."""

    def __init__(self, relay: PassRunner, connection: Connection) -> None:
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
