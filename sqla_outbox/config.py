"""One frozen settings object for the API side, the relay and the worker.

Only the composition root (the CLI, or the application's start-up code) calls
:meth:`OutboxSettings.from_env`; everything else receives the object as an argument.

Every field has one canonical environment variable with the ``SQLA_OUTBOX_`` prefix
(``worker_concurrency`` → ``SQLA_OUTBOX_WORKER_CONCURRENCY``). A few fields also accept
the bare names deployments already use (``DATABASE_URL``, ``REDIS_URL``, ``QUEUES``).
Precedence: explicit keyword (CLI option) > prefixed variable > bare alias > default.

AWS region and credentials are never declared here: boto3 reads them from its own chain
(``AWS_REGION``, ``AWS_PROFILE``, instance roles, ...). ``docs/configuration.md`` is
generated from the declarations below (``python -m sqla_outbox config --reference``); each
field's type is its annotation and its range, choices and secrecy are keywords of its
``setting(...)`` (:mod:`sqla_outbox.settings_schema`).
"""

from __future__ import annotations

import dataclasses
import functools
import ipaddress
import os
from collections.abc import Mapping
from typing import Any
from urllib.parse import urlsplit

from sqlalchemy import exc as sqlalchemy_exc
from sqlalchemy.engine import make_url

from sqla_outbox import destinations, errors, operators, queues, settings_schema
from sqla_outbox.settings_schema import setting
from sqla_outbox.types import QUEUE_NAMES, is_queue_name
from sqla_outbox.urls import MASK as MASK
from sqla_outbox.urls import redact_text as redact_text
from sqla_outbox.urls import redact_url as redact_url
from sqla_outbox.urls import sqlalchemy_url as sqlalchemy_url
from sqla_outbox.urls import with_database as with_database

ENV_PREFIX = "SQLA_OUTBOX_"

SQS_MAX_MESSAGE_BYTES = 1_048_576
"""SQS's current maximum message size (1 MiB). The default limit stays at 256 KiB."""

SQS_MAX_VISIBILITY_SECONDS = 43_200
"""SQS VisibilityTimeout maximum (12 hours); the minimum is 0."""

WAKE_MODES = ("auto", "valkey", "postgres", "both", "none")
"""Values of ``wake_mode``; :attr:`OutboxSettings.wake_channels` says what each turns on."""

VALKEY_SCHEMES = ("redis://", "rediss://", "unix://", "valkey://", "valkeys://")
"""URL schemes accepted for ``valkey_url`` (``valkey``/``valkeys`` are read as redis/rediss)."""


# --- rules no bound expresses: ``check=`` of the fields below -----------------------------
# Each returns what is wrong with one value, or None (settings_schema.Setting.check); URLs
# are shown with their passwords masked, secrets not at all.
def _database_url_problem(url: str) -> str | None:
    """``database_url``, ``database_direct_url``: PostgreSQL through psycopg 3, parseable by
    SQLAlchemy, no raw ``@`` in the password (libpq ends the password at the first ``@``)."""
    if not url:
        return "must not be empty"
    shown = redact_url(url)
    try:
        parsed = make_url(sqlalchemy_url(url))
    except (sqlalchemy_exc.ArgumentError, ValueError):
        return f"{shown!r} is not a database URL; expected postgresql://user:password@host:5432/database"
    if parsed.drivername != "postgresql+psycopg":
        return (
            f"{parsed.drivername!r} is not supported ({shown}): sqla_outbox supports only PostgreSQL "
            "(through psycopg 3); use postgresql://user:password@host:5432/database"
        )
    if "@" in (parsed.host or ""):
        return (
            f"{shown!r} has an '@' in its password: write it as %40 (SQLAlchemy and libpq end the "
            "password at the first '@' and would take the rest for the host name)"
        )
    return None


def _valkey_url_problem(url: str) -> str | None:
    """``valkey_url``: one of :data:`VALKEY_SCHEMES` (the schemes redis-py's ``from_url`` reads)."""
    if url.startswith(VALKEY_SCHEMES):
        return None
    return (
        f"{redact_url(url)!r} is not a redis://, rediss://, valkey:// or unix:// URL "
        "(or `none` to run without Valkey)"
    )


def _endpoint_url_problem(url: str) -> str | None:
    """``sqs_endpoint_url``: an absolute ``http(s)://host[:port]`` URL (boto3 ``endpoint_url``)."""
    try:
        parts = urlsplit(url)
        valid = parts.scheme in ("http", "https") and bool(parts.hostname)
        valid = valid and (parts.port is None or parts.port > 0)
    except ValueError:  # a port that is not a number
        valid = False
    if valid:
        return None
    return (
        f"{redact_url(url)!r} is not an http:// or https:// URL (example: http://127.0.0.1:4566); "
        "unset it to use AWS's endpoint for the region"
    )


def _queue_visibility_problem(entries: tuple[str, ...]) -> str | None:
    """``queue_visibility_timeouts``: each ``name=seconds``, a queue name and 0..43200 s
    (SQS VisibilityTimeout)."""
    for entry in entries:
        name, equals, seconds = entry.partition("=")
        if not (equals and is_queue_name(name.strip()) and seconds.strip().isdigit()):
            return f"{entry!r} is not name=seconds (a queue name and a whole number of seconds)"
        if not 0 <= int(seconds) <= SQS_MAX_VISIBILITY_SECONDS:
            return f"{entry!r}: must be within 0..{SQS_MAX_VISIBILITY_SECONDS} s (SQS VisibilityTimeout)"
    return None


def _worker_queues_problem(queues: tuple[str, ...]) -> str | None:
    """``worker_queues``: at least one queue name; declared queues are checked against the
    catalog when the worker starts."""
    if not queues:
        return "must name at least one queue"
    for queue in queues:
        if not is_queue_name(queue):
            return (
                f"{queue!r} is not a queue name (1..40 letters, digits, '-' and '_'); the four "
                f"defaults are {', '.join(QUEUE_NAMES)}"
            )
    return None


def _basic_auth_problem(credentials: str) -> str | None:
    """``dashboard_basic_auth``: ``user:password``, the password at least 12 characters
    (neither is shown)."""
    user, colon, password = credentials.partition(":")
    if user and colon and len(password) >= 12:
        return None
    return "must be user:password with a password of at least 12 characters"


def _networks_problem(entries: tuple[str, ...]) -> str | None:
    """``dashboard_proxy_addresses``: each an IP address or network."""
    for entry in entries:
        try:
            ipaddress.ip_network(entry.strip(), strict=False)
        except ValueError:
            return f"each entry must be an IP address or network, got {entry!r}"
    return None


def _user_shown(credentials: str) -> str:
    """``dashboard_basic_auth`` as ``redacted()`` shows it: ``user:***``."""
    return credentials.split(":", 1)[0] + ":" + MASK


@dataclasses.dataclass(frozen=True)
class OutboxSettings:
    """Configuration shared by the application side, the relay and the worker.

    Construct it directly (tests, application code) or with :meth:`from_env`. Each field is
    declared once by ``setting(default, doc, **rule)``: its annotation is its type, the
    keywords its range or allowed values, its SQS source, whether it is a secret
    (:class:`~sqla_outbox.settings_schema.Setting`). Values are checked against those rules at
    construction; a bad value raises :class:`~sqla_outbox.errors.ConfigurationError` naming the
    field's environment variable and the allowed range.
    """

    # --- connections -----------------------------------------------------------------
    database_url: str = setting(
        "postgresql+psycopg://postgres@127.0.0.1:5432/postgres",
        "SQLAlchemy URL of the PostgreSQL database holding the outbox tables. sqla_outbox's "
        "own engines always use the psycopg 3 driver: `postgresql://`, `postgres://` and a "
        "URL naming another PostgreSQL driver (`postgresql+asyncpg://`) are read as "
        "`postgresql+psycopg://` (an asyncpg URL's `ssl=` becomes `sslmode=`, asyncpg-only "
        "options such as `prepared_statement_cache_size` are dropped). Other databases are "
        "refused.",
        aliases=("DATABASE_URL",),
        shape="a PostgreSQL URL",
        check=_database_url_problem,
    )
    valkey_url: str | None = setting(
        "redis://127.0.0.1:6379/0",
        "Valkey/Redis URL for the wake signal. Empty or `none`: no Valkey; with `wake_mode` "
        "`auto` the PostgreSQL wake takes its place.",
        aliases=("VALKEY_URL", "REDIS_URL"),
        shape="a redis://, rediss://, valkey://, valkeys:// or unix:// URL",
        check=_valkey_url_problem,
    )
    database_direct_url: str | None = setting(
        None,
        "URL of a direct connection to the same database, for the relay's `LISTEN` (the "
        "PostgreSQL wake) when `database_url` goes through a transaction-mode pooler such as "
        "PgBouncer, which cannot hold a `LISTEN`. Unset: `database_url`.",
        aliases=("DATABASE_DIRECT_URL",),
        shape="a PostgreSQL URL",
        check=_database_url_problem,
    )
    sqs_endpoint_url: str | None = setting(
        None,
        "SQS endpoint override (LocalStack, a moto server): an `http://` or `https://` URL. "
        "Unset: boto3's default endpoint for the region (boto3 also honours "
        "`AWS_ENDPOINT_URL_SQS`).",
        aliases=("SQS_ENDPOINT_URL",),
        shape="an http:// or https:// URL",
        check=_endpoint_url_problem,
    )

    # --- application side ---------------------------------------------------------------
    catalog_path: str = setting(
        "tasks.json",
        "Path of the task catalog (tasks → queue/options, events → subscribers) that the "
        "API side validates dispatches against.",
    )
    wake_mode: str = setting(
        "auto",
        "How a commit that wrote outbox rows wakes the relay: `valkey` (LPUSH after the commit, "
        "BLPOP in the relay), `postgres` (a `NOTIFY` inside the dispatching statement, delivered "
        "only if the transaction commits, and a relay that `LISTEN`s), `both`, or `none` (the "
        "relay finds work by sweeping). `auto`: `valkey` when `valkey_url` is set, else "
        "`postgres`. docs/deployment.md#the-wake compares them.",
        choices=WAKE_MODES,
        shape="a wake mode",
    )
    wake_key: str = setting(
        "sqla_outbox:outbox:wake", "Valkey list the application LPUSHes after a commit.", min_length=1
    )
    wake_timeout_ms: int = setting(
        100,
        "Longest one wake (connect + LPUSH) may take. Wakes go out on a thread of their own, "
        "so commits never wait for them; a wake past this is dropped, logged and counted.",
        unit="ms",
        minimum=1,
        maximum=10_000,
    )
    wake_retry_seconds: float = setting(
        5.0,
        "After a failed wake, wakes are skipped for this long (one warning per outage "
        "instead of one per commit).",
        unit="s",
        minimum=0,
    )
    wake_list_max: int = setting(
        16,
        "The wake list never holds more than this many entries, so it cannot grow while no relay "
        "listens: a push that finds it longer trims it to one entry (the entries are all alike).",
        minimum=1,
    )
    max_message_bytes: int = setting(
        262_144,
        "Largest SQS message (body + message attributes) a dispatch may produce. 262,144 "
        "is the classic SQS limit; SQS now accepts up to 1,048,576.",
        unit="bytes",
        minimum=1024,
        maximum=SQS_MAX_MESSAGE_BYTES,
        source="SQS maximum message size",
    )
    tenant_foreign_key: str | None = setting(
        "tenants.id",
        "`table.column` that `outbox_messages.tenant_id` references. Empty or `none` "
        "creates no foreign key. Read by the migrations and by `sqla_outbox.metadata`.",
        pattern=r"[A-Za-z_][\w$]*(\.[A-Za-z_][\w$]*){1,2}",
        shape="table.column or schema.table.column",
    )

    # --- queues --------------------------------------------------------------------------
    queue_prefix: str = setting(
        "sqla-outbox-",
        "Prefix of the SQS queue names: `<prefix>critical`, `<prefix>critical-dlq`, ...",
        pattern=r"[A-Za-z0-9_-]{0,60}",
        shape="at most 60 letters, digits, '-' and '_'",
        source="SQS queue names",
    )
    max_receive_count: int = setting(
        7,
        "Redrive policy maxReceiveCount: receives after which SQS itself moves a message "
        "to the DLQ (5 for the runtime plus 2 of margin).",
        minimum=1,
        maximum=1000,
        source="SQS RedrivePolicy maxReceiveCount",
    )
    sqs_message_retention_seconds: int = setting(
        1_209_600,
        "How long a source queue keeps a message nobody received (SQS MessageRetentionPeriod, "
        "60..1,209,600 s; default the SQS maximum, 14 days). SQS drops older messages silently; "
        "`status` flags runs sent but never received, `outbox resend` sends them again. "
        "Applied by `provision`.",
        unit="s",
        minimum=60,
        maximum=1_209_600,
        source="SQS MessageRetentionPeriod",
    )
    visibility_timeout_critical_seconds: int = setting(
        queues.BUILTIN_BY_NAME["critical"].visibility_timeout_seconds,
        "Visibility timeout of the critical queue (applied by `provision`).",
        unit="s",
        minimum=0,
        maximum=SQS_MAX_VISIBILITY_SECONDS,
        source="SQS VisibilityTimeout",
    )
    visibility_timeout_default_seconds: int = setting(
        queues.BUILTIN_BY_NAME["default"].visibility_timeout_seconds,
        "Visibility timeout of the default queue (applied by `provision`).",
        unit="s",
        minimum=0,
        maximum=SQS_MAX_VISIBILITY_SECONDS,
        source="SQS VisibilityTimeout",
    )
    visibility_timeout_bulk_seconds: int = setting(
        queues.BUILTIN_BY_NAME["bulk"].visibility_timeout_seconds,
        "Visibility timeout of the bulk queue (applied by `provision`).",
        unit="s",
        minimum=0,
        maximum=SQS_MAX_VISIBILITY_SECONDS,
        source="SQS VisibilityTimeout",
    )
    visibility_timeout_maintenance_seconds: int = setting(
        queues.BUILTIN_BY_NAME["maintenance"].visibility_timeout_seconds,
        "Visibility timeout of the maintenance queue (applied by `provision`).",
        unit="s",
        minimum=0,
        maximum=SQS_MAX_VISIBILITY_SECONDS,
        source="SQS VisibilityTimeout",
    )
    queue_visibility_timeouts: tuple[str, ...] = setting(
        (),
        "Visibility timeouts per queue as `name=seconds`, comma-separated "
        "(`reminders=3600,critical=90`): any queue, a catalog-declared one (overriding its "
        "`visibility_timeout_seconds`) or one of the four (overriding "
        "`visibility_timeout_<queue>_seconds`). The queue's DLQ gets the same value. Applied "
        "by `provision`; workers read each queue's actual value at start.",
        unit="s",
        shape="`name=seconds`, seconds 0..43200 (SQS VisibilityTimeout)",
        check=_queue_visibility_problem,
    )
    sqs_managed_sse: bool = setting(
        False, "Provision queues with SQS-managed server-side encryption (SSE-SQS)."
    )
    sqs_kms_key_id: str | None = setting(
        None, "Provision queues with SSE-KMS using this key id or alias (wins over SSE-SQS)."
    )

    signing_keys: tuple[str, ...] = setting(
        (),
        "Secret keys for message signatures, comma-separated. The relay signs every message "
        "with the first (HMAC-SHA256 of the body, attribute `signature`); workers accept any "
        "of them and send unsigned or badly signed messages to the DLQ unexecuted. Empty: "
        "no signing. List the new key first and keep the old one while rotating.",
        min_length=16,
        secret=True,
    )

    # --- relay ---------------------------------------------------------------------------
    relay_sweep_interval_seconds: float = setting(
        5.0,
        "The relay scans the outbox at least this often, wake or not. Also the BLPOP timeout.",
        unit="s",
        above=0,
    )
    relay_batch_size: int = setting(
        100,
        "Rows claimed per outbox table per pass (sent as SendMessageBatch calls of <= 10).",
        minimum=1,
        maximum=10_000,
    )
    relay_send_concurrency: int = setting(
        4, "SendMessageBatch calls in flight at once within one pass.", minimum=1, maximum=64
    )
    relay_backoff_base_seconds: float = setting(
        1.0,
        "First delay after a failed send; doubles per failed send (capped exponential backoff, no jitter).",
        unit="s",
        above=0,
    )
    relay_backoff_max_seconds: float = setting(
        300.0, "Cap of the relay's send backoff.", unit="s", at_least="relay_backoff_base_seconds"
    )
    relay_max_send_attempts: int = setting(
        20,
        "A row whose message SQS does not take (an entry failed without sender fault) is parked "
        "after this many failed sends: its run fails with the SQS error and "
        "`python -m sqla_outbox outbox unpark` puts it back. A message SQS refuses outright "
        "(sender fault: invalid characters, too large) is parked at its first refusal; failures "
        "of whole calls (endpoint down, throttling, credentials, missing queue) never park a row.",
        minimum=1,
    )
    relay_lock_id: int = setting(
        0x5351_4C41_4F42,
        "PostgreSQL advisory lock key that elects the active relay (or, with `relay_partitions` "
        "> 1, keys the partition locks) per database (a base-10 integer in the environment). "
        "Every relay of one database must use the same value: relays with another one form a "
        "separate set that the others neither see nor leave work to.",
        unbounded=True,
    )
    relay_standby_poll_seconds: float = setting(
        1.0,
        "How often a standby relay tries to take the advisory lock; with `relay_partitions` > 1, "
        "how often each relay rebalances partitions.",
        unit="s",
        above=0,
    )
    relay_listen_probe_interval_seconds: float = setting(
        15.0,
        "How often the relay's PostgreSQL wake listener `NOTIFY`s itself a probe (from a "
        "short-lived session of its own) and expects it back on its `LISTEN` session. A "
        "session that does not return it within `relay_listen_probe_timeout_seconds` is "
        "dropped and reconnected, so a `LISTEN` connection cut quietly (a proxy or NAT that "
        "keeps the socket open) is noticed within the sum of the two.",
        unit="s",
        minimum=0.1,
        maximum=3600,
    )
    relay_listen_probe_timeout_seconds: float = setting(
        5.0,
        "How long a probe of the wake listener may take to come back. When the very first "
        "probe of a listener does not, the connection is judged unable to hold a `LISTEN` "
        "(a transaction-mode pooler): it is kept, and the relay runs on its sweep.",
        unit="s",
        above=0,
        maximum=60,
    )
    relay_partitions: int = setting(
        1,
        "Partitions of the outbox (docs/scaling.md). 1: one active relay per database, the others "
        "hot standbys. P > 1: up to P relays are active at once, each owning a share of the "
        "partitions (a tenant's rows are in one partition); every relay of a database must use "
        "the same value.",
        minimum=1,
        maximum=1024,
    )
    relay_scheduler: bool = setting(True, "Run the recurring-task scheduler inside the active relay.")
    relay_hold_unserved: bool = setting(
        True,
        "Keep due runs pending in the outbox while no live worker implements their task on "
        "their queue (rolling deploys; workers record what they implement in "
        "`worker_presence`). Off: send everything, as before workers recorded presence.",
    )

    relay_fairness: bool = setting(
        True,
        "Tenant fairness (docs/flow-control.md): each pass is shared across the tenants with due "
        "rows by weight, higher priority first within a queue; SQS is handed only what workers "
        "take soon (`relay_queue_depth`); messages carry MessageGroupId = tenant. Off: claim "
        "oldest first across tenants, send without bound (the behaviour before flow control).",
    )
    relay_queue_depth: int | None = setting(
        None,
        "Most messages left waiting (visible) in one SQS queue before the relay sends more; "
        "the backlog stays in the outbox. Default: 2 x `worker_concurrency` per live worker "
        "(at least 20; no bound while no live worker is recorded). 0: no bound.",
        minimum=0,
    )
    relay_rescue_interval_seconds: float = setting(
        60.0,
        "How often the active relay (the owner of partition 0) looks for unfinished runs with "
        "no live copy (no pending outbox row, no live lease, and a message SQS can no longer "
        "be holding) and sends them again through the outbox (docs/lifecycle.md). 0 turns "
        "the rescuer off.",
        unit="s",
        minimum=0,
        maximum=86_400,
    )
    relay_rescue_margin_seconds: float = setting(
        120.0,
        "Added to each queue's window before the rescuer counts a run's message lost: the window "
        "is the queue's visibility timeout x its maxReceiveCount + this margin.",
        unit="s",
        minimum=0,
        maximum=86_400,
    )
    relay_depth_poll_seconds: float = setting(
        0.2,
        "While a queue is at `relay_queue_depth`, the relay re-reads its depth "
        "(GetQueueAttributes) this often.",
        unit="s",
        above=0,
    )
    tenant_rate_limit_per_minute: int | None = setting(
        None,
        "Runs the relay sends per tenant per sliding minute; excess waits in the outbox (no "
        "attempt spent). Per-tenant overrides: `python -m sqla_outbox flow tenant`. None: no limit.",
        minimum=1,
    )
    flow_refresh_seconds: float = setting(
        1.0,
        "How often workers re-read paused tasks, tenants and queues.",
        unit="s",
        above=0,
    )

    # --- worker --------------------------------------------------------------------------
    worker_queues: tuple[str, ...] = setting(
        QUEUE_NAMES,
        "Queues this worker consumes, comma-separated, in any order (critical is always served "
        "first): the four defaults and queues the task catalog declares (checked at start).",
        aliases=("QUEUES",),
        shape="a queue name (1..40 letters, digits, '-' and '_'), at least one",
        check=_worker_queues_problem,
    )
    worker_concurrency: int = setting(
        8, "Handlers running at once per worker process.", minimum=1, maximum=1000
    )
    worker_imports: tuple[str, ...] = setting(
        (), "Modules to import at start so their `@task` handlers register (comma-separated)."
    )
    worker_wait_seconds: int = setting(
        1,
        "ReceiveMessage long-poll wait (SQS allows 0..20). Also the longest an idle worker's stop "
        "waits for its pending poll (SQS has no way to cancel one): 1 s stops an idle worker within "
        "2 s of SIGTERM; 20 s saves empty receives (one per queue per wait when idle) but a stop "
        "then takes up to 20 s. See decision 0017.",
        unit="s",
        minimum=0,
        maximum=20,
        source="SQS ReceiveMessage WaitTimeSeconds",
    )
    worker_max_receives: int = setting(
        5,
        "A transient failure on this receive (ApproximateReceiveCount) takes the "
        "permanent path: DLQ and run failed.",
        minimum=1,
    )
    worker_db_pool_size: int = setting(
        4,
        "Most PostgreSQL connections a worker process holds for its own SQL and its handlers' "
        "sessions (one pool for sync handlers, one more of the same size once an async handler "
        "runs; no overflow). A checkout waits when all are busy. Little's law sizes "
        "it: runs/s per worker x seconds a run holds a connection (see docs/deployment.md).",
        minimum=1,
        maximum=1000,
    )
    worker_stop_budget_seconds: float = setting(
        20.0,
        "On SIGTERM, how long in-flight handlers may keep running before their messages "
        "are returned to the queue.",
        unit="s",
        minimum=0,
    )
    worker_backoff_base_seconds: float = setting(
        5.0,
        "Nominal retry delay after the first transient failure; doubles per receive. Each delay "
        "is drawn uniformly between half and all of its nominal value (equal jitter), so the first "
        "retry comes after 2.5..5 s by default: the base is not a minimum.",
        unit="s",
        minimum=0,
    )
    worker_backoff_max_seconds: float = setting(
        900.0,
        "Cap of the worker's retry backoff (SQS allows 43,200).",
        unit="s",
        at_least="worker_backoff_base_seconds",
        maximum=SQS_MAX_VISIBILITY_SECONDS,
        source="SQS VisibilityTimeout maximum",
    )
    worker_run_relay: bool = setting(
        False,
        "Also run the relay (as a hot-standby candidate) inside each worker process.",
        aliases=("SQLA_OUTBOX_RELAY",),
    )
    worker_id: str | None = setting(None, "Name recorded in the run trail. Default: `<hostname>:<pid>`.")
    worker_cancel_check_seconds: float = setting(
        2.0,
        "How often the worker looks for cancel requests of the runs it is executing (one "
        "primary-key query per interval while it runs any; the heartbeat ticks every second, "
        "so shorter values act as 1 s). docs/cancellation.md.",
        unit="s",
        minimum=0.1,
        maximum=3600,
    )
    result_max_bytes: int = setting(
        65_536,
        "Largest handler result stored on the run, as UTF-8 JSON. A larger (or non-JSON) "
        "result fails the run permanently (`result-too-large`). docs/results.md.",
        unit="bytes",
        minimum=1,
        maximum=16_777_216,
    )
    limits_slot_lease_seconds: float = setting(
        15.0,
        "Lease of a `@task(concurrency=...)` slot in Valkey; the worker's heartbeat renews it every "
        "third, so a worker killed holding one frees it within this long.",
        unit="s",
        minimum=1,
        maximum=3600,
    )
    limits_throttle_delay_seconds: float = setting(
        1.0,
        "First delay of a run deferred by a concurrency cap or a busy half-open breaker.",
        unit="s",
        above=0,
        maximum=3600,
    )
    limits_throttle_delay_max_seconds: float = setting(
        10.0,
        "...doubling per deferral up to this (with jitter).",
        unit="s",
        at_least="limits_throttle_delay_seconds",
        maximum=3600,
    )
    limits_valkey_timeout_ms: int = setting(
        250,
        "Longest one flow-control call to Valkey may take before the worker limits per process.",
        unit="ms",
        minimum=1,
        maximum=10_000,
    )
    limits_valkey_retry_seconds: float = setting(
        5.0,
        "After a failed flow-control call, per-process limits for this long before trying Valkey again.",
        unit="s",
        minimum=0,
    )
    health_port: int | None = setting(
        None,
        "Port of the HTTP probe (`/livez`, `/readyz`, `/metrics`) for relay and worker. "
        "Unset: no HTTP server.",
        aliases=("SQLA_OUTBOX_METRICS_PORT",),
        minimum=0,
        maximum=65535,
        shape="a TCP port",
    )
    health_host: str = setting(
        "0.0.0.0",  # noqa: S104 - probes and scrapers reach the process from outside by default
        "Address the HTTP probe binds: `0.0.0.0` (every IPv4 interface: what an orchestrator's "
        "probes and a Prometheus scraper on another host need), `::` (every interface, IPv6 too), "
        "`127.0.0.1` to answer only on the host, or one interface's address. The probe has no "
        "authentication; `/metrics` names tasks and queues.",
        pattern=r"[A-Za-z0-9.:_-]{1,253}",
        shape="an IP address or host name",
    )

    # --- webhooks ------------------------------------------------------------------------
    webhook_allowed_hosts: tuple[str, ...] = setting(
        (),
        "Webhook destinations let through the SSRF guard although they are not public "
        "addresses, comma-separated, each with its port or port range and, optionally, the "
        "tenants it is for: `hooks.internal:443` (a host name as written in endpoint URLs), "
        "`127.0.0.1:8850` or `10.1.2.0/24:8000-8099` (addresses and networks, matched against "
        "what the name resolves to), `[fd00::1]:443` (IPv6 in brackets), "
        "`3+7@hooks.internal:443` (only for deliveries of tenants 3 and 7). An entry admits "
        "its host on its ports and no other, and the answers of an allowed destination are "
        "not kept in the trail (`webhook_response_excerpt`). For tests and internal receivers. "
        "Empty: deliveries reach public addresses only.",
        shape=destinations.ENTRY_SHAPE,
        check=destinations.allow_entries_problem,
    )
    webhook_public_ports: tuple[str, ...] = setting(
        ("80", "443", "8080", "8443"),
        "Ports a delivery may connect to on a public address (ports or ranges, "
        "comma-separated: `443,8000-8099`). A receiver URL on another port is refused "
        "(`destination-refused`) unless an allow-list entry names it.",
        shape="a port (443) or a range (8000-8099), 1..65535",
        check=destinations.ports_problem,
    )
    webhook_response_excerpt: str = setting(
        "public",
        "What the delivery trail keeps of a receiver's answer besides its status and latency "
        "(its content type and first 512 bytes): `public`: for destinations reached as public "
        "addresses only, never for one let through by `webhook_allowed_hosts` (an internal "
        "service's answer stays out of the tenant's trail); `never`: for no destination; "
        "`always`: for every destination, allow-listed ones included (only when every "
        "allow-listed destination is a receiver of yours whose answers tenants may read).",
        choices=("public", "never", "always"),
    )
    webhook_proxy_url: str | None = setting(
        None,
        "HTTP proxy every webhook delivery goes through (`http://proxy.internal:3128`; "
        "`https://...` for a TLS connection to the proxy), for networks whose egress passes "
        "through one. The SSRF guard still resolves and checks each destination, and the proxy "
        "is asked for the checked address (CONNECT `address:port` for https, SNI and `Host` "
        "keeping the name), so a name the proxy would resolve differently is never used. "
        "Proxy variables of the environment (`HTTPS_PROXY`, ...) are ignored, set or not. "
        "Unset: deliveries connect directly.",
        shape="an http://host:port or https://host:port URL",
        check=destinations.proxy_url_problem,
    )
    webhook_timeout_seconds: float = setting(
        15.0,
        "Total deadline of one webhook delivery attempt: connecting, TLS, sending the request "
        "and reading the answer together, against the wall clock (a receiver that trickles its "
        "answer a byte at a time is cut off when it passes). The attempt then fails transiently "
        "(`timeout`) and its worker slot and thread are free. Standard Webhooks recommends a "
        "short timeout (15 to 30 s). Name resolution comes first, bounded by the system "
        "resolver's own timeout.",
        unit="s",
        above=0,
        maximum=300,
    )
    webhook_tenant_slot_share: float = setting(
        0.5,
        "Largest share of a worker's slots (`worker_concurrency`) one tenant's webhook deliveries "
        "may hold at once (at least one slot): a tenant whose receivers are slow cannot hold "
        "the slots other tenants' runs need. A delivery over it is handed back to the outbox "
        "and tried again shortly (`tenant-share` in the trail; no attempt spent). 1: no cap.",
        above=0,
        maximum=1,
    )

    # --- dashboard -----------------------------------------------------------------------
    dashboard_host: str = setting(
        "127.0.0.1",
        "Address `python -m sqla_outbox dashboard` listens on. Any other address than a "
        "loopback one needs authentication (`dashboard_token`, `dashboard_users`, "
        "`dashboard_basic_auth` or `dashboard_proxy_user_header`).",
        pattern=r"(?s).*\S.*",
        shape="an address or host name (not blank)",
    )
    dashboard_port: int = setting(
        8089, "TCP port of `python -m sqla_outbox dashboard`.", minimum=0, maximum=65535, shape="a TCP port"
    )
    dashboard_token: str | None = setting(
        None,
        "A shared secret token that opens the dashboard as the operator named `token` (role "
        "operator): typed once on its login page, or sent as `Authorization: Bearer <token>`. "
        "To record who did what, give each operator their own token instead "
        "(`dashboard_users`). Rotating it ends every session it opened. Unset: no token.",
        min_length=16,
        secret=True,
    )
    dashboard_users: tuple[str, ...] = setting(
        (),
        "The dashboard's operators, comma-separated, each `name:role` (`viewer`: reads, "
        "payloads hidden, never acts; `operator`: also acts), optionally `:tenants=3+7` (only "
        "those tenants' runs, DLQ messages and actions) and `:sha256=<hex>`, the SHA-256 of "
        "the operator's own token, which opens the login page and `Authorization: Bearer` "
        "(`alice:operator:sha256=9f86...`). An entry without a hash gives a role to a user "
        "the reverse proxy names (`dashboard_proxy_user_header`). Actions record the "
        "operator's name. Changing an operator's hash ends their sessions. Only hashes are "
        "configured, never tokens (a hash does not open the dashboard).",
        shape=operators.ENTRY_SHAPE,
        check=operators.operators_problem,
    )
    dashboard_basic_auth: str | None = setting(
        None,
        "`user:password` accepted through HTTP basic authentication, as one operator (role "
        "operator) named by the user name. Unset: no basic auth.",
        shape="user:password, the password at least 12 characters",
        check=_basic_auth_problem,
        secret=True,
        mask=_user_shown,
    )
    dashboard_proxy_user_header: str | None = setting(
        None,
        "Header in which a reverse proxy in front of the dashboard names the user it "
        "authenticated (`X-Forwarded-User`, `X-Auth-Request-User`, ...). Trusted only on "
        "requests whose TCP peer is in `dashboard_proxy_addresses` (required with it); the "
        "proxy must set or strip the header on every request it forwards. The user's role "
        "is their `dashboard_users` entry's, else `dashboard_proxy_default_role`. Unset: no "
        "proxy authentication.",
        pattern=r"[A-Za-z0-9-]{1,64}",
        shape="an HTTP header name",
    )
    dashboard_proxy_addresses: tuple[str, ...] = setting(
        (),
        "Addresses or networks the reverse proxy connects to the dashboard from "
        "(`127.0.0.1`, `10.0.3.0/24`): only their requests may name a user in "
        "`dashboard_proxy_user_header`; anyone else's are refused.",
        shape="an IP address or network",
        check=_networks_problem,
    )
    dashboard_proxy_default_role: str = setting(
        "viewer",
        "Role of a user the reverse proxy authenticated who has no `dashboard_users` entry: "
        "`viewer`, `operator`, or `none` (refused).",
        choices=("viewer", "operator", "none"),
    )
    dashboard_session_max_age_seconds: int = setting(
        43_200,
        "How long a dashboard sign-in lasts. Sessions are kept in PostgreSQL "
        "(`dashboard_sessions`): the cookie holds only a random key, the expiry is checked "
        "on the server, and signing out or rotating the credential ends the session.",
        unit="s",
        minimum=60,
        maximum=604_800,
    )
    dashboard_secure_cookies: bool = setting(
        False,
        "Mark the dashboard's cookies `Secure`, so browsers send them over HTTPS only (turn it "
        "on whenever the dashboard is reached over HTTPS, through a TLS-terminating proxy "
        "included).",
    )
    dashboard_allowed_hosts: tuple[str, ...] = setting(
        (),
        "`Host` header values the dashboard answers (`outbox.example.com`, `*.example.com`); "
        "any other is refused (400), so a page of another site cannot read the dashboard "
        "through a name it points at the dashboard's address (DNS rebinding). Unset: "
        "`python -m sqla_outbox dashboard` on a loopback address answers `127.0.0.1`, "
        "`localhost` and `::1` only; elsewhere (and mounted in an application) no check.",
        pattern=r"(\*\.)?[A-Za-z0-9._:\[\]-]{1,253}",
        shape="a host name or address",
    )
    dashboard_actions: bool = setting(
        False,
        "Enable the dashboard's actions (DLQ requeue, cancel runs; later pause, resume). Off: "
        "read-only. Actions need an authenticated operator and a CSRF token.",
    )
    dashboard_show_payloads: bool = setting(
        False,
        "Show run payloads and handler results on the dashboard's run pages (hidden by default: "
        "they may hold personal data).",
    )
    dashboard_refresh_seconds: float = setting(
        5.0,
        "How often the dashboard's overview refreshes itself.",
        unit="s",
        minimum=1,
    )

    # --- maintenance ---------------------------------------------------------------------
    purge_sent_after_days: float = setting(
        7.0,
        "`maintenance.purge` deletes outbox rows sent longer ago than this.",
        unit="days",
        minimum=0,
    )
    purge_succeeded_after_days: float = setting(
        7.0,
        "...and `succeeded` runs (with their trail) finished longer ago.",
        unit="days",
        minimum=0,
    )
    purge_failed_after_days: float = setting(
        30.0, "...and `failed` runs finished longer ago.", unit="days", minimum=0
    )
    purge_batch_size: int = setting(1000, "Rows deleted per purge statement.", minimum=1)

    def __post_init__(self) -> None:
        """Normalize, then check every field against its declaration.

        An optional text spelled ``none``/``null``/``off``/"" becomes None; a ``choices``
        value is stripped and lower-cased (``" Postgres "`` → ``postgres``).

        Raises:
            ConfigurationError: The first field whose value breaks its rule
                (:func:`settings_schema.first_problem`), named by its environment variable:
                what is wrong and, for a number, the value given (``must be within 1..1024,
                got 0``); URLs are shown with their password masked, secrets never.
        """
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            stored = settings_schema.of(field).normalized(value, optional=settings_schema.is_optional(field))
            if stored is not value:
                object.__setattr__(self, field.name, stored)
        found = settings_schema.first_problem(self)
        if found is not None:
            name, problem = found
            raise errors.ConfigurationError(problem, option=ENV_PREFIX + name.upper())

    # ---------------------------------------------------------------------------------
    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, **overrides: Any) -> OutboxSettings:
        """Build settings from environment variables, then apply ``overrides``.

        Args:
            env: Variables to read (default ``os.environ``).
            **overrides: Field values that win over the environment (CLI options). ``None``
                values are ignored, so unset CLI options fall through.

        Raises:
            ConfigurationError: A variable cannot be parsed or a value is out of range; the
                message names the variable.
        """
        source = os.environ if env is None else env
        values: dict[str, Any] = {}
        for field in dataclasses.fields(cls):
            if overrides.get(field.name) is not None:
                continue  # the override wins: the variable is not read (nor blamed)
            for name in env_names(field.name):
                raw = source.get(name)
                if raw is None:
                    continue
                try:
                    values[field.name] = settings_schema.parse(field, raw)
                except ValueError as exc:
                    raise errors.ConfigurationError(str(exc), option=name) from exc
                break
        for key, value in overrides.items():
            if key not in {f.name for f in dataclasses.fields(cls)}:
                raise errors.ConfigurationError(f"unknown setting {key!r}", option=key)
            if value is not None:
                values[key] = value
        return cls(**values)

    def replace(self, **changes: Any) -> OutboxSettings:
        """Return a copy with ``changes`` applied (validated again)."""
        return dataclasses.replace(self, **changes)

    # --- derived values ------------------------------------------------------------------
    @property
    def sqlalchemy_url(self) -> str:
        """``database_url`` with the psycopg 3 driver when no driver is named."""
        return sqlalchemy_url(self.database_url)

    @functools.cached_property
    def wake_channels(self) -> frozenset[str]:
        """The wake signals in force: a subset of ``{"valkey", "postgres"}``.

        ``wake_mode="auto"`` resolves to ``{"valkey"}`` when ``valkey_url`` is set, else
        ``{"postgres"}``; ``valkey`` (or ``both``) without a ``valkey_url`` drops Valkey.
        Computed once per settings object (they are frozen): every flush reads it.
        """
        if self.wake_mode == "auto":
            return frozenset({"valkey"} if self.valkey_url else {"postgres"})
        chosen = {"valkey": {"valkey"}, "postgres": {"postgres"}, "both": {"valkey", "postgres"}}
        channels = chosen.get(self.wake_mode, set())
        return frozenset(c for c in channels if c != "valkey" or self.valkey_url)

    @property
    def worker_queues_chosen(self) -> bool:
        """True when ``worker_queues`` names queues of the operator's choice, False when it is
        the default four (in any order): a default queue that no registered task uses is
        expected then, and the worker does not warn about it."""
        return set(self.worker_queues) != set(QUEUE_NAMES)

    @property
    def wake_valkey_url(self) -> str | None:
        """``valkey_url`` when the Valkey wake is in force (:attr:`wake_channels`), else None."""
        return self.valkey_url if "valkey" in self.wake_channels else None

    @property
    def wake_notify(self) -> bool:
        """True when dispatching transactions ``NOTIFY`` the relay (the PostgreSQL wake)."""
        return "postgres" in self.wake_channels

    @property
    def listen_url(self) -> str:
        """libpq URL of the relay's ``LISTEN`` connection: ``database_direct_url`` or else
        ``database_url``, without a SQLAlchemy driver name."""
        url = sqlalchemy_url(self.database_direct_url or self.database_url)
        return url.replace("postgresql+psycopg://", "postgresql://", 1)

    def queue_url_name(self, queue: str) -> str:
        """SQS queue name for a logical queue (``<prefix><queue>``)."""
        return f"{self.queue_prefix}{queue}"

    def visibility_timeout_seconds(self, queue: str, declared: int | None = None) -> int:
        """The visibility timeout ``provision`` gives ``queue``'s source queue and DLQ, in s.

        Precedence: ``queue_visibility_timeouts`` > ``visibility_timeout_<queue>_seconds``
        (the four default queues) > ``declared`` (the catalog's ``visibility_timeout_seconds``
        of a declared queue) > 120 s (:func:`sqla_outbox.queues.visibility_timeout_seconds`).
        """
        known = queues.BUILTIN_BY_NAME.get(queue) or queues.Queue(
            queue, declared if declared is not None else queues.DECLARED_VISIBILITY_SECONDS
        )
        return queues.visibility_timeout_seconds(known, self)

    def dlq_url_name(self, queue: str) -> str:
        """SQS dead-letter queue name for a logical queue (``<prefix><queue>-dlq``)."""
        return f"{self.queue_prefix}{queue}-dlq"

    def redacted(self) -> dict[str, Any]:
        """Settings as a dict for logs, ``--check`` and ``python -m sqla_outbox config``.

        Passwords in URLs are masked (:func:`redact_url`); a field declared ``secret=True``
        shows ``***`` (a list: one ``***`` per entry; its ``mask`` when declared:
        ``dashboard_basic_auth`` shows ``user:***``). Unset secrets stay None.
        """
        out: dict[str, Any] = {}
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if isinstance(value, str) and "://" in value:
                value = redact_url(value)
            spec = settings_schema.of(field)
            if spec.secret and isinstance(value, tuple):
                value = [MASK] * len(value)
            elif spec.secret and value:
                value = spec.mask(value) if spec.mask else MASK
            out[field.name] = value
        return out


def env_names(field_name: str) -> tuple[str, ...]:
    """Environment variables read for ``field_name``, highest precedence first."""
    field = {f.name: f for f in dataclasses.fields(OutboxSettings)}[field_name]
    return (ENV_PREFIX + field_name.upper(), *settings_schema.of(field).aliases)


def reference_markdown() -> str:
    """The configuration reference (``docs/configuration.md``), generated from the declarations.

    One row per field: its environment names, default, unit, allowed values
    (:meth:`settings_schema.Setting.describe`), whether it is a secret, and its doc.
    """
    lines = [
        "# Configuration reference",
        "",
        "<!-- generated by sqla_outbox.config.reference_markdown(); tests fail when it is stale -->",
        "",
        "Every setting is a field of `sqla_outbox.OutboxSettings` and has one canonical environment",
        "variable with the `SQLA_OUTBOX_` prefix; some also accept the bare names deployments already",
        "use. Precedence: command-line option > `SQLA_OUTBOX_*` variable > bare alias > default.",
        "`python -m sqla_outbox config` prints the values in effect (passwords in URLs and the",
        "settings marked secret masked).",
        "",
        "Values are checked when the settings are built (at start): a value outside its range stops",
        "the process with an error naming the variable and the range. An optional setting (default",
        "`(unset)`) is unset by an empty value or `none`. Lists are comma-separated.",
        "",
        "AWS credentials and region are not settings: boto3 reads them from its own chain",
        "(`AWS_REGION`, `AWS_PROFILE`, `AWS_ACCESS_KEY_ID`, instance roles, ...).",
        "",
        "The wake (`wake_mode`): `valkey` (LPUSH/BLPOP through `valkey_url`), `postgres` (a `NOTIFY`",
        "in the dispatching transaction, a relay that `LISTEN`s, through `database_direct_url` when",
        "`database_url` goes through a transaction-mode pooler), `both`, `none` (the sweep alone), or",
        "`auto`: `valkey` when `valkey_url` is set, else `postgres`. Set it alike on API processes and",
        "relays; docs/deployment.md#the-wake compares them.",
        "",
    ]
    lines += settings_schema.reference_rows(OutboxSettings, env_names)
    return "\n".join(lines) + "\n"
