"""A real HTTP webhook receiver on loopback that answers as told (tests only).

``receiver.script(Reply(500), Reply(200))`` makes the next requests get those answers in
order (then 200s); a reply can wait before answering (a slow receiver), redirect, or send
any status, headers and body. Every request is recorded (path, headers, body, peer).
Optionally serves TLS with a certificate for a chosen name, issued by a test CA.
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


@dataclasses.dataclass(frozen=True)
class Received:
    method: str
    path: str
    headers: dict[str, str]
    body: bytes
    peer: str
    at: float


class Receiver:
    def __init__(self, *, host: str = "127.0.0.1", tls: ssl.SSLContext | None = None) -> None:
        self.requests: list[Received] = []
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
                        )
                    )
                    reply = receiver._script.popleft() if receiver._script else Reply()
                    receiver.arrived.notify_all()
                if reply.delay_seconds:
                    time.sleep(reply.delay_seconds)
                try:
                    self.send_response(reply.status)
                    for name, value in reply.headers.items():
                        self.send_header(name, value)
                    self.send_header("content-length", str(len(reply.body)))
                    self.end_headers()
                    self.wfile.write(reply.body)
                except OSError:  # the client gave up (timeout test)
                    pass

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
        self.server.shutdown()
        self.server.server_close()


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
