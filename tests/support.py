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
from pathlib import Path
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

WEBHOOK_CATALOG: dict[str, Any] = {
    **CATALOG,
    "tasks": {**CATALOG["tasks"], "webhooks.deliver": {"queue": "default", "scope": "tenant"}},
    "events": {
        **CATALOG["events"],
        "order.paid": {"subscribers": ["send_welcome", "webhooks.deliver"]},
        "invoice.sent": {"subscribers": ["webhooks.deliver"]},
    },
}
"""The test catalog plus two webhook events (``webhooks.deliver`` among their subscribers)."""

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
                    "available_at, sent_at, attempts, created_at, priority FROM outbox_messages "
                    "UNION ALL SELECT 'platform', id, NULL, run_id, queue, envelope, "
                    "available_at, sent_at, attempts, created_at, priority FROM platform_outbox_messages "
                    "ORDER BY created_at, id"
                )
            )
        )


def runs(engine: sa.Engine) -> list[Any]:
    with engine.connect() as conn:
        return list(conn.execute(sa.text("SELECT * FROM task_runs ORDER BY created_at")))


@contextlib.contextmanager
def cyclic_garbage(*types: type) -> Iterator[list[str]]:
    """Collect the objects of ``types`` that the block leaves to the cyclic garbage collector
    (unreachable, yet not freed by reference counting: part of, or held by, a reference
    cycle). The list, filled when the block ends, names their types; empty when reference
    counting freed everything the block made."""
    import gc

    found: list[str] = []
    gc.collect()
    was_enabled = gc.isenabled()
    gc.disable()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        yield found
        gc.collect()
        found.extend(type(o).__name__ for o in gc.garbage if isinstance(o, types))
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        if was_enabled:
            gc.enable()


class StatementFailed(Exception):
    """Raised by :func:`failing_statement` in place of a statement."""


@contextlib.contextmanager
def failing_statement(engine: sa.Engine, marker: str, *, nth: int = 1) -> Iterator[None]:
    """Within the block, the ``nth`` statement whose SQL contains ``marker`` raises
    :class:`StatementFailed` before it reaches PostgreSQL (a cursor event on ``engine``,
    which every write path fires), as a failing statement would."""
    seen = 0

    def fail(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        nonlocal seen
        if marker in statement:
            seen += 1
            if seen == nth:
                raise StatementFailed(marker)

    sa.event.listen(engine, "before_cursor_execute", fail)
    try:
        yield
    finally:
        sa.event.remove(engine, "before_cursor_execute", fail)


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
ROOT = Path(__file__).resolve().parent.parent


@dataclasses.dataclass
class MotoServer:
    """A moto SQS server subprocess behind the AWS-strict layer (:mod:`tests.strict_sqs`).

    ``strict=False`` serves plain moto (with :func:`sqla_outbox.moto_server.patch_moto`),
    for measuring what the strict layer costs.
    """

    process: subprocess.Popen[bytes]
    endpoint: str

    @classmethod
    def start(cls, *, strict: bool = True) -> MotoServer:
        port = free_port()
        env = dict(os.environ)
        env.update(AWS_ENV)
        module = "tests.strict_sqs" if strict else "sqla_outbox.moto_server"
        process = subprocess.Popen(
            [sys.executable, "-m", module, "-H", "127.0.0.1", "-p", str(port)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            env=env,
            cwd=ROOT,
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


# --- a cuttable TCP proxy (an SQS endpoint that goes away and comes back) ----------------
class TcpProxy:
    """Forwards a loopback port to ``target``; :meth:`disable` makes it refuse service.

    While disabled, open connections are cut and new ones are closed at once, which is
    what a client sees when an endpoint is down. :meth:`freeze` stops forwarding on the
    connections open now without closing them, as a proxy or NAT that lost their state.
    """

    def __init__(self, target_host: str, target_port: int) -> None:
        self.target = (target_host, target_port)
        self.server = socket.socket()
        self.server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.server.bind(("127.0.0.1", 0))
        self.server.listen(128)
        self.port = int(self.server.getsockname()[1])
        self.enabled = True
        self.hanging = threading.Event()
        self._stop = threading.Event()
        self._conns: list[socket.socket] = []
        self._frozen: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def disable(self) -> None:
        self.enabled = False
        self._cut()

    def enable(self) -> None:
        self.enabled = True

    def freeze(self) -> None:
        """Stop forwarding on every connection open now and keep its sockets open: what
        arrives is read and dropped, both ways, so each side's TCP stack (keepalives
        included) is still answered and neither sees the connection fail. New connections
        are forwarded (unless disabled)."""
        with self._lock:
            self._frozen.update(self._conns)

    def hang(self) -> None:
        """Stop forwarding anything (calls in flight and new ones block), as a hung endpoint."""
        self.hanging.set()

    def unhang(self) -> None:
        """Resume for new connections; requests that were held are dropped with their
        connections (they never reach the endpoint), as after a real outage."""
        self._cut()
        self.hanging.clear()

    def _cut(self) -> None:
        with self._lock:
            for conn in self._conns:
                with contextlib.suppress(OSError):
                    conn.shutdown(socket.SHUT_RDWR)
                conn.close()
            self._conns.clear()
            self._frozen.clear()

    def close(self) -> None:
        self._stop.set()
        self.disable()
        self.server.close()

    def _accept(self) -> None:
        self.server.settimeout(0.2)
        while not self._stop.is_set():
            try:
                client, _ = self.server.accept()
            except OSError:
                continue
            if not self.enabled:
                client.close()
                continue
            try:
                upstream = socket.create_connection(self.target, timeout=5)
            except OSError:
                client.close()
                continue
            upstream.settimeout(None)  # an idle or hung endpoint is waited on, as a client would
            with self._lock:
                self._conns += [client, upstream]
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    def _pipe(self, source: socket.socket, sink: socket.socket) -> None:
        try:
            while True:
                data = source.recv(65536)
                if not data:
                    break
                if source in self._frozen:
                    continue  # read and dropped: the peer never hears of it
                if self.hanging.is_set():
                    while self.hanging.is_set() and not self._stop.is_set():
                        time.sleep(0.05)
                    break  # held requests are dropped: their connections were cut
                sink.sendall(data)
        except OSError:
            pass
        finally:
            with contextlib.suppress(OSError):
                sink.shutdown(socket.SHUT_WR)


# --- SQS helpers --------------------------------------------------------------------------
def sqs_client(endpoint: str, *, protocol: str = "json") -> Any:
    """A boto3 SQS client; ``protocol="query"`` speaks SQS's older query protocol (form
    requests, XML answers), as botocore releases before the JSON protocol did."""
    import boto3

    if protocol == "query":
        return _query_protocol_client(endpoint)
    return boto3.client(
        "sqs",
        endpoint_url=endpoint,
        region_name="us-east-1",
        aws_access_key_id="testing",
        aws_secret_access_key="testing",
    )


# The SQS service model botocore ships today is JSON-only; these member names (from the
# query-protocol model SQS had before) make botocore serialise and parse the query protocol.
_QUERY_LOCATION_NAMES = {
    ("SendMessageBatchRequest", "Entries"): "SendMessageBatchRequestEntry",
    ("DeleteMessageBatchRequest", "Entries"): "DeleteMessageBatchRequestEntry",
    ("ChangeMessageVisibilityBatchRequest", "Entries"): "ChangeMessageVisibilityBatchRequestEntry",
    ("SendMessageRequest", "MessageAttributes"): "MessageAttribute",
    ("SendMessageRequest", "MessageSystemAttributes"): "MessageSystemAttribute",
    ("SendMessageBatchRequestEntry", "MessageAttributes"): "MessageAttribute",
    ("SendMessageBatchRequestEntry", "MessageSystemAttributes"): "MessageSystemAttribute",
    ("ReceiveMessageRequest", "AttributeNames"): "AttributeName",
    ("ReceiveMessageRequest", "MessageAttributeNames"): "MessageAttributeName",
    ("ReceiveMessageRequest", "MessageSystemAttributeNames"): "MessageSystemAttributeName",
    ("ReceiveMessageResult", "Messages"): "Message",
    ("Message", "Attributes"): "Attribute",
    ("Message", "MessageAttributes"): "MessageAttribute",
    ("SendMessageBatchResult", "Successful"): "SendMessageBatchResultEntry",
    ("SendMessageBatchResult", "Failed"): "BatchResultErrorEntry",
    ("DeleteMessageBatchResult", "Successful"): "DeleteMessageBatchResultEntry",
    ("DeleteMessageBatchResult", "Failed"): "BatchResultErrorEntry",
    ("ChangeMessageVisibilityBatchResult", "Successful"): "ChangeMessageVisibilityBatchResultEntry",
    ("ChangeMessageVisibilityBatchResult", "Failed"): "BatchResultErrorEntry",
    ("GetQueueAttributesRequest", "AttributeNames"): "AttributeName",
    ("GetQueueAttributesResult", "Attributes"): "Attribute",
    ("CreateQueueRequest", "Attributes"): "Attribute",
    ("CreateQueueRequest", "tags"): "Tag",
    ("SetQueueAttributesRequest", "Attributes"): "Attribute",
    ("ListQueuesResult", "QueueUrls"): "QueueUrl",
}


def _query_protocol_client(endpoint: str) -> Any:
    import copy
    import json
    import tempfile

    import botocore.session

    model = copy.deepcopy(
        botocore.session.get_session().get_component("data_loader").load_service_model("sqs", "service-2")
    )
    model["metadata"].update(
        protocol="query", protocols=["query"], xmlNamespace="http://queue.amazonaws.com/doc/2012-11-05/"
    )
    for (shape, member), name in _QUERY_LOCATION_NAMES.items():
        model["shapes"][shape]["members"][member]["locationName"] = name
    for shape in model["shapes"].values():
        if shape.get("type") == "map":
            shape["key"]["locationName"] = "Name"
            shape["value"]["locationName"] = "Value"
    for name, operation in model["operations"].items():
        if "output" in operation:
            operation["output"]["resultWrapper"] = f"{name}Result"
    directory = Path(tempfile.mkdtemp(prefix="sqs-query-model-"))
    (directory / "sqs" / "2012-11-05").mkdir(parents=True)
    (directory / "sqs" / "2012-11-05" / "service-2.json").write_text(json.dumps(model))
    session = botocore.session.get_session()
    session.get_component("data_loader").search_paths.insert(0, str(directory))
    return session.create_client(
        "sqs",
        endpoint_url=endpoint,
        region_name="us-east-1",
        aws_access_key_id="testing",
        aws_secret_access_key="testing",
    )


def refuse_messages(
    endpoint: str,
    marker: str,
    code: str = "",
    *,
    sender_fault: bool = True,
    message: str = "",
    clear: bool = False,
) -> None:
    """Make the strict SQS layer fail every message whose body contains ``marker`` (as SQS
    fails an entry it does not take), or stop doing so (``clear``)."""
    import json

    document = {
        "marker": marker,
        "code": code,
        "message": message,
        "sender_fault": sender_fault,
        "clear": clear,
    }
    request = urllib.request.Request(
        endpoint + "/strict-sqs/refuse", data=json.dumps(document).encode(), method="POST"
    )
    urllib.request.urlopen(request, timeout=10).close()


def deny_calls(
    endpoint: str,
    queue: str,
    action: str = "SendMessageBatch",
    *,
    code: str = "AccessDenied",
    clear: bool = False,
) -> None:
    """Make the strict SQS layer fail every ``action`` call on the queue named ``queue`` (as an
    IAM or KMS denial does: HTTP 403), or stop doing so (``clear``)."""
    import json

    document = {"action": action, "queue": queue, "code": code, "clear": clear}
    request = urllib.request.Request(
        endpoint + "/strict-sqs/deny", data=json.dumps(document).encode(), method="POST"
    )
    urllib.request.urlopen(request, timeout=10).close()


def backdate_first_receive(endpoint: str, message_id: str, epoch_seconds: float) -> None:
    """Tell the strict SQS layer a message was first received at ``epoch_seconds``."""
    import json

    body = json.dumps({"message_id": message_id, "epoch_seconds": epoch_seconds}).encode()
    request = urllib.request.Request(endpoint + "/strict-sqs/first-receive", data=body, method="POST")
    urllib.request.urlopen(request, timeout=10).close()


def receive_all(
    client: Any, queue_url: str, *, expect: int | None = None, timeout: float = 30.0, visibility: int = 600
) -> list[dict[str, Any]]:
    """Receive every message of a queue (hidden for ``visibility`` s, not deleted).

    Stops when ``expect`` messages arrived, or after two empty receives in a row.
    """
    messages: list[dict[str, Any]] = []
    deadline = time.monotonic() + timeout
    empty = 0
    while time.monotonic() < deadline:
        response = client.receive_message(
            QueueUrl=queue_url,
            MaxNumberOfMessages=10,
            VisibilityTimeout=visibility,
            WaitTimeSeconds=0 if expect is None else 1,
            MessageAttributeNames=["All"],
            AttributeNames=["All"],
        )
        batch = response.get("Messages", [])
        messages.extend(batch)
        if expect is not None and len(messages) >= expect:
            break
        empty = empty + 1 if not batch else 0
        if expect is None and empty >= 2:
            break
    return messages


# --- processes ----------------------------------------------------------------------------
class ServiceProcess:
    """A relay or worker subprocess whose JSON log lines are collected as they come."""

    def __init__(self, args: list[str], env: dict[str, str], name: str, cwd: str | None = None) -> None:
        import json as _json

        self._json = _json
        self.name = name
        self.process = subprocess.Popen(
            args, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=cwd
        )
        self.logs: list[dict[str, Any]] = []
        self.raw: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.process.stderr is not None
        for line in self.process.stderr:
            self.raw.append(line)
            try:
                self.logs.append(self._json.loads(line))
            except ValueError:
                continue

    def actions(self, action: str) -> list[dict[str, Any]]:
        return [entry for entry in list(self.logs) if entry.get("action") == action]

    def wait_for_action(self, action: str, timeout: float = 20.0, count: int = 1) -> dict[str, Any]:
        def found() -> Any:
            if self.process.poll() is not None and len(self.actions(action)) < count:
                raise AssertionError(
                    f"{self.name} exited ({self.process.returncode}):\n" + "".join(self.raw[-40:])
                )
            hits = self.actions(action)
            return hits[count - 1] if len(hits) >= count else None

        return wait_for(found, timeout=timeout)

    def terminate(self, timeout: float = 60.0) -> int:
        import signal as _signal

        if self.process.poll() is None:
            self.process.send_signal(_signal.SIGTERM)
        return self.process.wait(timeout)

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait(30)

    def output(self) -> str:
        return "".join(self.raw)


def service_env(settings: Any, endpoint: str, **extra: str) -> dict[str, str]:
    """Environment for a relay/worker subprocess from test settings."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SQLA_OUTBOX_")}
    env.update(AWS_ENV)
    env.update(
        {
            "SQLA_OUTBOX_DATABASE_URL": settings.database_url,
            "SQLA_OUTBOX_VALKEY_URL": settings.valkey_url or "none",
            "SQLA_OUTBOX_WAKE_MODE": settings.wake_mode,
            "SQLA_OUTBOX_WAKE_KEY": settings.wake_key,
            "SQLA_OUTBOX_QUEUE_PREFIX": settings.queue_prefix,
            "SQLA_OUTBOX_SQS_ENDPOINT_URL": endpoint,
            "SQLA_OUTBOX_CATALOG_PATH": settings.catalog_path,
            "SQLA_OUTBOX_RELAY_SWEEP_INTERVAL_SECONDS": str(settings.relay_sweep_interval_seconds),
        }
    )
    env.update(extra)
    return env


def run_cli(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    """``python -m sqla_outbox <args>`` with ``env`` (e.g. :func:`service_env`), output as text."""
    return subprocess.run(
        [sys.executable, "-m", "sqla_outbox", *args], capture_output=True, text=True, env=env, timeout=120
    )


def start_relay(settings: Any, endpoint: str, name: str = "relay", **extra: str) -> ServiceProcess:
    args = [sys.executable, "-m", "sqla_outbox.relay", "--log-format", "json"]
    return ServiceProcess(args, service_env(settings, endpoint, **extra), name)


def start_worker(
    settings: Any, endpoint: str, name: str = "worker", imports: str = "tests.e2e.worker_tasks", **extra: str
) -> ServiceProcess:
    args = [sys.executable, "-m", "sqla_outbox.worker", "--log-format", "json", "--imports", imports]
    env = service_env(settings, endpoint, **extra)
    env.setdefault("SQLA_OUTBOX_WORKER_WAIT_SECONDS", "1")
    env.setdefault("SQLA_OUTBOX_WORKER_BACKOFF_BASE_SECONDS", "0.5")
    env.setdefault("SQLA_OUTBOX_WORKER_BACKOFF_MAX_SECONDS", "2")
    return ServiceProcess(args, env, name)


def set_visibility(client: Any, queue_url: str, seconds: int) -> None:
    client.set_queue_attributes(QueueUrl=queue_url, Attributes={"VisibilityTimeout": str(seconds)})


def run_row(engine: sa.Engine, run_id: Any) -> Any:
    with engine.connect() as conn:
        return conn.execute(sa.text("SELECT * FROM task_runs WHERE run_id = :r"), {"r": run_id}).one()


def trail(engine: sa.Engine, run_id: Any) -> list[Any]:
    with engine.connect() as conn:
        return list(
            conn.execute(sa.text("SELECT * FROM task_run_trail WHERE run_id = :r ORDER BY id"), {"r": run_id})
        )


def effects(engine: sa.Engine, run_id: Any = None) -> list[Any]:
    with engine.connect() as conn:
        if run_id is None:
            return list(conn.execute(sa.text("SELECT * FROM effects ORDER BY id")))
        return list(
            conn.execute(sa.text("SELECT * FROM effects WHERE run_id = :r ORDER BY id"), {"r": run_id})
        )


def status_of(engine: sa.Engine, run_id: Any) -> str:
    return str(run_row(engine, run_id).status)


def drain_wakes(timeout: float = 3.0) -> None:
    """Wait until every installed waker pushed (or gave up on) its pending wakes."""
    from sqla_outbox import events

    for installation in list(events._installations.values()):
        installation.waker.drain(timeout)


@contextlib.contextmanager
def private_valkey(*options: str) -> Iterator[str]:
    """A ``valkey-server``/``redis-server`` of this test's own on a free loopback port, so a
    test may change users or fill keys without touching the shared one; yields its URL."""
    import shutil

    import redis

    server = shutil.which("valkey-server") or shutil.which("redis-server")
    assert server is not None, "valkey-server or redis-server is needed for this test"
    port = free_port()
    process = subprocess.Popen(
        [server, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no", *options],
        stdout=subprocess.DEVNULL,
    )
    url = f"redis://127.0.0.1:{port}/0"
    try:
        wait_for(lambda: _answers(redis, url), timeout=10)
        yield url
    finally:
        process.kill()
        process.wait(10)


def _answers(redis: Any, url: str) -> bool:
    try:
        redis.Redis.from_url(url, socket_connect_timeout=1).ping()
        return True
    except redis.RedisError:
        return False


# --- ASGI apps (the dashboard) ------------------------------------------------------------
@contextlib.contextmanager
def serve_asgi(app: Any) -> Iterator[str]:
    """Serve ``app`` with uvicorn on a free loopback port in a thread; yield its base URL."""
    import uvicorn

    config = uvicorn.Config(
        app, host="127.0.0.1", port=free_port(), log_config=None, access_log=False, lifespan="on"
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        wait_for(lambda: server.started or not thread.is_alive(), timeout=20)
        if not server.started:
            raise RuntimeError("uvicorn did not start")
        yield f"http://127.0.0.1:{config.port}"
    finally:
        server.should_exit = True
        thread.join(15)


def csrf_token(html: str) -> str:
    """The CSRF token a dashboard page carries (``<meta name="csrf-token">``, and its forms)."""
    import re

    match = re.search(r'<meta name="csrf-token" content="([^"]+)">', html)
    assert match, "no CSRF token in the page"
    return match.group(1)


@dataclasses.dataclass(frozen=True)
class WheelEnvironment:
    """A fresh virtualenv with sqla_outbox installed from a wheel built from this checkout.

    ``python`` is its interpreter; ``dependencies`` the test environment's site-packages, to
    put on ``PYTHONPATH`` (the wheel is installed with ``--no-deps``: no network, and the
    dependencies are the ones the suite runs on). An editable install of this checkout in
    that folder is not picked up from ``PYTHONPATH`` (its ``.pth`` hook only runs in a site
    directory), so ``import sqla_outbox`` finds the wheel's copy.
    """

    python: str
    bin: Path
    dependencies: str


def wheel_environment(folder: Path) -> WheelEnvironment:
    """Build the wheel (``build --no-isolation``) and install it in ``folder/venv``."""
    root = Path(__file__).resolve().parents[1]
    dist = folder / "dist"
    subprocess.run(
        [sys.executable, "-m", "build", "--wheel", "--no-isolation", "--outdir", str(dist), str(root)],
        check=True,
        capture_output=True,
        timeout=300,
    )
    [wheel] = dist.glob("*.whl")
    venv = folder / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    python = str(venv / "bin" / "python")
    subprocess.run([python, "-m", "pip", "install", "--no-deps", "-q", str(wheel)], check=True, timeout=300)
    deps = next(p for p in sys.path if p.endswith("site-packages"))
    return WheelEnvironment(python=python, bin=venv / "bin", dependencies=deps)
