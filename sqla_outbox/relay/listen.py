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
  random token (from a second, short-lived session); when the token does not come back
  within ``probe_seconds`` it warns once (``action="relay.listen_unheld"``, naming
  ``SQLA_OUTBOX_DATABASE_DIRECT_URL``) and the relay runs on its sweep
  (``relay_sweep_interval_seconds``) and its delayed-run timer, as with no wake at all.
  Point ``database_direct_url`` at the server itself.
* When the connection breaks, the listener reconnects with capped exponential backoff
  (0.1 s doubling to 5 s), logging once per outage and once on recovery, and wakes the
  relay after reconnecting (notifications sent meanwhile were lost). TCP keepalives
  notice a vanished server within about 25 s.

Payloads are ignored: a notification means "look now", whatever it carries (anyone who
can connect to the database may ``NOTIFY``); only the listener's own probe token is
compared.
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

from sqla_outbox import backoff
from sqla_outbox.config import OutboxSettings, redact_url
from sqla_outbox.logging import log_extra
from sqla_outbox.types import WAKE_CHANNEL

logger = logging.getLogger(__name__)


class NotifyListener:
    """Relay side of the PostgreSQL wake: ``LISTEN`` in a daemon thread.

    Args:
        settings: Uses ``wake_notify`` (False: :meth:`start` does nothing) and
            ``listen_url`` (``database_direct_url``, else ``database_url``).
        on_wake: Called from the listener thread for each notification, and after each
            (re)connect; must be cheap and thread-safe, e.g. ``threading.Event.set``.
        probe_seconds: How long the self-addressed probe may take to come back before the
            connection is judged unable to hold a ``LISTEN`` (a transaction-mode pooler).
        enabled: Listen even when ``wake_notify`` is off (a relay among several active
            ones hears the wakes the others forward; :mod:`sqla_outbox.relay.partitions`).
        own_payload: Notifications carrying exactly this payload are ignored (the wakes
            this relay forwarded itself).

    Attributes:
        wakes: Notifications received (probes excluded).
        listening: The ``LISTEN`` is in place on a live connection.
        held: None until the probe's verdict; then whether notifications come back.
    """

    def __init__(
        self,
        settings: OutboxSettings,
        on_wake: Callable[[], None],
        *,
        probe_seconds: float = 5.0,
        enabled: bool | None = None,
        own_payload: str | None = None,
    ) -> None:
        self.enabled = settings.wake_notify if enabled is None else enabled
        self.own_payload = own_payload
        self.url = settings.listen_url
        self.on_wake = on_wake
        self.probe_seconds = probe_seconds
        self.wakes = 0
        self.listening = False
        self.held: bool | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Start the listener thread (once; a no-op when the PostgreSQL wake is off)."""
        if not self.enabled or self._thread is not None:
            return
        self._thread = threading.Thread(target=self._run, name="sqla-outbox-listen", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Ask the thread to end (within about a second; it closes its connection)."""
        self._stop.set()

    def join(self, timeout: float | None = None) -> None:
        """Wait for the thread to end (after :meth:`stop`)."""
        if self._thread is not None:
            self._thread.join(timeout)

    # --- the thread ------------------------------------------------------------------------
    def _run(self) -> None:
        delay = backoff.Doubling(0.1, 5.0)
        in_outage = False
        while not self._stop.is_set():
            try:
                with psycopg.connect(
                    self.url,
                    autocommit=True,
                    connect_timeout=5,
                    application_name="sqla_outbox_listen",
                    # a vanished server is noticed within about 25 s (idle 10 s + 3 x 5 s)
                    keepalives=1,
                    keepalives_idle=10,
                    keepalives_interval=5,
                    keepalives_count=3,
                ) as connection:
                    connection.execute(sql.SQL("LISTEN {}").format(sql.Identifier(WAKE_CHANNEL)))
                    probe = _send_probe(self.url)
                    self.listening = True
                    delay.reset()
                    if in_outage:
                        in_outage = False
                        logger.info(
                            "wake listener reconnected", extra=log_extra(action="relay.listen_recovered")
                        )
                    self.on_wake()  # notifications sent while not listening were lost: look now
                    self._listen(connection, probe)
            except psycopg.Error as exc:
                self.listening = False
                if self._stop.is_set():
                    break
                if not in_outage:
                    in_outage = True
                    logger.warning(
                        "wake listener lost PostgreSQL; sweeping only until it returns",
                        extra=log_extra(
                            action="relay.listen_lost",
                            error_type=type(exc).__name__,
                            database_url=redact_url(self.url),
                        ),
                    )
                self._stop.wait(delay.current)
                delay.grow()
        self.listening = False

    def _listen(self, connection: psycopg.Connection[tuple[object, ...]], probe: str) -> None:
        probe_deadline = time.monotonic() + self.probe_seconds
        probe_pending = True
        while not self._stop.is_set():
            # notifies(timeout=...) returns after the timeout with no notification, so the
            # loop sees stop() within a second (psycopg >= 3.2)
            for notify in connection.notifies(timeout=1.0):
                if probe_pending and notify.payload == probe:
                    probe_pending = False
                    self._verdict(True)
                    continue
                if self.own_payload is not None and notify.payload == self.own_payload:
                    continue
                self.wakes += 1
                self.on_wake()
            if probe_pending and time.monotonic() > probe_deadline:
                probe_pending = False
                self._verdict(False)

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
    """``LISTEN``, ``NOTIFY`` oneself and wait for it: True when the connection at
    ``settings.listen_url`` holds a ``LISTEN`` (False behind a transaction-mode pooler).

    Raises:
        psycopg.Error: PostgreSQL did not answer (within ``timeout_seconds`` to connect).
    """
    with psycopg.connect(
        settings.listen_url, autocommit=True, connect_timeout=max(1, round(timeout_seconds))
    ) as connection:
        connection.execute(sql.SQL("LISTEN {}").format(sql.Identifier(WAKE_CHANNEL)))
        token = _send_probe(settings.listen_url, timeout_seconds)
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


def _send_probe(url: str, timeout_seconds: float = 5.0) -> str:
    """``NOTIFY`` a random token from a session of its own and return it. (A notification
    the listening session sent itself arrives during its own statement, and psycopg 3.2.1,
    the floor, passes those to notify handlers only, never to ``notifies()``.)

    Raises:
        psycopg.Error: The server did not answer.
    """
    token = "probe:" + secrets.token_hex(8)
    with psycopg.connect(url, autocommit=True, connect_timeout=max(1, round(timeout_seconds))) as sender:
        sender.execute("SELECT pg_notify(%s, %s)", (WAKE_CHANNEL, token))
    return token
