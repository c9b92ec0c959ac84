"""The wake signal: LPUSH after a commit, BLPOP in the relay. The only module that talks to Valkey.

The wake is a hint, the sweep is the guarantee: PostgreSQL holds the truth, and a lost
wake only means the relay finds the rows on its next sweep (every
``relay_sweep_interval_seconds``). So the application side never lets Valkey trouble
reach the caller:

* one pipelined ``LPUSH key 1`` + ``LTRIM key 0 <wake_list_max - 1>`` per commit that
  wrote outbox rows; the trim keeps the list bounded while no relay listens;
* connect and command timeouts of ``wake_timeout_ms / 2`` each and no retries, so a
  commit spends at most ``wake_timeout_ms`` on it even with Valkey black-holed;
* after a failure, commits skip the wake for ``wake_retry_seconds`` and the outage is
  logged once (``action="wake.failed"``), with one more line on recovery;
* under ``AsyncSession`` the LPUSH runs on a small thread pool and is awaited through
  SQLAlchemy's greenlet bridge, so the event loop is never blocked.

The relay side (:class:`WakeListener`) pops with BLPOP in its own thread, deletes the
rest of the list (one pass serves every wake pushed before it starts) and calls back.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import threading
import time
from collections.abc import Callable

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from sqla_outbox import errors, metrics
from sqla_outbox.config import OutboxSettings, redact_url
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
    if not url.startswith(("redis://", "rediss://", "unix://", "valkey://", "valkeys://")):
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


class Waker:
    """Pushes the wake signal after commits (application side).

    Args:
        settings: Uses ``valkey_url`` (None: every wake is a no-op), ``wake_key``,
            ``wake_timeout_ms``, ``wake_retry_seconds`` and ``wake_list_max``.

    Raises:
        ConfigurationError: ``valkey_url`` is not a Valkey/Redis URL; raised by
            :func:`sqla_outbox.install`, before any commit depends on it.
    """

    def __init__(self, settings: OutboxSettings) -> None:
        self.url = settings.valkey_url
        self.key = settings.wake_key
        self.list_max = settings.wake_list_max
        self.retry_seconds = settings.wake_retry_seconds
        self.stats = WakeStats()
        self._timeout = settings.wake_timeout_ms / 1000 / 2
        self._client = _client(self.url, self._timeout) if self.url else None
        self._lock = threading.Lock()
        self._suppressed_until = 0.0
        self._in_outage = False
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None

    def wake(self) -> bool:
        """Push one wake. Never raises.

        Returns:
            True when the LPUSH succeeded, False when it failed, was skipped, or no
            Valkey URL is configured.
        """
        if self._client is None:
            return False
        now = time.monotonic()
        if now < self._suppressed_until:
            with self._lock:
                self.stats.skipped += 1
            metrics.WAKES.labels("skipped").inc()
            return False
        try:
            pipe = self._client.pipeline(transaction=False)
            pipe.lpush(self.key, 1)
            pipe.ltrim(self.key, 0, self.list_max - 1)
            pipe.execute()
        except (redis.RedisError, OSError) as exc:
            metrics.WAKES.labels("failed").inc()
            with self._lock:
                self.stats.failed += 1
                self._suppressed_until = time.monotonic() + self.retry_seconds
                first = not self._in_outage
                self._in_outage = True
            if first:
                logger.warning(
                    "wake failed; relying on the relay sweep until Valkey answers",
                    extra=log_extra(
                        action="wake.failed",
                        error_type=type(exc).__name__,
                        valkey_url=redact_url(self.url or ""),
                        retry_seconds=self.retry_seconds,
                    ),
                )
            return False
        metrics.WAKES.labels("sent").inc()
        with self._lock:
            self.stats.sent += 1
            recovered = self._in_outage
            self._in_outage = False
        if recovered:
            logger.info("wake recovered", extra=log_extra(action="wake.recovered"))
        return True

    def wake_in_thread(self) -> concurrent.futures.Future[bool]:
        """Run :meth:`wake` on the waker's own small thread pool (for event loops)."""
        if self._pool is None:
            with self._lock:
                if self._pool is None:
                    self._pool = concurrent.futures.ThreadPoolExecutor(
                        max_workers=2, thread_name_prefix="sqla-outbox-wake"
                    )
        return self._pool.submit(self.wake)

    def close(self) -> None:
        """Release the connection pool and the thread pool."""
        if self._pool is not None:
            self._pool.shutdown(wait=False)
        if self._client is not None:
            self._client.close()


class WakeListener:
    """Relay side: waits on the wake key with BLPOP in a daemon thread.

    Args:
        settings: Uses ``valkey_url``, ``wake_key`` and ``relay_sweep_interval_seconds``
            (the BLPOP timeout).
        on_wake: Called (from the listener thread) after each wake; must be cheap and
            thread-safe, e.g. ``threading.Event.set``.

    While Valkey is unreachable the listener reconnects with capped exponential backoff
    (0.1 s doubling to 5 s), logging once per outage and once on recovery; the relay
    keeps sweeping meanwhile.
    """

    def __init__(self, settings: OutboxSettings, on_wake: Callable[[], None]) -> None:
        self.url = settings.valkey_url
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
                client.delete(self.key)
                self.wakes += 1
                self.on_wake()
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
