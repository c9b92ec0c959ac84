"""One HTTP exchange under one wall-clock deadline: connect, TLS, send and read together.

httpx and httpcore bound each network step (``Timeout(connect=, read=, write=)``): a read
that waits longer than its timeout fails, but a peer that sends one byte just before each
timeout keeps an exchange going for as long as it likes. A webhook receiver is written by
a tenant, so a delivery attempt needs a bound on the whole exchange, and the thread and
worker slot it holds must be free when it passes.

:class:`DeadlineBackend` is an httpcore network backend (httpcore, "Network backends":
``ConnectionPool(network_backend=...)``) whose streams cut every socket operation to
what is left of one deadline (``time.monotonic()``): connecting, each ``recv`` and
``send``, and the TLS handshake (CPython's ``SSLSocket`` applies a socket timeout to the
whole handshake and to a whole read, Python ``ssl`` documentation, "Notes on non-blocking
sockets" and socket timeouts). An operation started with nothing left fails at once with
httpcore's timeout exception of that step, so the exchange ends at the deadline whatever
the peer does, and the caller's thread returns.

Each :func:`exchange` opens its own connection pool (a fresh connection per attempt,
never reused) and closes it when the answer has been read (``max_bytes`` of body at
most; the rest is never read). Proxy variables of the environment are not read (httpcore
never reads them): a proxy is used only when given (``proxy_url``).
"""

from __future__ import annotations

import dataclasses
import socket
import ssl
import time
from collections.abc import Iterable, Mapping
from typing import Any
from urllib.parse import unquote, urlsplit, urlunsplit

import httpcore

_NO_TIME = "the attempt's deadline passed"


class _Stream(httpcore.NetworkStream):
    """A socket whose every operation ends by ``deadline`` (monotonic seconds)."""

    def __init__(self, sock: socket.socket, deadline: float) -> None:
        self._sock = sock
        self._deadline = deadline

    def _left(self, timeout: float | None, failure: type[Exception]) -> float:
        left = self._deadline - time.monotonic()
        if left <= 0:
            raise failure(_NO_TIME)
        return left if timeout is None else min(timeout, left)

    def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        try:
            self._sock.settimeout(self._left(timeout, httpcore.ReadTimeout))
            return self._sock.recv(max_bytes)
        except TimeoutError as exc:  # socket.timeout
            raise httpcore.ReadTimeout(str(exc) or _NO_TIME) from exc
        except OSError as exc:
            raise httpcore.ReadError(str(exc)) from exc

    def write(self, buffer: bytes, timeout: float | None = None) -> None:
        try:
            while buffer:  # each send waits at most what is left (a slow reader cannot stretch it)
                self._sock.settimeout(self._left(timeout, httpcore.WriteTimeout))
                sent = self._sock.send(buffer)
                buffer = buffer[sent:]
        except TimeoutError as exc:
            raise httpcore.WriteTimeout(str(exc) or _NO_TIME) from exc
        except OSError as exc:
            raise httpcore.WriteError(str(exc)) from exc

    def close(self) -> None:
        self._sock.close()

    def start_tls(
        self, ssl_context: ssl.SSLContext, server_hostname: str | None = None, timeout: float | None = None
    ) -> httpcore.NetworkStream:
        try:
            self._sock.settimeout(self._left(timeout, httpcore.ConnectTimeout))  # the whole handshake
            wrapped = ssl_context.wrap_socket(self._sock, server_hostname=server_hostname)
        except TimeoutError as exc:
            self.close()
            raise httpcore.ConnectTimeout(str(exc) or _NO_TIME) from exc
        except OSError as exc:  # ssl.SSLError included: a certificate that does not verify
            self.close()
            raise httpcore.ConnectError(str(exc)) from exc
        except BaseException:
            self.close()
            raise
        return _Stream(wrapped, self._deadline)

    def get_extra_info(self, info: str) -> Any:
        if info == "ssl_object" and isinstance(self._sock, ssl.SSLSocket):
            return self._sock._sslobj  # type: ignore[attr-defined]  # what httpcore's own stream returns
        if info == "client_addr":
            return self._sock.getsockname()
        if info == "server_addr":
            return self._sock.getpeername()
        if info == "socket":
            return self._sock
        if info == "is_readable":
            return False  # never reused: one exchange per pool
        return None


class DeadlineBackend(httpcore.NetworkBackend):
    """httpcore's network backend for one exchange that must end by ``deadline``.

    Args:
        deadline: ``time.monotonic()`` value by which every operation ends.
    """

    def __init__(self, deadline: float) -> None:
        self.deadline = deadline

    def connect_tcp(
        self,
        host: str,
        port: int,
        timeout: float | None = None,
        local_address: str | None = None,
        socket_options: Iterable[Any] | None = None,
    ) -> httpcore.NetworkStream:
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise httpcore.ConnectTimeout(_NO_TIME)
        source = None if local_address is None else (local_address, 0)
        try:
            sock = socket.create_connection(
                (host, port), left if timeout is None else min(timeout, left), source_address=source
            )
        except TimeoutError as exc:
            raise httpcore.ConnectTimeout(str(exc) or _NO_TIME) from exc
        except OSError as exc:
            raise httpcore.ConnectError(str(exc)) from exc
        try:
            for option in socket_options or ():
                sock.setsockopt(*option)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except OSError as exc:
            sock.close()
            raise httpcore.ConnectError(str(exc)) from exc
        return _Stream(sock, self.deadline)

    def sleep(self, seconds: float) -> None:
        time.sleep(max(0.0, min(seconds, self.deadline - time.monotonic())))


@dataclasses.dataclass(frozen=True)
class Answer:
    """What came back.

    Attributes:
        status: HTTP status code.
        headers: Header names lowercase, values as text (latin-1, as HTTP defines them).
        body: The first ``max_bytes`` bytes of the body (at most), never decompressed.
        truncated: The body had more than ``max_bytes`` bytes (or did not end in time).
    """

    status: int
    headers: dict[str, str]
    body: bytes
    truncated: bool


def exchange(
    method: str,
    url: str,
    *,
    headers: Mapping[str, str],
    body: bytes,
    deadline: float,
    max_bytes: int,
    ssl_context: ssl.SSLContext | None,
    sni_hostname: str | None = None,
    proxy_url: str | None = None,
) -> Answer:
    """Send one request and read its answer, all of it by ``deadline``.

    Args:
        method / url: The request (``url`` may carry an IP literal: nothing is resolved).
        headers: Request headers (``Host`` included when it differs from the URL's host).
        body: Request body.
        deadline: ``time.monotonic()`` by which the exchange ends.
        max_bytes: Most body bytes read (one more is read to tell truncation).
        ssl_context: For ``https`` (certificate checks); None for ``http``.
        sni_hostname: The name TLS sends (SNI) and checks the certificate against, when
            ``url`` carries an address.
        proxy_url: An HTTP proxy to go through (CONNECT for ``https``); None: direct.

    Returns:
        The :class:`Answer`. A body cut by the deadline after the status and headers came
        is returned as read so far (``truncated``).

    Raises:
        httpcore.TimeoutException: The deadline (or a step's own timeout) passed before
            the status and headers were read.
        httpcore.NetworkError, httpcore.ProtocolError, httpcore.ProxyError: Nothing usable
            came back (refused, reset, TLS failure, not HTTP).
    """
    backend = DeadlineBackend(deadline)
    step = max(deadline - time.monotonic(), 0.001)
    pool: httpcore.ConnectionPool
    if proxy_url is not None:
        pool = httpcore.HTTPProxy(
            proxy_url=_without_credentials(proxy_url),
            proxy_auth=_proxy_auth(proxy_url),
            ssl_context=ssl_context,
            max_connections=1,
            retries=0,
            network_backend=backend,
        )
    else:
        pool = httpcore.ConnectionPool(
            ssl_context=ssl_context, max_connections=1, retries=0, network_backend=backend
        )
    extensions: dict[str, Any] = {"timeout": {"connect": step, "read": step, "write": step, "pool": step}}
    if sni_hostname is not None:
        extensions["sni_hostname"] = sni_hostname
    with (
        pool,
        pool.stream(
            method, url, headers=list(headers.items()), content=body, extensions=extensions
        ) as response,
    ):
        read, cut = b"", False
        try:
            for chunk in response.iter_stream():
                read += chunk
                if len(read) > max_bytes:
                    break
        except httpcore.TimeoutException:
            cut = True  # the status came: what was read is the answer
        return Answer(
            status=response.status,
            headers={
                name.decode("latin-1").lower(): value.decode("latin-1") for name, value in response.headers
            },
            body=read[:max_bytes],
            truncated=cut or len(read) > max_bytes,
        )


def _proxy_auth(proxy_url: str) -> tuple[str, str] | None:
    """``(user, password)`` from the proxy URL's user information (Basic proxy auth)."""
    parts = urlsplit(proxy_url)
    if parts.username is None:
        return None
    return unquote(parts.username), unquote(parts.password or "")


def _without_credentials(proxy_url: str) -> str:
    parts = urlsplit(proxy_url)
    return urlunsplit(parts._replace(netloc=parts.netloc.rpartition("@")[2]))
