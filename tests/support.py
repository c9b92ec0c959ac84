"""Helpers shared by the test suites (no fixtures here; see conftest.py)."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import psycopg
import sqlalchemy as sa
from psycopg import sql

CATALOG: dict[str, Any] = {
    "version": 1,
    "tasks": {
        "send_welcome": {"queue": "default"},
        "index_user": {"queue": "bulk"},
        "charge_card": {"queue": "critical", "scope": "tenant"},
        "rebuild_cache": {"queue": "maintenance", "scope": "platform"},
        "audit": {"queue": "default"},
    },
    "events": {
        "user.created": {"subscribers": ["send_welcome", "index_user"]},
        "nobody.listens": {"subscribers": []},
    },
}

AWS_ENV = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_SESSION_TOKEN": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
    "AWS_REGION": "us-east-1",
}


# --- databases --------------------------------------------------------------------------
def database_url(server_url: str, name: str) -> str:
    parts = urlsplit(server_url)
    return urlunsplit((parts.scheme, parts.netloc, "/" + name, parts.query, parts.fragment))


def create_database(server_url: str, name: str) -> None:
    with psycopg.connect(server_url, autocommit=True) as conn:
        conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))


def drop_database(server_url: str, name: str) -> None:
    with psycopg.connect(server_url, autocommit=True) as conn:
        conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))


def outbox_rows(engine: sa.Engine) -> list[Any]:
    """Every outbox row of both tables, oldest first, with a ``kind`` column."""
    with engine.connect() as conn:
        return list(
            conn.execute(
                sa.text(
                    "SELECT 'tenant' AS kind, id, tenant_id, run_id, queue, envelope, "
                    "available_at, sent_at, attempts, created_at FROM outbox_messages "
                    "UNION ALL SELECT 'platform', id, NULL, run_id, queue, envelope, "
                    "available_at, sent_at, attempts, created_at FROM platform_outbox_messages "
                    "ORDER BY created_at, id"
                )
            )
        )


def runs(engine: sa.Engine) -> list[Any]:
    with engine.connect() as conn:
        return list(conn.execute(sa.text("SELECT * FROM task_runs ORDER BY created_at")))


def count(engine: sa.Engine, table: str) -> int:
    with engine.connect() as conn:
        return int(conn.execute(sa.text(f"SELECT count(*) FROM {table}")).scalar_one())


# --- network ----------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextlib.contextmanager
def black_hole() -> Iterator[str]:
    """A TCP port that accepts connections and never answers: a hung Valkey.

    Yields a ``redis://`` URL pointing at it.
    """
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(64)
    accepted: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        server.settimeout(0.1)
        while not stop.is_set():
            try:
                conn, _ = server.accept()
                accepted.append(conn)
            except OSError:
                continue

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        yield f"redis://127.0.0.1:{server.getsockname()[1]}/0"
    finally:
        stop.set()
        thread.join()
        for conn in accepted:
            conn.close()
        server.close()


def closed_port_url() -> str:
    """A ``redis://`` URL on a port where nothing listens (connection refused)."""
    return f"redis://127.0.0.1:{free_port()}/0"


# --- moto -------------------------------------------------------------------------------
@dataclasses.dataclass
class MotoServer:
    process: subprocess.Popen[bytes]
    endpoint: str

    @classmethod
    def start(cls) -> MotoServer:
        port = free_port()
        env = dict(os.environ)
        env.update(AWS_ENV)
        process = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            env=env,
        )
        endpoint = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if process.poll() is not None:
                raise RuntimeError("moto_server exited at start")
            try:
                urllib.request.urlopen(endpoint + "/moto-api/", timeout=1).close()
                return cls(process, endpoint)
            except OSError:
                time.sleep(0.1)
        process.kill()
        raise RuntimeError("moto_server did not start within 30 s")

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(10)
        except subprocess.TimeoutExpired:
            self.process.kill()


def reset_moto(endpoint: str) -> None:
    request = urllib.request.Request(endpoint + "/moto-api/reset", method="POST")
    urllib.request.urlopen(request, timeout=10).close()


def wait_for(predicate: Any, timeout: float = 10.0, interval: float = 0.05) -> Any:
    """Poll ``predicate`` until it returns a truthy value; return it or raise."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout} s: {predicate}")
        time.sleep(interval)
