"""The PostgreSQL wake, relay side: ``LISTEN`` on a direct connection of its own.

A dispatching transaction ``NOTIFY``s the channel :data:`sqla_outbox.types.WAKE_CHANNEL`
inside its write statement (:mod:`sqla_outbox.write`); PostgreSQL delivers the
notification to every session of that database that ``LISTEN``s on the channel, and only
once the transaction commits. :class:`NotifyListener` holds such a session in a daemon
thread of the relay and sets the relay's wake event on each notification.

Like the Valkey wake (:mod:`sqla_outbox.wakeup`) it is a hint; the sweep is the guarantee:

* The connection is not the claim connection: it stays idle in autocommit (PostgreSQL
  hands notifications to a session only between transactions) and a long claim
  transaction never delays them.
* A ``LISTEN`` belongs to a server session. A transaction-mode pooler (PgBouncer's
  ``pool_mode = transaction``) gives each transaction whichever server session is free, so
  the ``LISTEN`` is left behind on a session that another client gets next, and the
  notifications never reach the relay. At each (re)connect the listener ``NOTIFY``s a
  random token (from a second, short-lived session); when the first token does not come
  back within ``relay_listen_probe_timeout_seconds`` it warns once
  (``action="relay.listen_unheld"``, naming ``SQLA_OUTBOX_DATABASE_DIRECT_URL``) and the
  relay runs on its sweep (``relay_sweep_interval_seconds``) and its delayed-run timer, as
  with no wake at all. Point ``database_direct_url`` at the server itself.
* **A session can die quietly**: a proxy, load balancer or NAT that drops the connection
  but keeps answering on the socket. TCP keepalives do not see that (the proxy answers
  them), and the relay would wait for its sweep for good. So the listener keeps probing:
  every ``relay_listen_probe_interval_seconds`` (15 s) it ``NOTIFY``s a new token and
  expects it back within ``relay_listen_probe_timeout_seconds`` (5 s). Once a probe has
  come back on this listener, a late one means the session is dead: the listener drops
  it, wakes the relay, reconnects (backoff 0.1 s doubling to 5 s), logs
  ``relay.listen_stalled`` once per episode and ``relay.listen_recovered`` when a probe
  comes back on a new session. A dead session is noticed within the interval plus the
  timeout (20 s by default).
* When the connection breaks, the listener reconnects the same way, logging
  ``relay.listen_lost`` once per outage and ``relay.listen_recovered`` once connected,
  and wakes the relay after reconnecting (notifications sent meanwhile were lost). TCP
  keepalives notice a vanished server within about 25 s.
* The state of the session is the relay's to report (a separate process's ``--check``
  can only test a fresh connection): the gauges ``sqla_outbox_relay_listen_alive`` (1
  while the last probe came back in time) and
  ``sqla_outbox_relay_listen_probe_age_seconds`` on the relay's ``/metrics``, and the
  counter ``sqla_outbox_relay_listen_reconnects_total{reason}``.

Payloads are ignored: a notification means "look now", whatever it carries (anyone who
can connect to the database may ``NOTIFY``); only the listener's own probe token is
compared, and a payload starting with :data:`PROBE_PREFIX` (another relay's probe, or one
of ours that came back late) is not a wake.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from collections.abc import Callable

import psycopg
from psycopg import sql
from sqlalchemy import text
from sqlalchemy.engine import Connection

from sqla_outbox import backoff, metrics
from sqla_outbox.config import OutboxSettings, redact_url
from sqla_outbox.logging import log_extra
from sqla_outbox.types import WAKE_CHANNEL

logger = logging.getLogger(__name__)

PROBE_PREFIX = "probe:"
"""Payload prefix of the listener's probes; a notification carrying it is never a wake."""


class _Stalled(Exception):
    """A probe did not come back in time on a listener that held a ``LISTEN`` before."""


_exporting: NotifyListener | None = None
"""The listener whose state the ``sqla_outbox_relay_listen_*`` gauges show (the last one
started in this process: one per active relay)."""


class NotifyListener:
    """Relay side of the PostgreSQL wake: ``LISTEN`` in a daemon thread.

    Args:
        settings: Uses ``wake_notify`` (False: :meth:`start` does nothing), ``listen_url``
            (``database_direct_url``, else ``database_url``),
            ``relay_listen_probe_interval_seconds`` and ``relay_listen_probe_timeout_seconds``.
        on_wake: Called from the listener thread for each notification, after each
            (re)connect and when a session is found dead; must be cheap and thread-safe,
            e.g. ``threading.Event.set``.
        probe_seconds: How long a self-addressed probe may take to come back, seconds
            (default ``relay_listen_probe_timeout_seconds``).
        probe_interval_seconds: How often a probe is sent once the last one came back,
            seconds (default ``relay_listen_probe_interval_seconds``).
        enabled: Listen even when ``wake_notify`` is off (a relay among several active
            ones hears the wakes the others forward; :mod:`sqla_outbox.relay.partitions`).
        own_payload: Notifications carrying exactly this payload are ignored (the wakes
            this relay forwarded itself).

    Attributes:
        wakes: Notifications received (probes excluded).
        listening: The ``LISTEN`` is in place on a connection.
        held: None until the first probe's verdict; then whether notifications come back.
        alive: The current session returned its last probe in time.
        stalls: Sessions dropped because a probe did not come back.
    """

    def __init__(
        self,
        settings: OutboxSettings,
        on_wake: Callable[[], None],
        *,
        probe_seconds: float | None = None,
        probe_interval_seconds: float | None = None,
        enabled: bool | None = None,
        own_payload: str | None = None,
    ) -> None:
        self.enabled = settings.wake_notify if enabled is None else enabled
        self.own_payload = own_payload
        self.url = settings.listen_url
        self.on_wake = on_wake
        self.probe_seconds = (
            settings.relay_listen_probe_timeout_seconds if probe_seconds is None else probe_seconds
        )
        self.probe_interval_seconds = (
            settings.relay_listen_probe_interval_seconds
            if probe_interval_seconds is None
            else probe_interval_seconds
        )
        self.wakes = 0
        self.listening = False
        self.held: bool | None = None
        self.alive = False
        self.stalls = 0
        self._probe_returned_at: float | None = None
        self._episode: str | None = None  # "lost" or "stalled": logged once, until it ends
        self._delay = backoff.Doubling(0.1, 5.0)
        self._sender: threading.Thread | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Start the listener thread (once; a no-op when the PostgreSQL wake is off)."""
        global _exporting
        if not self.enabled or self._thread is not None:
            return
        _exporting = self
        self._show()
        self._thread = threading.Thread(target=self._run, name="sqla-outbox-listen", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Ask the thread to end (within about a second; it closes its connection)."""
        self._stop.set()

    def join(self, timeout: float | None = None) -> None:
        """Wait for the thread to end (after :meth:`stop`)."""
        if self._thread is not None:
            self._thread.join(timeout)

    def probe_age_seconds(self) -> float | None:
        """Seconds since a probe last came back on this listener (None: none has)."""
        if self._probe_returned_at is None:
            return None
        return time.monotonic() - self._probe_returned_at

    # --- the thread ------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                try:
                    with psycopg.connect(
                        self.url,
                        autocommit=True,
                        connect_timeout=5,
                        application_name="sqla_outbox_listen",
                        # a vanished server is noticed within about 25 s (idle 10 s + 3 x 5 s);
                        # a session cut behind a proxy that keeps the socket open is not: the
                        # probes notice that one
                        keepalives=1,
                        keepalives_idle=10,
                        keepalives_interval=5,
                        keepalives_count=3,
                    ) as connection:
                        connection.execute(sql.SQL("LISTEN {}").format(sql.Identifier(WAKE_CHANNEL)))
                        self.listening = True
                        if self._episode == "lost":  # the connection is back (a probe follows)
                            self._recovered()
                        self.on_wake()  # notifications sent while not listening were lost: look now
                        self._listen(connection)
                except _Stalled:
                    self._lose("stalled")
                    self._stop.wait(self._delay.current)
                    self._delay.grow()
                except psycopg.Error as exc:
                    if self._stop.is_set():
                        break
                    self._lose("lost", exc)
                    self._stop.wait(self._delay.current)
                    self._delay.grow()
        finally:
            self.listening = self.alive = False
            self._unshow()

    def _listen(self, connection: psycopg.Connection[tuple[object, ...]]) -> None:
        """Hear notifications until :meth:`stop`, probing the session: a probe is sent at
        once and then every ``probe_interval_seconds`` after the last one came back; one
        that is not back within ``probe_seconds`` raises :class:`_Stalled` once this
        listener has seen a probe come back (before that: the connection cannot hold a
        ``LISTEN``, see :meth:`_verdict`; it is kept and probed again later)."""
        token: str | None = self._send_probe_soon()
        deadline = time.monotonic() + self.probe_seconds
        next_probe_at = 0.0
        while not self._stop.is_set():
            due = deadline if token is not None else next_probe_at
            wait = min(1.0, max(0.01, due - time.monotonic()))
            # notifies(timeout=...) returns after the timeout with no notification, so the
            # loop sees stop() within a second (psycopg >= 3.2)
            for notify in connection.notifies(timeout=wait):
                if token is not None and notify.payload == token:
                    token = None
                    next_probe_at = time.monotonic() + self.probe_interval_seconds
                    self._probe_returned()
                    continue
                if notify.payload.startswith(PROBE_PREFIX):
                    continue  # a late probe (or another relay's): not a wake
                if self.own_payload is not None and notify.payload == self.own_payload:
                    continue
                self.wakes += 1
                self.on_wake()
            now = time.monotonic()
            if token is not None and now >= deadline:
                token = None
                next_probe_at = now + self.probe_interval_seconds
                self.alive = False
                self._show()
                if self.held is not True and self._probe_returned_at is None:
                    self._verdict(False)
                    continue
                raise _Stalled
            if token is None and now >= next_probe_at:
                token = self._send_probe_soon()
                deadline = now + self.probe_seconds

    def _probe_returned(self) -> None:
        self._probe_returned_at = time.monotonic()
        self.alive = True
        self._delay.reset()
        self._verdict(True)
        if self._episode == "stalled":
            self._recovered()
        self._show()

    def _lose(self, why: str, exc: BaseException | None = None) -> None:
        """The session is gone (``lost``: the connection failed; ``stalled``: a probe did
        not come back): count it, log it once per episode, wake the relay."""
        self.listening = self.alive = False
        self._show()
        metrics.RELAY_LISTEN_RECONNECTS.labels(why).inc()
        if why == "stalled":
            self.stalls += 1
            self.on_wake()  # notifications sent to the dead session were lost: look now
        if self._episode is not None:
            return
        self._episode = why
        if why == "stalled":
            age = self.probe_age_seconds()
            logger.warning(
                "wake listener's LISTEN session stopped answering; reconnecting (sweeping meanwhile)",
                extra=log_extra(
                    action="relay.listen_stalled",
                    probe_timeout_s=self.probe_seconds,
                    last_probe_age_s=None if age is None else round(age, 3),
                    database_url=redact_url(self.url),
                ),
            )
            return
        logger.warning(
            "wake listener lost PostgreSQL; sweeping only until it returns",
            extra=log_extra(
                action="relay.listen_lost",
                error_type=type(exc).__name__ if exc is not None else None,
                database_url=redact_url(self.url),
            ),
        )

    def _recovered(self) -> None:
        episode, self._episode = self._episode, None
        logger.info(
            "wake listener reconnected",
            extra=log_extra(action="relay.listen_recovered", after=episode),
        )

    def _send_probe_soon(self) -> str:
        """A new probe token, ``NOTIFY``'d from a thread of its own (the sending session may
        be cut quietly too: the listener never waits for it). While an earlier send is
        still under way nothing is sent, so the token will not come back."""
        token = PROBE_PREFIX + secrets.token_hex(8)
        if self._sender is not None and self._sender.is_alive():
            return token
        self._sender = threading.Thread(
            target=self._send, args=(token,), name="sqla-outbox-listen-probe", daemon=True
        )
        self._sender.start()
        return token

    def _send(self, token: str) -> None:
        try:
            _notify_probe(self.url, token, self.probe_seconds)
        except psycopg.Error:
            pass  # the probe does not come back, and the listener acts on that

    def _show(self) -> None:
        if _exporting is not self or self._stop.is_set():
            return
        metrics.RELAY_LISTEN_ALIVE.labels(WAKE_CHANNEL).set(1 if self.alive else 0)
        if self._probe_returned_at is not None:
            metrics.RELAY_LISTEN_PROBE_AGE.labels(WAKE_CHANNEL).set_function(self._probe_age_or_zero)

    def _probe_age_or_zero(self) -> float:
        return self.probe_age_seconds() or 0.0

    def _unshow(self) -> None:
        global _exporting
        if _exporting is not self:
            return
        _exporting = None
        for gauge in (metrics.RELAY_LISTEN_ALIVE, metrics.RELAY_LISTEN_PROBE_AGE):
            try:
                gauge.remove(WAKE_CHANNEL)
            except KeyError:
                pass

    def _verdict(self, held: bool) -> None:
        if held == self.held:
            return
        self.held = held
        if held:
            logger.debug("wake listener is listening", extra=log_extra(action="relay.listening"))
            return
        logger.warning(
            "LISTEN does not hold on this connection (a transaction-mode pooler such as PgBouncer?): "
            "the relay runs on its sweep; set SQLA_OUTBOX_DATABASE_DIRECT_URL to a direct connection",
            extra=log_extra(
                action="relay.listen_unheld",
                database_url=redact_url(self.url),
                probe_seconds=self.probe_seconds,
            ),
        )


def probe(settings: OutboxSettings, *, timeout_seconds: float = 3.0) -> bool:
    """``LISTEN`` on a fresh connection, ``NOTIFY`` oneself and wait for it: True when the
    connection at ``settings.listen_url`` holds a ``LISTEN`` (False behind a
    transaction-mode pooler). It says nothing about a running relay's own session: that one
    is in the relay's ``sqla_outbox_relay_listen_alive`` metric.

    Raises:
        psycopg.Error: PostgreSQL did not answer (within ``timeout_seconds`` to connect).
    """
    with psycopg.connect(
        settings.listen_url, autocommit=True, connect_timeout=max(1, round(timeout_seconds))
    ) as connection:
        connection.execute(sql.SQL("LISTEN {}").format(sql.Identifier(WAKE_CHANNEL)))
        token = PROBE_PREFIX + secrets.token_hex(8)
        _notify_probe(settings.listen_url, token, timeout_seconds)
        deadline = time.monotonic() + timeout_seconds
        while time.monotonic() < deadline:
            for notify in connection.notifies(timeout=max(0.01, deadline - time.monotonic())):
                if notify.payload == token:
                    return True
        return False


def forward_wake(connection: Connection, payload: str) -> None:
    """``NOTIFY`` the wake channel from ``connection`` (the relay's, between transactions):
    how a relay that took a Valkey wake (which only one BLPOP receives) passes it on to
    the other active relays. Commits."""
    connection.execute(
        text("SELECT pg_notify(:channel, :payload)"), {"channel": WAKE_CHANNEL, "payload": payload}
    )
    connection.commit()


def _notify_probe(url: str, token: str, timeout_seconds: float = 5.0) -> None:
    """``NOTIFY`` the probe ``token`` from a session of its own. (A notification the
    listening session sent itself arrives during its own statement, and psycopg 3.2.1, the
    floor, passes those to notify handlers only, never to ``notifies()``.)

    Raises:
        psycopg.Error: The server did not answer.
    """
    with psycopg.connect(url, autocommit=True, connect_timeout=max(1, round(timeout_seconds))) as sender:
        sender.execute("SELECT pg_notify(%s, %s)", (WAKE_CHANNEL, token))
