"""The wake signal: LPUSH after a commit, BLPOP in the relay. The only module that talks to Valkey.

It also hands out :class:`ScriptRunner`, the Valkey client of the worker's flow control
(:mod:`sqla_outbox.worker.gate`: rate limits, concurrency slots and circuit breakers run
as atomic Lua scripts), so redis-py stays behind this one module.

The wake is a hint, the sweep is the guarantee: PostgreSQL holds the truth, and a lost
wake only means the relay finds the rows on its next sweep (every
``relay_sweep_interval_seconds``). So the application side never lets Valkey trouble
reach the caller:

* one ``LPUSH key 1`` per commit that wrote outbox rows, at most one per 10 ms during a
  burst (commits that finish while a push is scheduled or in flight share the next one);
  when the reply says the list grew past ``wake_list_max`` (no relay is popping it), an
  ``LTRIM`` cuts it to one entry;
* the LPUSH happens on the waker's own thread, not in the commit: ``commit()`` (and an
  ``AsyncSession``'s event loop) never waits for Valkey, whatever its state;
* connect and command timeouts of ``wake_timeout_ms / 2`` each and no retries bound how
  long a hung Valkey can hold that thread;
* after a failure, wakes are skipped for ``wake_retry_seconds`` and the outage is logged
  once (``action="wake.failed"``), with one more line on recovery.

The relay side (:class:`WakeListener`) pops with BLPOP in its own thread, calls back,
and deletes the rest of the list (the pass it triggers serves every wake pushed before
it). Whatever the key holds is untrusted (anyone with write access to Valkey can set
it), so the listener:

* reads a popped element only up to :data:`WAKE_ELEMENT_MAX_BYTES` (the application
  pushes ``"1"``): a longer reply is never materialised; the connection is dropped
  with the rest of it unread (the element is consumed by the pop), so the relay's memory
  stays bounded whatever was pushed (Redis values may be 512 MiB);
* tells "Valkey is unreachable" from "Valkey answers, but the key is unusable" (a
  string or hash where the list should be, an ACL refusal, an oversized element): one
  warning naming the key and its type, then capped exponential backoff, which only a
  BLPOP that answers normally resets (a successful PING does not); no database pass
  follows such an error;
* never decides how often the relay runs a pass: the relay bounds wake-driven passes
  itself (:mod:`sqla_outbox.relay`), so a push flood costs Valkey round trips, not
  database transactions.
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
from typing import Any

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from sqla_outbox import backoff, errors, metrics
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


WAKE_ELEMENT_MAX_BYTES = 1024
"""Longest reply element the relay's listener reads (the application pushes ``"1"``)."""


class WakeElementTooLarge(Exception):
    """A reply element longer than :data:`WAKE_ELEMENT_MAX_BYTES` (left unread)."""

    def __init__(self, size_bytes: int) -> None:
        self.size_bytes = size_bytes
        super().__init__(f"reply element of {size_bytes} bytes")


def _bounded_parser(max_bytes: int) -> Any:
    """redis-py's RESP2 parser, refusing to read a bulk reply longer than ``max_bytes``.

    The check sits on the parser's socket buffer (``read(length)`` is called with the
    announced length of each bulk string before any of it is read); the raised error
    makes redis-py drop the connection (``Connection.read_response`` disconnects on any
    error), so the unread bytes go with the socket. Returns None when this redis-py has no
    such parser (the tests pin the supported versions).
    """
    try:
        from redis import _parsers
    except ImportError:  # pragma: no cover - every supported redis-py has it
        return None
    base = getattr(_parsers, "_RESP2Parser", None)
    if base is None:  # pragma: no cover
        return None

    class BoundedParser(base):  # type: ignore[misc, valid-type]
        def on_connect(self, connection: Any) -> None:
            super().on_connect(connection)
            read = self._buffer.read

            def bounded(length: int, *args: Any, **kwargs: Any) -> Any:
                if length > max_bytes:
                    raise WakeElementTooLarge(length)
                return read(length, *args, **kwargs)

            self._buffer.read = bounded

    return BoundedParser


def _listener_client(url: str, timeout_seconds: float) -> redis.Redis:
    """Like :func:`_client`, with replies bounded by :data:`WAKE_ELEMENT_MAX_BYTES`."""
    url = url.replace("valkey://", "redis://", 1).replace("valkeys://", "rediss://", 1)
    parser = _bounded_parser(WAKE_ELEMENT_MAX_BYTES)
    options: dict[str, Any] = {"protocol": 2}
    if parser is not None:
        options["parser_class"] = parser
    else:  # pragma: no cover - every supported redis-py has the parser
        logger.warning(
            "this redis-py has no RESP2 parser to bound: wake elements are read whole",
            extra=log_extra(action="relay.wake_unbounded"),
        )
    return redis.Redis.from_url(
        url,
        socket_timeout=timeout_seconds,
        socket_connect_timeout=timeout_seconds,
        retry=Retry(NoBackoff(), 0),
        health_check_interval=0,
        client_name="sqla_outbox",
        **options,
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

    :meth:`wake` only counts the commit and returns at once; a daemon thread of the waker
    does the LPUSH. A commit that finds the thread idle schedules a push (a token on an
    in-process queue, which wakes the thread); while commits keep coming, the thread stays
    in a burst, pushing at most once per 10 ms what the commits since its last push
    counted, and goes back to waiting on the queue after a 10 ms window without a commit.
    Commits during a burst only add to the count and share the next push (a single wake
    makes the relay read everything committed before it). So a commit never waits for
    Valkey, even when it is slow, hung or down, and during a burst of commits it costs
    a counter increment: neither a thread switch nor a Valkey round trip. The thread is
    restarted after ``fork()`` (pre-forking servers), and at interpreter exit pending wakes get up to
    ``wake_timeout_ms`` to go out.

    Args:
        settings: Uses ``wake_valkey_url`` (None: every wake is a no-op), ``wake_key``,
            ``wake_timeout_ms`` (longest one LPUSH may take), ``wake_retry_seconds`` and
            ``wake_list_max``.

    Raises:
        ConfigurationError: ``valkey_url`` is not a Valkey/Redis URL; raised by
            :func:`sqla_outbox.install`, before any commit depends on it.
    """

    _MIN_PUSH_INTERVAL_SECONDS = 0.01
    """During a burst of commits, at most one push per 10 ms: the relay's pass reads
    everything committed before the wake it answers, so more would only cost CPU in the
    application and Valkey (at 2 ms the pushes cost a one-dispatch transaction about 5 %
    of its throughput: ADR 0017, item 8; docs/benchmarks.md). An isolated commit (none in the
    10 ms before it) is pushed at once; a commit in a burst waits at most 10 ms, while the
    relay is usually still busy with the burst's earlier wakes."""

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
        self._count_lock = threading.Lock()
        self._waiting = 0  # commits since the last push took its count
        self._scheduled = False  # a token is on the queue, or the thread is in a burst
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
        with self._count_lock:
            self._waiting += 1
            if self._scheduled:
                return  # the scheduled push will count this commit too
            self._scheduled = True
        self._queue.put(1)

    def drain(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds until every scheduled wake went out (or failed).

        Returns:
            True when nothing is left to push.
        """
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._idle():
                return True
            time.sleep(0.001)
        return self._idle()

    def _idle(self) -> bool:
        # `scheduled` first: the thread sets `busy` before it clears `scheduled`, and
        # clears `busy` only after the push
        with self._count_lock:
            scheduled = self._scheduled
        return not scheduled and not self._busy.is_set()

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
            self._count_lock = threading.Lock()
            self._waiting, self._scheduled = 0, False
            self._pid = os.getpid()
            self._thread = threading.Thread(target=self._run, name="sqla-outbox-wake", daemon=True)
            self._thread.start()
            atexit.register(self.drain, self._timeout * 2)

    def _run(self) -> None:
        last_push = 0.0
        while True:
            token = self._queue.get()  # idle: until a commit schedules a push
            if token == 0:
                return
            self._busy.set()
            try:
                last_push = self._burst(last_push)
            finally:
                self._busy.clear()
            if self._closed:
                return

    def _burst(self, last_push: float) -> float:
        """Push, then every 10 ms while commits keep coming, without going back to the
        queue (the committing threads only count: no hand-off per window). A window
        without a commit ends the burst. Returns when the last push went out."""
        while True:
            pause = last_push + self._MIN_PUSH_INTERVAL_SECONDS - time.monotonic()
            if pause > 0:
                time.sleep(pause)
            with self._count_lock:
                count, self._waiting = self._waiting, 0
                if not count:  # from here on a commit schedules the next push
                    self._scheduled = False
                    return last_push
            try:
                self._push(count)
            finally:
                last_push = time.monotonic()
            if self._closed:
                return last_push

    def _push(self, count: int) -> None:
        assert self._client is not None
        if time.monotonic() < self._suppressed_until:
            self.stats.skipped += count
            metrics.WAKES.labels("skipped").inc(count)
            return
        try:
            # one wake serves every commit that queued it; LPUSH returns the list's length,
            # so the list is trimmed only when no relay has been popping it, and then to one
            # entry (the entries are all alike and one wakes a relay), so that while no relay
            # pops, the next list_max pushes go without a trim
            if int(self._client.lpush(self.key, 1)) > self.list_max:
                self._client.ltrim(self.key, 0, 0)
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

    Trouble is logged once per episode and retried with capped exponential backoff; the
    relay keeps sweeping meanwhile:

    * Valkey unreachable (``relay.wake_lost``): 0.1 s doubling to 5 s; when a PING answers
      again, ``relay.wake_recovered`` and one wake (pushes during the outage were lost);
    * the key unusable (``relay.wake_key_unusable``: not a list, an ACL refusal, an
      element over :data:`WAKE_ELEMENT_MAX_BYTES`): 1 s doubling to 60 s, reset only by a
      BLPOP that answers normally (``relay.wake_key_usable``).
    """

    OUTAGE_BACKOFF_SECONDS = (0.1, 5.0)
    UNUSABLE_BACKOFF_SECONDS = (1.0, 60.0)

    def __init__(self, settings: OutboxSettings, on_wake: Callable[[], None]) -> None:
        self.url = settings.wake_valkey_url
        self.key = settings.wake_key
        self.timeout = max(1.0, settings.relay_sweep_interval_seconds)
        self.on_wake = on_wake
        self.wakes = 0
        self.connected = False
        self.problems = 0
        """BLPOP calls that failed (unreachable or unusable key); for tests and metrics."""
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
        client = _listener_client(self.url, self.timeout + 5)
        trouble: str | None = None  # "outage" or "unusable"
        delays = {
            "outage": backoff.Doubling(*self.OUTAGE_BACKOFF_SECONDS),
            "unusable": backoff.Doubling(*self.UNUSABLE_BACKOFF_SECONDS),
        }
        while not self._stop.is_set():
            try:
                if trouble == "outage":
                    client.ping()  # know at once that Valkey is back, not after a BLPOP timeout
                    trouble = None
                    delays["outage"].reset()
                    self.connected = True
                    logger.info("wake listener reconnected", extra=log_extra(action="relay.wake_recovered"))
                    self.on_wake()  # wakes pushed during the outage were lost: look now
                item = client.blpop([self.key], timeout=self.timeout)
            except (redis.ResponseError, WakeElementTooLarge) as exc:
                # Valkey answered: the key is unusable (WRONGTYPE, NOPERM, an oversized element)
                self.problems += 1
                metrics.WAKE_LISTENER_ERRORS.labels("unusable").inc()
                if trouble != "unusable":
                    self._warn_unusable(client, exc)
                trouble = "unusable"
                self._stop.wait(delays["unusable"].current)
                delays["unusable"].grow()
                continue
            except (redis.RedisError, OSError) as exc:
                self.problems += 1
                metrics.WAKE_LISTENER_ERRORS.labels("outage").inc()
                self.connected = False
                if trouble != "outage":
                    logger.warning(
                        "wake listener lost Valkey; sweeping only until it returns",
                        extra=log_extra(
                            action="relay.wake_lost",
                            error_type=type(exc).__name__,
                            valkey_url=redact_url(self.url),
                        ),
                    )
                trouble = "outage"
                self._stop.wait(delays["outage"].current)
                delays["outage"].grow()
                continue
            self.connected = True
            if trouble == "unusable":
                logger.info(
                    "wake key usable again",
                    extra=log_extra(action="relay.wake_key_usable", wake_key=self.key),
                )
            trouble = None
            for delay in delays.values():
                delay.reset()
            if item is None:
                continue
            self.wakes += 1
            self.on_wake()  # first: the pass need not wait for the DEL's round trip
            try:
                client.delete(self.key)
            except (redis.RedisError, OSError):
                pass  # the next BLPOP reports whatever is wrong
        client.close()

    def _warn_unusable(self, client: redis.Redis, exc: BaseException) -> None:
        """One warning naming the key and what is wrong with it (its type, if it has one)."""
        if isinstance(exc, WakeElementTooLarge):
            problem = f"held an element of {exc.size_bytes} bytes (a wake is 1 byte), dropped unread"
            kind = "list"
        else:
            kind = self._type_of(client)
            first = str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__
            if first.startswith("WRONGTYPE"):
                problem = f"holds a {kind}, not a list"
            else:
                problem = f"was refused by Valkey: {first}"
        logger.warning(
            "wake key %r %s; wakes are ignored and the relay relies on its sweep until it is fixed",
            self.key,
            problem,
            extra=log_extra(
                action="relay.wake_key_unusable",
                wake_key=self.key,
                key_type=kind,
                error_type=type(exc).__name__,
                valkey_url=redact_url(self.url or ""),
            ),
        )

    def _type_of(self, client: redis.Redis) -> str:
        """``TYPE`` of the wake key (a short status reply, whatever the key holds)."""
        try:
            value = client.type(self.key)
        except (redis.RedisError, OSError, WakeElementTooLarge):
            return "unknown"
        text = value.decode("ascii", "replace") if isinstance(value, bytes) else str(value)
        return text[:40]


class ValkeyUnavailable(Exception):
    """Valkey did not answer a script call (unreachable, timed out, refused the command).

    Attributes:
        error_type: The underlying redis-py/OS error's class name (for logs; never its text,
            which may carry the URL).
    """

    def __init__(self, error_type: str) -> None:
        self.error_type = error_type
        super().__init__(f"Valkey unavailable ({error_type})")


class ScriptRunner:
    """Runs Lua scripts atomically on Valkey, for callers that may not import redis.

    Scripts are loaded once and called by SHA (``EVALSHA``; redis-py's ``Script`` reloads
    a script a restarted server forgot). Every failure surfaces as
    :class:`ValkeyUnavailable`, so a caller decides its own fallback without knowing
    redis-py's exception types. The client has the same short timeouts and no retries as
    the waker's: a hung Valkey costs at most ``timeout_seconds`` per call.

    Args:
        url: Valkey/Redis URL (``valkey_url``).
        timeout_seconds: Connect and command timeout of each call.

    Raises:
        ConfigurationError: ``url`` is not a Valkey/Redis URL.
    """

    def __init__(self, url: str, *, timeout_seconds: float) -> None:
        self.url = url
        self._client = _client(url, timeout_seconds)
        self._scripts: dict[str, Any] = {}

    def run(self, script: str, keys: list[str], args: list[Any]) -> Any:
        """Run ``script`` (Lua source) with ``KEYS``/``ARGV``; returns Valkey's reply.

        Raises:
            ValkeyUnavailable: Valkey did not answer, or refused the script.
        """
        registered = self._scripts.get(script)
        if registered is None:
            registered = self._scripts[script] = self._client.register_script(script)
        try:
            return registered(keys=keys, args=args)
        except (redis.RedisError, OSError) as exc:
            raise ValkeyUnavailable(type(exc).__name__) from None

    def close(self) -> None:
        self._client.close()
