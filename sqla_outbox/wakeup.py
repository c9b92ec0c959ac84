"""The wake signal: LPUSH after a commit, BLPOP in the relay. The only module that talks to Valkey.

The wake is a hint, the sweep is the guarantee: PostgreSQL holds the truth, and a lost
wake only means the relay finds the rows on its next sweep (every
``relay_sweep_interval_seconds``). So the application side never lets Valkey trouble
reach the caller:

* one ``LPUSH key 1`` per commit that wrote outbox rows (commits that finish while a push
  is in flight share the next one); when the reply says the list grew past
  ``wake_list_max`` (no relay is popping it), an ``LTRIM`` bounds it;
* the LPUSH happens on the waker's own thread, not in the commit: ``commit()`` (and an
  ``AsyncSession``'s event loop) never waits for Valkey, whatever its state;
* connect and command timeouts of ``wake_timeout_ms / 2`` each and no retries bound how
  long a hung Valkey can hold that thread;
* after a failure, wakes are skipped for ``wake_retry_seconds`` and the outage is logged
  once (``action="wake.failed"``), with one more line on recovery.

The relay side (:class:`WakeListener`) pops with BLPOP in its own thread, calls back,
and deletes the rest of the list (the pass it triggers serves every wake pushed before
it).
"""

from __future__ import annotations

import atexit
import dataclasses
import logging
import os
import queue
import threading
import time
from collections.abc import Callable

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from sqla_outbox import errors, metrics
from sqla_outbox.config import VALKEY_SCHEMES, OutboxSettings, redact_url
from sqla_outbox.logging import log_extra

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class WakeStats:
    """Counters of one :class:`Waker` (process lifetime).

    Attributes:
        sent: Wakes pushed. failed: Wakes that raised or timed out.
        skipped: Wakes not attempted because a recent failure opened the breaker.
    """

    sent: int = 0
    failed: int = 0
    skipped: int = 0


def _client(url: str, timeout_seconds: float) -> redis.Redis:
    """A client with short timeouts and no retries.

    Raises:
        ConfigurationError: ``url`` is not a Valkey/Redis URL (names the setting).
    """
    if not url.startswith(VALKEY_SCHEMES):
        raise errors.ConfigurationError(
            f"{redact_url(url)!r} is not a redis://, rediss:// or unix:// URL",
            option="SQLA_OUTBOX_VALKEY_URL",
        )
    url = url.replace("valkey://", "redis://", 1).replace("valkeys://", "rediss://", 1)
    try:
        return _make_client(url, timeout_seconds)
    except ValueError as exc:
        raise errors.ConfigurationError(str(exc), option="SQLA_OUTBOX_VALKEY_URL") from exc


def _make_client(url: str, timeout_seconds: float) -> redis.Redis:
    return redis.Redis.from_url(
        url,
        socket_timeout=timeout_seconds,
        socket_connect_timeout=timeout_seconds,
        retry=Retry(NoBackoff(), 0),
        health_check_interval=0,
        client_name="sqla_outbox",
    )


def is_unreachable(exc: BaseException) -> bool:
    """True when ``exc`` is redis-py's failure to connect to Valkey."""
    return isinstance(exc, redis.ConnectionError)


def ping(url: str, *, timeout_seconds: float = 3.0) -> None:
    """Connect to the Valkey at ``url`` and PING it once.

    Raises:
        ConfigurationError: ``url`` is not a Valkey/Redis URL.
        redis.RedisError, OSError: Valkey did not answer within ``timeout_seconds``.
    """
    client = _client(url, timeout_seconds)
    try:
        client.ping()
    finally:
        client.close()


class Waker:
    """Pushes the wake signal after commits (application side), off the commit path.

    :meth:`wake` only puts a token on an in-process queue and returns at once; a daemon
    thread of the waker does the LPUSH. Each commit gets its LPUSH; commits that finish
    while a push is in flight share the next one (a single wake makes the relay read
    everything committed before it). So a commit never waits for
    Valkey, even when it is slow, hung or down. The thread is restarted after ``fork()``
    (pre-forking servers), and at interpreter exit pending wakes get up to
    ``wake_timeout_ms`` to go out.

    Args:
        settings: Uses ``wake_valkey_url`` (None: every wake is a no-op), ``wake_key``,
            ``wake_timeout_ms`` (longest one LPUSH may take), ``wake_retry_seconds`` and
            ``wake_list_max``.

    Raises:
        ConfigurationError: ``valkey_url`` is not a Valkey/Redis URL; raised by
            :func:`sqla_outbox.install`, before any commit depends on it.
    """

    _MAX_QUEUED = 10_000
    _MIN_PUSH_INTERVAL_SECONDS = 0.002
    """During a burst of commits, at most one push per 2 ms: the relay's pass reads
    everything committed before the wake it answers, so more would only cost CPU in the
    application and Valkey. An isolated commit is pushed at once."""

    def __init__(self, settings: OutboxSettings) -> None:
        self.url = settings.wake_valkey_url
        self.key = settings.wake_key
        self.list_max = settings.wake_list_max
        self.retry_seconds = settings.wake_retry_seconds
        self.stats = WakeStats()
        self._timeout = settings.wake_timeout_ms / 1000 / 2
        self._client = _client(self.url, self._timeout) if self.url else None
        self._lock = threading.Lock()
        self._suppressed_until = 0.0
        self._in_outage = False
        self._queue: queue.SimpleQueue[int] = queue.SimpleQueue()
        self._busy = threading.Event()
        self._thread: threading.Thread | None = None
        self._pid = 0
        self._closed = False

    def wake(self) -> None:
        """Schedule one wake and return at once. Never raises, never blocks."""
        if self._client is None or self._closed:
            return
        if self._thread is None or self._pid != os.getpid():
            self._start()
        if self._queue.qsize() < self._MAX_QUEUED:
            self._queue.put(1)

    def drain(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds until every scheduled wake went out (or failed).

        Returns:
            True when nothing is left to push.
        """
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._queue.empty() and not self._busy.is_set():
                return True
            time.sleep(0.001)
        return self._queue.empty() and not self._busy.is_set()

    def close(self) -> None:
        """Stop the thread (after pending wakes, up to ``wake_timeout_ms``) and disconnect."""
        if self._closed:
            return
        self.drain(self._timeout * 2)
        self._closed = True
        self._queue.put(0)
        if self._client is not None:
            self._client.close()

    # --- the thread ------------------------------------------------------------------------
    def _start(self) -> None:
        with self._lock:
            if self._thread is not None and self._pid == os.getpid():
                return
            self._queue = queue.SimpleQueue()  # a forked child starts afresh
            self._pid = os.getpid()
            self._thread = threading.Thread(target=self._run, name="sqla-outbox-wake", daemon=True)
            self._thread.start()
            atexit.register(self.drain, self._timeout * 2)

    def _run(self) -> None:
        last_push = 0.0
        while True:
            token = self._queue.get()
            if token == 0:
                return
            self._busy.set()
            pause = last_push + self._MIN_PUSH_INTERVAL_SECONDS - time.monotonic()
            if pause > 0:  # a burst: let the commits of the next moment share this push
                time.sleep(pause)
            count = 1
            while True:  # push everything already waiting in one round trip
                try:
                    if self._queue.get_nowait() == 0:
                        self._closed = True
                        break
                    count += 1
                except queue.Empty:
                    break
            try:
                self._push(count)
            finally:
                last_push = time.monotonic()
                self._busy.clear()
            if self._closed:
                return

    def _push(self, count: int) -> None:
        assert self._client is not None
        if time.monotonic() < self._suppressed_until:
            self.stats.skipped += count
            metrics.WAKES.labels("skipped").inc(count)
            return
        try:
            # one wake serves every commit that queued it; LPUSH returns the list's length,
            # so the list is trimmed only when no relay has been popping it
            if int(self._client.lpush(self.key, 1)) > self.list_max:
                self._client.ltrim(self.key, 0, self.list_max - 1)
        except (redis.RedisError, OSError) as exc:
            metrics.WAKES.labels("failed").inc(count)
            self.stats.failed += count
            self._suppressed_until = time.monotonic() + self.retry_seconds
            if not self._in_outage:
                self._in_outage = True
                logger.warning(
                    "wake failed; relying on the relay sweep until Valkey answers",
                    extra=log_extra(
                        action="wake.failed",
                        error_type=type(exc).__name__,
                        valkey_url=redact_url(self.url or ""),
                        retry_seconds=self.retry_seconds,
                    ),
                )
            return
        metrics.WAKES.labels("sent").inc(count)
        self.stats.sent += count
        if self._in_outage:
            self._in_outage = False
            logger.info("wake recovered", extra=log_extra(action="wake.recovered"))


class WakeListener:
    """Relay side: waits on the wake key with BLPOP in a daemon thread.

    Args:
        settings: Uses ``wake_valkey_url`` (None: :meth:`start` does nothing), ``wake_key``
            and ``relay_sweep_interval_seconds``
            (the BLPOP timeout).
        on_wake: Called (from the listener thread) after each wake; must be cheap and
            thread-safe, e.g. ``threading.Event.set``.

    While Valkey is unreachable the listener reconnects with capped exponential backoff
    (0.1 s doubling to 5 s), logging once per outage and once on recovery; the relay
    keeps sweeping meanwhile.
    """

    def __init__(self, settings: OutboxSettings, on_wake: Callable[[], None]) -> None:
        self.url = settings.wake_valkey_url
        self.key = settings.wake_key
        self.timeout = max(1.0, settings.relay_sweep_interval_seconds)
        self.on_wake = on_wake
        self.wakes = 0
        self.connected = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        if self.url is None or self._thread is not None:
            return
        self._thread = threading.Thread(target=self._run, name="sqla-outbox-wake", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        assert self.url is not None
        client = _client(self.url, self.timeout + 5)
        backoff = 0.1
        in_outage = False
        while not self._stop.is_set():
            try:
                if not self.connected:
                    client.ping()  # know at once that Valkey is back, not after a BLPOP timeout
                    self.connected = True
                    backoff = 0.1
                    if in_outage:
                        in_outage = False
                        logger.info(
                            "wake listener reconnected",
                            extra=log_extra(action="relay.wake_recovered"),
                        )
                        self.on_wake()  # wakes pushed during the outage were lost: look now
                item = client.blpop([self.key], timeout=self.timeout)
                if item is None:
                    continue
                self.wakes += 1
                self.on_wake()  # first: the pass need not wait for the DEL's round trip
                client.delete(self.key)
            except (redis.RedisError, OSError) as exc:
                self.connected = False
                if not in_outage:
                    in_outage = True
                    logger.warning(
                        "wake listener lost Valkey; sweeping only until it returns",
                        extra=log_extra(
                            action="relay.wake_lost",
                            error_type=type(exc).__name__,
                            valkey_url=redact_url(self.url),
                        ),
                    )
                self._stop.wait(backoff)
                backoff = min(backoff * 2, 5.0)
        client.close()
