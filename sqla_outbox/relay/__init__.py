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

Layout:

* :mod:`~sqla_outbox.relay.process`: :class:`Relay` (leadership, waiting between passes,
  the pending-rows gauges) and :func:`scheduling_catalog`;
* :mod:`~sqla_outbox.relay.passes`: the pass, :class:`PassResult`, :class:`RelayCounters`;
* what a pass uses: :mod:`~sqla_outbox.relay.claim`, :mod:`~sqla_outbox.relay.fair`,
  :mod:`~sqla_outbox.relay.pauses`, :mod:`~sqla_outbox.relay.hold`,
  :mod:`~sqla_outbox.relay.ratelimit`, :mod:`~sqla_outbox.relay.depth`,
  :mod:`~sqla_outbox.relay.send`; around it :mod:`~sqla_outbox.relay.partitions`,
  :mod:`~sqla_outbox.relay.listen`, :mod:`~sqla_outbox.relay.schedule`;
* :func:`make_engine` and :data:`ENGINE_CONNECT_ARGS` live in :mod:`sqla_outbox.engines`
  (the worker's engines use them too) and are re-exported here.

The names below are imported on first use (PEP 562), so importing a light module of the
package (:mod:`~sqla_outbox.relay.partitions` for ``status``, :mod:`~sqla_outbox.relay.listen`
for ``--check``) does not load the relay, and with it boto3.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from sqla_outbox import lazy

if TYPE_CHECKING:
    from sqla_outbox.engines import ENGINE_CONNECT_ARGS, make_engine
    from sqla_outbox.relay.passes import PassResult, RelayCounters
    from sqla_outbox.relay.process import WAKE_HOLD_SECONDS, Relay, scheduling_catalog

__all__ = [
    "ENGINE_CONNECT_ARGS",
    "WAKE_HOLD_SECONDS",
    "PassResult",
    "Relay",
    "RelayCounters",
    "make_engine",
    "scheduling_catalog",
]

_EXPORTS = {
    "ENGINE_CONNECT_ARGS": "sqla_outbox.engines",
    "make_engine": "sqla_outbox.engines",
    "PassResult": "sqla_outbox.relay.passes",
    "RelayCounters": "sqla_outbox.relay.passes",
    "Relay": "sqla_outbox.relay.process",
    "WAKE_HOLD_SECONDS": "sqla_outbox.relay.process",
    "scheduling_catalog": "sqla_outbox.relay.process",
}


__getattr__, __dir__ = lazy.attributes(__name__, _EXPORTS, __all__)
