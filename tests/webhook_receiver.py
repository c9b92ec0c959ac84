"""A real HTTP webhook receiver on loopback that answers as told (tests only).

``receiver.script(Reply(500), Reply(200))`` makes the next requests get those answers in
order (then 200s); a reply can wait before answering (a slow receiver), trickle its answer
one byte at a time (a receiver that never trips a per-step timeout), redirect, or send any
status, headers and body. Every request is recorded (path, headers, body, peer address and
port). Optionally serves TLS with a certificate for a chosen name, issued by a test CA.
:class:`ForwardProxy` is an HTTP proxy (absolute-form requests and CONNECT) that records
what it was asked to reach.
"""

from __future__ import annotations

import dataclasses
import http.server
import socket
import ssl
import threading
import time
from collections import deque
from pathlib import Path
from typing import Any


@dataclasses.dataclass(frozen=True)
class Reply:
    status: int = 200
    headers: dict[str, str] = dataclasses.field(default_factory=dict)
    body: bytes = b"ok"
    delay_seconds: float = 0.0
    trickle_seconds: float = 0.0
    """When > 0: the whole answer (status line included) is sent one byte at a time, this
    long apart, until the client goes away."""
    trickle_body_only: bool = False
    """With ``trickle_seconds``: the status line and headers at once, then the body."""


@dataclasses.dataclass(frozen=True)
class Received:
    method: str
    path: str
    headers: dict[str, str]
    body: bytes
    peer: str
    at: float
    peer_port: int = 0


class Receiver:
    def __init__(self, *, host: str = "127.0.0.1", tls: ssl.SSLContext | None = None) -> None:
        self.requests: list[Received] = []
        self.abandoned = 0
        """Trickled answers the client stopped reading (it closed the connection)."""
        self._closed = threading.Event()
        self._script: deque[Reply] = deque()
        self._lock = threading.Lock()
        self.arrived = threading.Condition(self._lock)
        receiver = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_POST(self) -> None:
                length = int(self.headers.get("content-length", "0"))
                body = self.rfile.read(length)
                with receiver._lock:
                    receiver.requests.append(
                        Received(
                            "POST",
                            self.path,
                            {k.lower(): v for k, v in self.headers.items()},
                            body,
                            self.client_address[0],
                            time.monotonic(),
                            int(self.client_address[1]),
                        )
                    )
                    reply = receiver._script.popleft() if receiver._script else Reply()
                    receiver.arrived.notify_all()
                if reply.delay_seconds:
                    time.sleep(reply.delay_seconds)
                if reply.trickle_seconds:
                    self._trickle(reply)
                    return
                try:
                    self.send_response(reply.status)
                    for name, value in reply.headers.items():
                        self.send_header(name, value)
                    self.send_header("content-length", str(len(reply.body)))
                    self.end_headers()
                    self.wfile.write(reply.body)
                except OSError:  # the client gave up (timeout test)
                    pass

            def _trickle(self, reply: Reply) -> None:
                head = f"HTTP/1.1 {reply.status} OK\r\ncontent-length: 100000\r\n\r\n".encode()
                try:
                    if reply.trickle_body_only:
                        self.wfile.write(head)
                        head = b""
                    for byte in head + reply.body * 100_000:
                        self.wfile.write(bytes([byte]))
                        self.wfile.flush()
                        if receiver._closed.wait(reply.trickle_seconds):
                            break
                except OSError:  # the client gave up: what a deadline does
                    with receiver._lock:
                        receiver.abandoned += 1
                self.close_connection = True

            def log_message(self, *args: Any) -> None:
                pass

        family = socket.AF_INET6 if ":" in host else socket.AF_INET

        class Server(http.server.ThreadingHTTPServer):
            address_family = family
            daemon_threads = True

        self.server = Server((host, 0), Handler)
        if tls is not None:
            self.server.socket = tls.wrap_socket(self.server.socket, server_side=True)
        self.host = host
        self.port = int(self.server.server_address[1])
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self._thread.start()

    def url(self, path: str = "/hook", *, host: str | None = None, scheme: str = "http") -> str:
        shown = host or (f"[{self.host}]" if ":" in self.host else self.host)
        return f"{scheme}://{shown}:{self.port}{path}"

    def script(self, *replies: Reply) -> None:
        with self._lock:
            self._script.extend(replies)

    def wait_for(self, count: int, timeout: float = 30.0) -> list[Received]:
        deadline = time.monotonic() + timeout
        with self._lock:
            while len(self.requests) < count:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise AssertionError(f"expected {count} requests, got {len(self.requests)}")
                self.arrived.wait(left)
            return list(self.requests)

    def close(self) -> None:
        self._closed.set()
        self.server.shutdown()
        self.server.server_close()


class ForwardProxy:
    """An HTTP proxy on loopback: forwards absolute-form requests (``POST http://a:p/x``)
    and tunnels CONNECT, byte for byte; ``targets`` records each ``host:port`` asked for."""

    def __init__(self) -> None:
        self.targets: list[str] = []
        self.request_lines: list[str] = []
        self.server = socket.socket()
        self.server.bind(("127.0.0.1", 0))
        self.server.listen(16)
        self.port = int(self.server.getsockname()[1])
        self.url = f"http://127.0.0.1:{self.port}"
        self._stop = threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        self.server.settimeout(0.2)
        while not self._stop.is_set():
            try:
                client, _ = self.server.accept()
            except OSError:
                continue
            threading.Thread(target=self._serve, args=(client,), daemon=True).start()

    def _serve(self, client: socket.socket) -> None:
        from urllib.parse import urlsplit

        with client:
            client.settimeout(10)
            head = b""
            while b"\r\n\r\n" not in head:
                chunk = client.recv(4096)
                if not chunk:
                    return
                head += chunk
            line = head.split(b"\r\n", 1)[0].decode("latin-1")
            self.request_lines.append(line)
            method, target, _ = line.split(" ", 2)
            if method == "CONNECT":
                host, _, port = target.rpartition(":")
            else:
                parts = urlsplit(target)
                host, port = parts.hostname or "", str(parts.port or 80)
            self.targets.append(f"{host.strip('[]')}:{port}")
            with socket.create_connection((host.strip("[]"), int(port)), timeout=10) as upstream:
                if method == "CONNECT":
                    client.sendall(b"HTTP/1.1 200 Connection established\r\n\r\n")
                    head = head.split(b"\r\n\r\n", 1)[1]
                upstream.sendall(head)
                self._pipe(client, upstream)

    @staticmethod
    def _pipe(a: socket.socket, b: socket.socket) -> None:
        import selectors

        with selectors.DefaultSelector() as selector:
            selector.register(a, selectors.EVENT_READ, b)
            selector.register(b, selectors.EVENT_READ, a)
            while True:
                events = selector.select(timeout=10)
                if not events:
                    return
                for key, _ in events:
                    data = key.fileobj.recv(65536)  # type: ignore[union-attr]
                    if not data:
                        return
                    key.data.sendall(data)

    def close(self) -> None:
        self._stop.set()
        self.server.close()


def tls_files(directory: Path, name: str) -> tuple[Path, Path, Path]:
    """A test CA and a server certificate for ``name`` it issued: (ca.pem, cert.pem, key.pem)."""
    import datetime as dt

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = dt.datetime.now(dt.UTC)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "sqla_outbox test CA")])
    ca = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
        .issuer_name(ca_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName([x509.DNSName(name)]), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False
        )
        .add_extension(x509.ExtendedKeyUsage([x509.oid.ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    ca_path, cert_path, key_path = directory / "ca.pem", directory / "cert.pem", directory / "key.pem"
    ca_path.write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
    )
    return ca_path, cert_path, key_path


def server_tls_context(cert: Path, key: Path) -> ssl.SSLContext:
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
    return context
