"""The admission gate: per-task rate limits, concurrency slots, circuit breakers, tenant shares.

Before a worker takes a run's lease, a task that declared flow control
(:mod:`sqla_outbox.worker.limits`) asks the gate. One atomic Lua script on Valkey
(:class:`~sqla_outbox.wakeup.ScriptRunner`) checks, in order, the task's breaker, its
concurrency cap and its rate limit, and only when all three allow it records the
admission in each (so a refused run consumes nothing). A refused run is deferred
through the outbox by the caller (:mod:`sqla_outbox.worker.deferral`): no attempt, no
receive and no DLQ are spent on it (ADR 0010, 0014).

State in Valkey, under ``sqla_outbox:limits:<queue_prefix>`` (so deployments and tests
sharing a Valkey do not meet):

* ``rate:<task>``: sorted set of admissions scored by their time (ms); at most ``count``
  within any ``period`` (a sliding-window log, as the BullMQ design's limiter).
  ``rate-next:<task>`` spreads refused runs: each gets the next free moment ``period/count``
  after the previous refused one, so a backlog comes back at the allowed rate rather than
  all at once.
* ``slots:<task>``: sorted set of held concurrency slots scored by lease expiry (ms). The
  heartbeat renews held slots every third of ``limits_slot_lease_seconds``; a worker
  killed with ``kill -9`` stops renewing, and its slot stops counting when the lease ends.
* ``breaker:<key>`` (hash: state, failures, successes, open_until, changed_at, epoch,
  outage_since) and ``probes:<key>`` (half-open probes in flight, leased like slots).
  Closed: ``failures`` failures in a row open it. Open: nothing is admitted until
  ``open_until``; the first admission after that moves it to half-open. Half-open: at
  most ``successes`` probes at a time; ``successes`` successes close it, one failure opens
  it again.
* **Only outcomes of the current period count.** ``epoch`` numbers the breaker's periods
  (every transition starts a new one); an admission carries the epoch it was admitted in,
  and its outcome changes the breaker only while that epoch is still the current one. So
  only probes admitted in this half-open period can close it or open it again, and a run
  admitted while it was closed that ends after it opened (or, later, while it probes)
  counts for nothing: its call may have been made before the integration went down or
  came back. ``outage_since`` is when the breaker last left closed (the outage's age is
  what :func:`sqla_outbox.lifecycle.verdict.ride_out` compares with the breaker's
  ``max_outage_seconds``).
* ``index``: hash of what workers declared (tasks' limits, breakers' settings), for
  ``status`` and the dashboard.

The clock is Valkey's (``TIME`` inside the scripts), so worker clocks never disagree.

**Tenant shares** (webhook deliveries, ``webhooks.deliver``): one tenant's runs of such a
task may hold at most ``webhook_tenant_slot_share`` of this worker's slots at once
(``worker_concurrency`` x share, at least one), so a tenant whose receivers answer slowly
cannot hold the slots other tenants' runs need. This is a property of one worker's slots,
so it is counted in the process, not in Valkey; a run over it is refused with reason
``tenant-share`` and deferred like a run refused by a full concurrency cap.

**Valkey down** (a call fails or takes longer than ``limits_valkey_timeout_ms``): every
limit is enforced *per worker process* from local state, with the same rules, until
Valkey answers again (tried every ``limits_valkey_retry_seconds``); logged once as
``limits.valkey_lost`` and counted. That is fail-open to a bounded degree: a Valkey
outage must not stop every limited task (Valkey is a hint everywhere else in
sqla_outbox; PostgreSQL holds the truth), while a downstream API still sees at most
``processes x limit`` instead of no limit at all.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import logging
import math
import random
import threading
import time
import uuid
from typing import Any

from sqla_outbox import metrics, webhooks
from sqla_outbox.config import OutboxSettings
from sqla_outbox.lifecycle import retry
from sqla_outbox.logging import log_extra
from sqla_outbox.wakeup import ScriptRunner, ValkeyUnavailable
from sqla_outbox.worker.limits import Breaker, TaskLimits

logger = logging.getLogger("sqla_outbox.worker")

BREAKER_STATES = ("closed", "half_open", "open")
"""Breaker states; the ``sqla_outbox_breaker_state`` gauge is the index (0, 1, 2)."""

REASONS = {
    "rate": "rate-limit",
    "concurrency": "concurrency",
    "open": "breaker-open",
    "probing": "breaker-probing",
}
"""Gate refusal code → the deferral reason recorded in the trail and metrics."""

TENANT_SHARE = "tenant-share"
"""Deferral reason of a run refused because its tenant holds its share of the slots."""

TENANT_SHARE_TASKS = frozenset({webhooks.WEBHOOK_TASK})
"""Tasks whose runs count against their tenant's share of a worker's slots."""

OUTCOMES = ("success", "failure", "neutral", "refund")
"""How an admitted run ended, for :meth:`Gate.release`: ``success`` and ``failure`` count
for its breaker; ``neutral`` (a permanent error, a lost lease, a shutdown) does not;
``refund`` also gives back its rate-limit admission (the run was not executed)."""

# KEYS: rate, rate-next, slots, breaker, probes
# ARGV: member, rate_count, rate_period_ms, concurrency, lease_ms, breaker_on, probes_max
# Returns: code, wait (ms), breaker state, transition, breaker epoch of the admission
_ADMIT = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local member = ARGV[1]
local rate_n, period = tonumber(ARGV[2]), tonumber(ARGV[3])
local conc, lease = tonumber(ARGV[4]), tonumber(ARGV[5])
local breaker_on, probes_max = tonumber(ARGV[6]), tonumber(ARGV[7])
local state, transition, probe, epoch = 'closed', '', 0, 0
if breaker_on == 1 then
  state = redis.call('HGET', KEYS[4], 'state') or 'closed'
  if state == 'open' then
    local open_until = tonumber(redis.call('HGET', KEYS[4], 'open_until') or '0')
    if now < open_until then return {'open', open_until - now, state, transition, 0} end
    redis.call('HSET', KEYS[4], 'state', 'half_open', 'successes', 0, 'changed_at', now)
    redis.call('HINCRBY', KEYS[4], 'epoch', 1)
    redis.call('DEL', KEYS[5])
    state, transition = 'half_open', 'open>half_open'
  end
  epoch = tonumber(redis.call('HGET', KEYS[4], 'epoch') or '0')
  if state == 'half_open' then
    redis.call('ZREMRANGEBYSCORE', KEYS[5], '-inf', now)
    if redis.call('ZCARD', KEYS[5]) >= probes_max then return {'probing', 0, state, transition, epoch} end
    probe = 1
  end
end
if conc > 0 then
  redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', now)
  if redis.call('ZCARD', KEYS[3]) >= conc then return {'concurrency', 0, state, transition, epoch} end
end
if rate_n > 0 then
  redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now - period)
  if redis.call('ZCARD', KEYS[1]) >= rate_n then
    local oldest = tonumber(redis.call('ZRANGE', KEYS[1], 0, 0, 'WITHSCORES')[2])
    local at = math.max(oldest + period, tonumber(redis.call('GET', KEYS[2]) or '0'))
    local after = at + math.ceil(period / rate_n)
    redis.call('SET', KEYS[2], after, 'PX', math.max(period * 2, after - now + period))
    return {'rate', at - now, state, transition, epoch}
  end
  redis.call('ZADD', KEYS[1], now, member)
  redis.call('PEXPIRE', KEYS[1], period)
end
if conc > 0 then
  redis.call('ZADD', KEYS[3], now + lease, member)
  redis.call('PEXPIRE', KEYS[3], lease * 2)
end
if probe == 1 then
  redis.call('ZADD', KEYS[5], now + lease, member)
  redis.call('PEXPIRE', KEYS[5], lease * 2)
end
return {'ok', 0, state, transition, epoch}
"""

# KEYS: rate, slots, breaker, probes
# ARGV: member, outcome, breaker_on, failures_max, open_ms, successes_max, admission epoch
# Returns: state, transition, counted (0/1), outage age (ms, -1 while closed), admits in (ms)
_RELEASE = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local member, outcome = ARGV[1], ARGV[2]
redis.call('ZREM', KEYS[2], member)
redis.call('ZREM', KEYS[4], member)
if outcome == 'refund' then redis.call('ZREM', KEYS[1], member) end
if tonumber(ARGV[3]) ~= 1 then return {'', '', 0, -1, 0} end
local h = redis.call('HMGET', KEYS[3], 'state', 'epoch')
local state = h[1] or 'closed'
local current = tonumber(h[2] or '0')
local transition, counted = '', 0
if tonumber(ARGV[7]) == current and (outcome == 'failure' or outcome == 'success') then
  counted = 1
  if outcome == 'failure' then
    if state == 'half_open' then
      transition = 'half_open>open'
    elseif state == 'closed' then
      local streak = redis.call('HINCRBY', KEYS[3], 'failures', 1)
      if streak >= tonumber(ARGV[4]) then transition = 'closed>open' end
    end
    if transition ~= '' then
      redis.call('HSET', KEYS[3], 'state', 'open', 'open_until', now + tonumber(ARGV[5]),
                 'failures', 0, 'successes', 0, 'changed_at', now)
      redis.call('HSETNX', KEYS[3], 'outage_since', now)
      redis.call('HINCRBY', KEYS[3], 'epoch', 1)
      redis.call('DEL', KEYS[4])
      state = 'open'
    end
  elseif state == 'closed' then
    redis.call('HSET', KEYS[3], 'failures', 0)
  elseif state == 'half_open' then
    if redis.call('HINCRBY', KEYS[3], 'successes', 1) >= tonumber(ARGV[6]) then
      redis.call('HSET', KEYS[3], 'state', 'closed', 'failures', 0, 'successes', 0, 'changed_at', now)
      redis.call('HDEL', KEYS[3], 'outage_since')
      redis.call('HINCRBY', KEYS[3], 'epoch', 1)
      redis.call('DEL', KEYS[4])
      state, transition = 'closed', 'half_open>closed'
    end
  end
end
local outage, admits = -1, 0
if state ~= 'closed' then
  local o = redis.call('HMGET', KEYS[3], 'outage_since', 'open_until')
  outage = now - tonumber(o[1] or now)
  if state == 'open' then admits = math.max(0, tonumber(o[2] or now) - now) end
end
redis.call('PEXPIRE', KEYS[3], 604800000)
return {state, transition, counted, outage, admits}
"""

# KEYS: sorted sets holding ARGV[i + 1]; ARGV[1]: lease (ms). Returns how many were still held.
_RENEW = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local lease, held = tonumber(ARGV[1]), 0
for i, key in ipairs(KEYS) do
  held = held + redis.call('ZADD', key, 'XX', 'CH', now + lease, ARGV[i + 1])
  redis.call('PEXPIRE', key, lease * 2)
end
return held
"""

# KEYS[1]: index hash; ARGV[1]: key prefix. For status: each declared task's live slots and
# admissions in its current window, each breaker's state (open_until as ms from now), its
# outage's age (ms, -1 while closed) and its max_outage_seconds (``horizon:<key>``, kept
# apart from ``breaker:<key>`` so that the status command of an earlier release, which
# builds a Breaker from every field of that JSON, still reads it).
_SNAPSHOT = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local index = redis.call('HGETALL', KEYS[1])
local out = {}
for i = 1, #index, 2 do
  local field, value = index[i], index[i + 1]
  local kind, name = string.match(field, '^(%a+):(.+)$')
  if kind == 'task' then
    local info = cjson.decode(value)
    local slots = redis.call('ZCOUNT', ARGV[1] .. 'slots:' .. name, '(' .. now, '+inf')
    local used = 0
    if type(info.period_seconds) == 'number' then
      local since = now - info.period_seconds * 1000
      used = redis.call('ZCOUNT', ARGV[1] .. 'rate:' .. name, '(' .. since, '+inf')
    end
    table.insert(out, {'task', name, value, slots, used, 0, 0})
  elseif kind == 'breaker' then
    local key = ARGV[1] .. 'breaker:' .. name
    local h = redis.call('HMGET', key, 'state', 'failures', 'open_until', 'changed_at', 'outage_since')
    local probes = redis.call('ZCOUNT', ARGV[1] .. 'probes:' .. name, '(' .. now, '+inf')
    local left = math.max(0, tonumber(h[3] or '0') - now)
    local since = h[4] and (now - tonumber(h[4])) or -1
    local outage = h[5] and (now - tonumber(h[5])) or -1
    local horizon = redis.call('HGET', KEYS[1], 'horizon:' .. name) or ''
    table.insert(out, {'breaker', name, value, h[1] or 'closed', tonumber(h[2] or '0'), left, since, probes,
                       outage, horizon})
  end
end
return out
"""

# KEYS[1]: index hash; ARGV: field, value, field, value, ...
_PUBLISH = """
for i = 1, #ARGV, 2 do redis.call('HSET', KEYS[1], ARGV[i], ARGV[i + 1]) end
return #ARGV / 2
"""


def key_prefix(settings: OutboxSettings) -> str:
    """Where the gate's keys live in Valkey: ``sqla_outbox:limits:<queue_prefix>``."""
    return f"sqla_outbox:limits:{settings.queue_prefix}"


@dataclasses.dataclass
class Admission:
    """A run the gate let through; give it back with :meth:`Gate.release`.

    Attributes:
        member: Its id in the gate's sets (``<worker_id>:<run_id>:<n>``).
        task: Task name. limits: The task's declarations.
        shared: Admitted through Valkey (False: by this process's local state).
        holds: Sorted-set keys holding ``member`` under a lease (slots, probes).
        renewed_at: ``time.monotonic()`` of the admission or last renewal.
        epoch: The breaker's period it was admitted in (its outcome counts only while
            that period lasts). probe: Admitted as a half-open probe.
        share: The tenant share it counts against (``<task>:<tenant>``), or None.
    """

    member: str
    task: str
    limits: TaskLimits
    shared: bool
    holds: list[str]
    renewed_at: float = dataclasses.field(default_factory=time.monotonic)
    epoch: int = 0
    probe: bool = False
    share: str | None = None


@dataclasses.dataclass(frozen=True)
class Released:
    """What :meth:`Gate.release` left of the admission's breaker.

    Attributes:
        state: The breaker's state after the outcome was recorded (``closed``,
            ``half_open``, ``open``); None for a task without a breaker.
        transition: ``before>after`` when this outcome moved it, else ``""``.
        counted: Whether the outcome counted for the breaker (it was admitted in the
            breaker's current period, and was a success or a failure).
        outage_seconds: Time since the breaker last left ``closed``; None while closed.
        admits_in_seconds: While open: until its next probe may be admitted (else 0).
    """

    state: str | None = None
    transition: str = ""
    counted: bool = False
    outage_seconds: float | None = None
    admits_in_seconds: float = 0.0


@dataclasses.dataclass(frozen=True)
class Verdict:
    """The gate's answer. Either ``admission`` is set, or ``reason`` and ``wait_seconds``.

    Attributes:
        admission: The run may run now.
        reason: Deferral reason (:data:`REASONS` values).
        wait_seconds: For ``rate-limit`` and ``breaker-open``: when the run may be admitted
            (seconds from now); None for ``concurrency``/``breaker-probing`` (unknown: the
            caller backs off).
    """

    admission: Admission | None = None
    reason: str | None = None
    wait_seconds: float | None = None


class _LocalState:
    """The same rules as the Lua scripts, in this process only (while Valkey is down)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.rate: dict[str, collections.deque[tuple[float, str]]] = collections.defaultdict(
            collections.deque
        )
        self.rate_next: dict[str, float] = {}
        self.slots: dict[str, set[str]] = collections.defaultdict(set)
        self.breakers: dict[str, dict[str, Any]] = {}
        self.probes: dict[str, set[str]] = collections.defaultdict(set)
        self.shares: dict[str, set[str]] = collections.defaultdict(set)

    def take_share(self, key: str, cap: int, member: str) -> bool:
        """Count ``member`` against the tenant share ``key`` unless ``cap`` are counted."""
        with self.lock:
            if len(self.shares[key]) >= cap:
                return False
            self.shares[key].add(member)
            return True

    def drop_share(self, key: str | None, member: str) -> None:
        if key is None:
            return
        with self.lock:
            held = self.shares.get(key)
            if held is not None:
                held.discard(member)
                if not held:
                    del self.shares[key]

    def _record(self, key: str) -> dict[str, Any]:
        return self.breakers.setdefault(key, {"state": "closed", "failures": 0, "successes": 0, "epoch": 0})

    def admit(self, task: str, limits: TaskLimits, breaker: Breaker | None, member: str) -> tuple[Any, ...]:
        now = time.monotonic()
        with self.lock:
            state, transition, probe, epoch = "closed", "", False, 0
            if breaker is not None:
                record = self._record(breaker.key)
                state = record["state"]
                if state == "open":
                    if now < record["open_until"]:
                        return ("open", record["open_until"] - now, state, transition, 0)
                    record.update(state="half_open", successes=0, epoch=record["epoch"] + 1)
                    self.probes[breaker.key].clear()
                    state, transition = "half_open", "open>half_open"
                epoch = record["epoch"]
                if state == "half_open":
                    if len(self.probes[breaker.key]) >= breaker.successes:
                        return ("probing", 0.0, state, transition, epoch)
                    probe = True
            if limits.concurrency is not None and len(self.slots[task]) >= limits.concurrency:
                return ("concurrency", 0.0, state, transition, epoch)
            if limits.rate is not None:
                window, period = self.rate[task], float(limits.rate.period_seconds)
                while window and window[0][0] <= now - period:
                    window.popleft()
                if len(window) >= limits.rate.count:
                    at = max(window[0][0] + period, self.rate_next.get(task, 0.0))
                    self.rate_next[task] = at + period / limits.rate.count
                    return ("rate", at - now, state, transition, epoch)
                window.append((now, member))
            if limits.concurrency is not None:
                self.slots[task].add(member)
            if probe and breaker is not None:
                self.probes[breaker.key].add(member)
            return ("ok", 0.0, state, transition, epoch)

    def release(self, admission: Admission, outcome: str, breaker: Breaker | None) -> Released:
        """As ``_RELEASE``. An admission made through Valkey (``admission.shared``) and
        released here, Valkey having gone away meanwhile, frees its local share but counts
        for no breaker: its epoch is Valkey's, not this process's."""
        now = time.monotonic()
        with self.lock:
            self.slots[admission.task].discard(admission.member)
            if outcome == "refund":
                window = self.rate[admission.task]
                for entry in [e for e in window if e[1] == admission.member]:
                    window.remove(entry)
            if breaker is None:
                return Released()
            self.probes[breaker.key].discard(admission.member)
            record = self._record(breaker.key)
            state, transition = record["state"], ""
            counted = (
                not admission.shared
                and admission.epoch == record["epoch"]
                and outcome in ("success", "failure")
            )
            if counted and outcome == "failure":
                if state == "half_open":
                    transition = "half_open>open"
                elif state == "closed":
                    record["failures"] += 1
                    if record["failures"] >= breaker.failures:
                        transition = "closed>open"
                if transition:
                    record.update(
                        state="open",
                        open_until=now + breaker.open_seconds,
                        failures=0,
                        successes=0,
                        epoch=record["epoch"] + 1,
                    )
                    record.setdefault("outage_since", now)
                    self.probes[breaker.key].clear()
                    state = "open"
            elif counted and state == "closed":
                record["failures"] = 0
            elif counted and state == "half_open":
                record["successes"] += 1
                if record["successes"] >= breaker.successes:
                    record.update(state="closed", failures=0, successes=0, epoch=record["epoch"] + 1)
                    record.pop("outage_since", None)
                    self.probes[breaker.key].clear()
                    state, transition = "closed", "half_open>closed"
            outage = None if state == "closed" else now - record.get("outage_since", now)
            admits = max(0.0, record.get("open_until", now) - now) if state == "open" else 0.0
            return Released(state, transition, counted, outage, admits)


class Gate:
    """Admits runs of tasks with flow control; one per worker process (``runtime.gate``).

    Its methods block (Valkey round trips): call them through ``runtime.io``.

    Args:
        settings: ``valkey_url`` (None: limits are per process only, with a warning at
            start), ``limits_*`` settings, ``queue_prefix`` (key namespace).
        breakers: Breaker settings by key (``Registry.breakers``).
        worker_id: Part of each admission's member id.
    """

    def __init__(self, settings: OutboxSettings, *, breakers: dict[str, Breaker], worker_id: str) -> None:
        self.settings = settings
        self.breakers = breakers
        self.worker_id = worker_id
        self.prefix = key_prefix(settings)
        self.lease_ms = int(settings.limits_slot_lease_seconds * 1000)
        self.runner = (
            ScriptRunner(settings.valkey_url, timeout_seconds=settings.limits_valkey_timeout_ms / 1000)
            if settings.valkey_url
            else None
        )
        self.local = _LocalState()
        self.held: dict[str, Admission] = {}
        self._lock = threading.Lock()
        self._counter = 0
        self._suppressed_until = 0.0
        self._in_outage = False

    # --- keys -------------------------------------------------------------------------------
    def _keys(self, task: str, breaker: Breaker | None) -> dict[str, str]:
        key = breaker.key if breaker is not None else "-"
        return {
            "rate": f"{self.prefix}rate:{task}",
            "rate_next": f"{self.prefix}rate-next:{task}",
            "slots": f"{self.prefix}slots:{task}",
            "breaker": f"{self.prefix}breaker:{key}",
            "probes": f"{self.prefix}probes:{key}",
        }

    def breaker_for(self, limits: TaskLimits) -> Breaker | None:
        """The settings of the breaker ``limits`` names (as declared for its key), or None."""
        if limits.breaker is None:
            return None
        return self.breakers.get(limits.breaker.key, limits.breaker)

    @property
    def tenant_slots(self) -> int:
        """Slots one tenant's runs of a :data:`TENANT_SHARE_TASKS` task may hold at once:
        ``worker_concurrency`` x ``webhook_tenant_slot_share``, rounded down, at least 1."""
        share = self.settings.webhook_tenant_slot_share
        return max(1, math.floor(self.settings.worker_concurrency * share + 1e-9))

    def counts_shares(self, task: str) -> bool:
        """Whether runs of ``task`` count against their tenant's share of the slots."""
        return task in TENANT_SHARE_TASKS and self.tenant_slots < self.settings.worker_concurrency

    # --- admission ------------------------------------------------------------------------
    def admit(
        self, task: str, limits: TaskLimits, run_id: uuid.UUID, tenant_id: int | None = None
    ) -> Verdict:
        """Ask to run one run of ``task`` (of ``tenant_id``) now (see the module docstring).

        Returns:
            A :class:`Verdict`; never raises for Valkey trouble (per-process limits then).
            ``tenant-share`` (no wait known: the caller backs off) when the tenant holds
            its share of this worker's slots.
        """
        with self._lock:
            self._counter += 1
            member = f"{self.worker_id}:{run_id}:{self._counter}"
        share = f"{task}:{tenant_id}" if tenant_id is not None and self.counts_shares(task) else None
        if share is not None and not self.local.take_share(share, self.tenant_slots, member):
            metrics.GATE_REFUSALS.labels(task, TENANT_SHARE).inc()
            return Verdict(reason=TENANT_SHARE)
        if not limits.any:  # only the share
            admission = Admission(member, task, limits, False, [], share=share)
            with self._lock:
                self.held[member] = admission
            return Verdict(admission=admission)
        breaker = self.breaker_for(limits)
        keys = self._keys(task, breaker)
        reply: tuple[Any, ...] | None = None
        if self._use_valkey():
            try:
                assert self.runner is not None
                raw = self.runner.run(
                    _ADMIT,
                    [keys["rate"], keys["rate_next"], keys["slots"], keys["breaker"], keys["probes"]],
                    [
                        member,
                        limits.rate.count if limits.rate else 0,
                        limits.rate.period_seconds * 1000 if limits.rate else 0,
                        limits.concurrency or 0,
                        self.lease_ms,
                        1 if breaker else 0,
                        breaker.successes if breaker else 0,
                    ],
                )
                epoch = int(raw[4]) if len(raw) > 4 else 0
                reply = (_text(raw[0]), float(raw[1]) / 1000, _text(raw[2]), _text(raw[3]), epoch)
                self._valkey_answered()
            except ValkeyUnavailable as exc:
                self._valkey_failed(exc)
        shared = reply is not None
        if reply is None:
            reply = self.local.admit(task, limits, breaker, member)
        code, wait, state, transition, epoch = reply
        if breaker is not None:
            self._observe(breaker.key, state, transition, shared=shared)
        if code != "ok":
            self.local.drop_share(share, member)
            metrics.GATE_REFUSALS.labels(task, REASONS[code]).inc()
            known = code in ("rate", "open")
            return Verdict(reason=REASONS[code], wait_seconds=max(0.0, wait) if known else None)
        holds = []
        if limits.concurrency is not None:
            holds.append(keys["slots"])
        probe = breaker is not None and state == "half_open"
        if probe:
            holds.append(keys["probes"])
        admission = Admission(member, task, limits, shared, holds, epoch=epoch, probe=probe, share=share)
        with self._lock:
            self.held[member] = admission
        metrics.SLOTS_HELD.labels(task).inc()
        return Verdict(admission=admission)

    def release(self, admission: Admission, outcome: str) -> Released:
        """Give back an admission: free its slot and probe, record ``outcome`` (one of
        :data:`OUTCOMES`) on its breaker when the admission belongs to the breaker's
        current period (see the module docstring). Never raises; a slot Valkey could not
        free expires with its lease.

        Returns:
            The breaker as the outcome left it (:class:`Released`; empty for a task
            without a breaker, or an admission already given back).
        """
        with self._lock:
            if self.held.pop(admission.member, None) is None:
                return Released()
        self.local.drop_share(admission.share, admission.member)
        if not admission.limits.any:
            return Released()
        metrics.SLOTS_HELD.labels(admission.task).dec()
        breaker = self.breaker_for(admission.limits)
        keys = self._keys(admission.task, breaker)
        released: Released | None = None
        if admission.shared and self._use_valkey():
            try:
                assert self.runner is not None
                raw = self.runner.run(
                    _RELEASE,
                    [keys["rate"], keys["slots"], keys["breaker"], keys["probes"]],
                    [
                        admission.member,
                        outcome,
                        1 if breaker else 0,
                        breaker.failures if breaker else 0,
                        int(breaker.open_seconds * 1000) if breaker else 0,
                        breaker.successes if breaker else 0,
                        admission.epoch,
                    ],
                )
                state, outage_ms = _text(raw[0]), int(raw[3])
                released = Released(
                    state=state or None,
                    transition=_text(raw[1]),
                    counted=bool(int(raw[2])),
                    outage_seconds=None if outage_ms < 0 else outage_ms / 1000,
                    admits_in_seconds=int(raw[4]) / 1000,
                )
                self._valkey_answered()
            except ValkeyUnavailable as exc:
                self._valkey_failed(exc)
        shared = released is not None
        if released is None:
            released = self.local.release(admission, outcome, breaker)
        if breaker is not None and released.state:
            self._observe(breaker.key, released.state, released.transition, shared=shared)
        return released

    def renew(self) -> None:
        """Renew the leases of held slots and probes due for it (every third of the lease);
        the worker's heartbeat calls it every second. Never raises."""
        now = time.monotonic()
        with self._lock:
            due = [
                a
                for a in self.held.values()
                if a.shared and a.holds and now - a.renewed_at >= self.lease_ms / 3000
            ]
        if not due or not self._use_valkey():
            return
        keys = [key for a in due for key in a.holds]
        members = [a.member for a in due for _ in a.holds]
        try:
            assert self.runner is not None
            held = int(self.runner.run(_RENEW, keys, [self.lease_ms, *members]))
            self._valkey_answered()
        except ValkeyUnavailable as exc:
            self._valkey_failed(exc)
            return
        for admission in due:
            admission.renewed_at = now
        if held < len(keys):
            logger.warning(
                "concurrency slot leases lapsed before renewal; those runs no longer count",
                extra=log_extra(action="limits.lease_lapsed", slots=len(keys) - held),
            )

    def publish(self, tasks: dict[str, TaskLimits]) -> None:
        """Record the declared limits and breaker settings in Valkey's index (for ``status``
        and the dashboard). Never raises."""
        values: list[str] = []
        for name, limits in sorted(tasks.items()):
            if not limits.any:
                continue
            values += [
                f"task:{name}",
                json.dumps(
                    {
                        "rate_count": limits.rate.count if limits.rate else None,
                        "period_seconds": limits.rate.period_seconds if limits.rate else None,
                        "concurrency": limits.concurrency,
                        "breaker": limits.breaker.key if limits.breaker else None,
                    }
                ),
            ]
        for key, breaker in sorted(self.breakers.items()):
            declared = dataclasses.asdict(breaker)
            horizon = declared.pop("max_outage_seconds")
            values += [f"breaker:{key}", json.dumps(declared), f"horizon:{key}", json.dumps(horizon)]
        if not values or not self._use_valkey():
            return
        try:
            assert self.runner is not None
            self.runner.run(_PUBLISH, [f"{self.prefix}index"], values)
            self._valkey_answered()
        except ValkeyUnavailable as exc:
            self._valkey_failed(exc)

    def close(self) -> None:
        if self.runner is not None:
            self.runner.close()

    # --- Valkey health ----------------------------------------------------------------------
    def _use_valkey(self) -> bool:
        return self.runner is not None and time.monotonic() >= self._suppressed_until

    def _valkey_failed(self, exc: ValkeyUnavailable) -> None:
        metrics.GATE_VALKEY_ERRORS.inc()
        self._suppressed_until = time.monotonic() + self.settings.limits_valkey_retry_seconds
        if not self._in_outage:
            self._in_outage = True
            logger.warning(
                "flow control lost Valkey; rate limits, concurrency caps and breakers hold per process",
                extra=log_extra(
                    action="limits.valkey_lost",
                    error_type=exc.error_type,
                    retry_seconds=self.settings.limits_valkey_retry_seconds,
                ),
            )

    def _valkey_answered(self) -> None:
        if self._in_outage:
            self._in_outage = False
            logger.info(
                "flow control reached Valkey again", extra=log_extra(action="limits.valkey_recovered")
            )

    def _observe(self, key: str, state: str, transition: str, *, shared: bool) -> None:
        if state in BREAKER_STATES:
            metrics.BREAKER_STATE.labels(key).set(BREAKER_STATES.index(state))
        if not transition:
            return
        before, after = transition.split(">")
        metrics.BREAKER_TRANSITIONS.labels(key, before, after).inc()
        breaker = self.breakers.get(key)
        logger.log(
            logging.WARNING if after == "open" else logging.INFO,
            f"circuit breaker {after.replace('_', '-')}",
            extra=log_extra(
                action=f"breaker.{after}",
                breaker=key,
                previous=before,
                shared=shared,
                open_seconds=breaker.open_seconds if breaker and after == "open" else None,
            ),
        )


@dataclasses.dataclass(frozen=True)
class TaskLimitState:
    """A task's declared limits and how much of them is in use (``status``, the dashboard).

    Attributes:
        task: Task name. concurrency: Its cap, or None. running: Slots held now (live leases).
        rate_count / period_seconds: Its rate limit, or None. admitted_in_window: Runs
            admitted within the last ``period_seconds``. breaker: Its breaker key, or None.
    """

    task: str
    concurrency: int | None
    running: int
    rate_count: int | None
    period_seconds: int | None
    admitted_in_window: int
    breaker: str | None


@dataclasses.dataclass(frozen=True)
class BreakerState:
    """A breaker as Valkey holds it now.

    Attributes:
        key: Integration key. state: ``closed``, ``open`` or ``half_open``; ``open`` past its
            time reads ``half_open`` (the next admission moves it). failures: Failures in a
            row so far (closed). open_for_seconds: Until the half-open probe (open only).
        since_seconds: Time in this state (None: never changed). probes: Half-open probes
            running. settings: Its declared :class:`~sqla_outbox.worker.limits.Breaker`.
        outage_seconds: Time since it last left closed (None while closed): failures
            that find it open are deferred without counting their attempt while this is
            below ``settings.max_outage_seconds``.
    """

    key: str
    state: str
    failures: int
    open_for_seconds: float
    since_seconds: float | None
    probes: int
    settings: Breaker
    outage_seconds: float | None = None


@dataclasses.dataclass(frozen=True)
class FlowControlState:
    """Everything :func:`snapshot` read; ``error`` says why nothing could be read."""

    tasks: list[TaskLimitState] = dataclasses.field(default_factory=list)
    breakers: list[BreakerState] = dataclasses.field(default_factory=list)
    error: str | None = None


def snapshot(settings: OutboxSettings) -> FlowControlState | None:
    """Read the limits workers declared (their start publishes them) and the live state
    of each, in one atomic script. None without ``valkey_url``; Valkey trouble gives a
    state with ``error`` set (never raises for it)."""
    if not settings.valkey_url:
        return None
    prefix = key_prefix(settings)
    runner = ScriptRunner(
        settings.valkey_url, timeout_seconds=max(1.0, settings.limits_valkey_timeout_ms / 1000)
    )
    try:
        rows = runner.run(_SNAPSHOT, [f"{prefix}index"], [prefix])
    except ValkeyUnavailable as exc:
        return FlowControlState(error=f"Valkey did not answer ({exc.error_type})")
    finally:
        runner.close()
    tasks, breakers = [], []
    for row in rows:
        kind, name, info = _text(row[0]), _text(row[1]), json.loads(_text(row[2]))
        if kind == "task":
            tasks.append(
                TaskLimitState(
                    task=name,
                    concurrency=info.get("concurrency"),
                    running=int(row[3]),
                    rate_count=info.get("rate_count"),
                    period_seconds=info.get("period_seconds"),
                    admitted_in_window=int(row[4]),
                    breaker=info.get("breaker"),
                )
            )
        else:
            state, left = _text(row[3]), float(row[5]) / 1000
            since = float(row[6])
            outage = float(row[8]) if len(row) > 8 else -1.0
            horizon = _text(row[9]) if len(row) > 9 else ""
            if horizon:
                info["max_outage_seconds"] = float(horizon)
            known = {field.name for field in dataclasses.fields(Breaker)}
            breakers.append(
                BreakerState(
                    key=name,
                    state="half_open" if state == "open" and left <= 0 else state,
                    failures=int(row[4]),
                    open_for_seconds=left if state == "open" else 0.0,
                    since_seconds=None if since < 0 else since / 1000,
                    probes=int(row[7]),
                    settings=Breaker(**{k: v for k, v in info.items() if k in known}),
                    outage_seconds=None if outage < 0 else outage / 1000,
                )
            )
    return FlowControlState(
        tasks=sorted(tasks, key=lambda t: t.task), breakers=sorted(breakers, key=lambda b: b.key)
    )


def throttle_delay(settings: OutboxSettings, deferrals: int) -> float:
    """Delay before a run refused for a full concurrency cap or busy half-open probes is
    sent again: ``limits_throttle_delay_seconds`` doubling per earlier such deferral, at
    most ``limits_throttle_delay_max_seconds``, drawn between half and all of that (equal
    jitter, so waiting runs do not come back together)."""
    return retry.deferral_delay(
        deferrals,
        first_seconds=settings.limits_throttle_delay_seconds,
        max_seconds=settings.limits_throttle_delay_max_seconds,
        jitter=True,
    )


def spread(wait_seconds: float) -> float:
    """A known wait plus up to 5 % (at most 0.5 s) of jitter, so runs released at one
    moment are not all sent in the same relay pass."""
    return wait_seconds + random.uniform(0, min(0.5, 0.05 * wait_seconds + 0.01))  # noqa: S311 - jitter


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
