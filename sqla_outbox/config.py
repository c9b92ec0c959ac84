"""One frozen settings object for the API side, the relay and the worker.

Only the composition root (the CLI, or the application's start-up code) calls
:meth:`OutboxSettings.from_env`; everything else receives the object as an argument.

Every field has one canonical environment variable with the ``SQLA_OUTBOX_`` prefix
(``worker_concurrency`` → ``SQLA_OUTBOX_WORKER_CONCURRENCY``). A few fields also accept
the bare names deployments already use (``DATABASE_URL``, ``REDIS_URL``, ``QUEUES``).
Precedence: explicit keyword (CLI option) > prefixed variable > bare alias > default.

AWS region and credentials are never declared here: boto3 reads them from its own chain
(``AWS_REGION``, ``AWS_PROFILE``, instance roles, ...). ``docs/configuration.md`` is
generated from the field metadata below (``python -m sqla_outbox config-reference``).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import re
from collections.abc import Callable, Mapping
from typing import Any
from urllib.parse import urlsplit

from sqlalchemy import exc as sqlalchemy_exc
from sqlalchemy.engine import make_url

from sqla_outbox import errors
from sqla_outbox.types import QUEUE_NAMES, VISIBILITY_TIMEOUT_SECONDS, is_queue_name
from sqla_outbox.urls import MASK as MASK
from sqla_outbox.urls import redact_text as redact_text
from sqla_outbox.urls import redact_url as redact_url
from sqla_outbox.urls import sqlalchemy_url as sqlalchemy_url
from sqla_outbox.urls import with_database as with_database

ENV_PREFIX = "SQLA_OUTBOX_"

SQS_MAX_MESSAGE_BYTES = 1_048_576
"""SQS's current maximum message size (1 MiB). The default limit stays at 256 KiB."""


def _setting(
    default: Any,
    doc: str,
    *,
    aliases: tuple[str, ...] = (),
    unit: str = "",
    factory: Callable[[], Any] | None = None,
) -> Any:
    metadata = {"doc": doc, "aliases": aliases, "unit": unit}
    if factory is not None:
        return dataclasses.field(default_factory=factory, metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


@dataclasses.dataclass(frozen=True)
class OutboxSettings:
    """Configuration shared by the application side, the relay and the worker.

    Construct it directly (tests, application code) or with :meth:`from_env`. Values are
    validated at construction against SQS limits; a bad value raises
    :class:`~sqla_outbox.errors.ConfigurationError` naming the field.
    """

    # --- connections -----------------------------------------------------------------
    database_url: str = _setting(
        "postgresql+psycopg://postgres@127.0.0.1:5432/postgres",
        "SQLAlchemy URL of the PostgreSQL database holding the outbox tables. sqla_outbox's "
        "own engines always use the psycopg 3 driver: `postgresql://`, `postgres://` and a "
        "URL naming another PostgreSQL driver (`postgresql+asyncpg://`) are read as "
        "`postgresql+psycopg://` (an asyncpg URL's `ssl=` becomes `sslmode=`, asyncpg-only "
        "options such as `prepared_statement_cache_size` are dropped). Other databases are "
        "refused.",
        aliases=("DATABASE_URL",),
    )
    valkey_url: str | None = _setting(
        "redis://127.0.0.1:6379/0",
        "Valkey/Redis URL for the wake signal. Empty or `none`: no Valkey; with `wake_mode` "
        "`auto` the PostgreSQL wake takes its place.",
        aliases=("VALKEY_URL", "REDIS_URL"),
    )
    database_direct_url: str | None = _setting(
        None,
        "URL of a direct connection to the same database, for the relay's `LISTEN` (the "
        "PostgreSQL wake) when `database_url` goes through a transaction-mode pooler such as "
        "PgBouncer, which cannot hold a `LISTEN`. Unset: `database_url`.",
        aliases=("DATABASE_DIRECT_URL",),
    )
    sqs_endpoint_url: str | None = _setting(
        None,
        "SQS endpoint override (LocalStack, a moto server): an `http://` or `https://` URL. "
        "Unset: boto3's default endpoint for the region (boto3 also honours "
        "`AWS_ENDPOINT_URL_SQS`).",
        aliases=("SQS_ENDPOINT_URL",),
    )

    # --- application side ---------------------------------------------------------------
    catalog_path: str = _setting(
        "tasks.json",
        "Path of the task catalog (tasks → queue/options, events → subscribers) that the "
        "API side validates dispatches against.",
    )
    wake_mode: str = _setting(
        "auto",
        "How a commit that wrote outbox rows wakes the relay: `valkey` (LPUSH after the commit, "
        "BLPOP in the relay), `postgres` (a `NOTIFY` inside the dispatching statement, delivered "
        "only if the transaction commits, and a relay that `LISTEN`s), `both`, or `none` (the "
        "relay finds work by sweeping). `auto`: `valkey` when `valkey_url` is set, else "
        "`postgres`. docs/deployment.md#the-wake compares them.",
    )
    wake_key: str = _setting("sqla_outbox:outbox:wake", "Valkey list the application LPUSHes after a commit.")
    wake_timeout_ms: int = _setting(
        100,
        "Longest one wake (connect + LPUSH) may take. Wakes go out on a thread of their own, "
        "so commits never wait for them; a wake past this is dropped, logged and counted.",
        unit="ms",
    )
    wake_retry_seconds: float = _setting(
        5.0,
        "After a failed wake, wakes are skipped for this long (one warning per outage "
        "instead of one per commit).",
        unit="s",
    )
    wake_list_max: int = _setting(
        16,
        "The wake list never holds more than this many entries, so it cannot grow while no relay "
        "listens: a push that finds it longer trims it to one entry (the entries are all alike).",
    )
    max_message_bytes: int = _setting(
        262_144,
        "Largest SQS message (body + message attributes) a dispatch may produce. 262,144 "
        "is the classic SQS limit; SQS now accepts up to 1,048,576.",
        unit="bytes",
    )
    tenant_foreign_key: str | None = _setting(
        "tenants.id",
        "`table.column` that `outbox_messages.tenant_id` references. Empty or `none` "
        "creates no foreign key. Read by the migrations and by `sqla_outbox.metadata`.",
    )

    # --- queues --------------------------------------------------------------------------
    queue_prefix: str = _setting(
        "sqla-outbox-",
        "Prefix of the SQS queue names: `<prefix>critical`, `<prefix>critical-dlq`, ...",
    )
    max_receive_count: int = _setting(
        7,
        "Redrive policy maxReceiveCount: receives after which SQS itself moves a message "
        "to the DLQ (5 for the runtime plus 2 of margin).",
    )
    sqs_message_retention_seconds: int = _setting(
        1_209_600,
        "How long a source queue keeps a message nobody received (SQS MessageRetentionPeriod, "
        "60..1,209,600 s; default the SQS maximum, 14 days). SQS drops older messages silently; "
        "`status` flags runs sent but never received, `outbox resend` sends them again. "
        "Applied by `provision`.",
        unit="s",
    )
    visibility_timeout_critical_seconds: int = _setting(
        VISIBILITY_TIMEOUT_SECONDS["critical"],
        "Visibility timeout of the critical queue (applied by `provision`).",
        unit="s",
    )
    visibility_timeout_default_seconds: int = _setting(
        VISIBILITY_TIMEOUT_SECONDS["default"],
        "Visibility timeout of the default queue (applied by `provision`).",
        unit="s",
    )
    visibility_timeout_bulk_seconds: int = _setting(
        VISIBILITY_TIMEOUT_SECONDS["bulk"],
        "Visibility timeout of the bulk queue (applied by `provision`).",
        unit="s",
    )
    visibility_timeout_maintenance_seconds: int = _setting(
        VISIBILITY_TIMEOUT_SECONDS["maintenance"],
        "Visibility timeout of the maintenance queue (applied by `provision`).",
        unit="s",
    )
    queue_visibility_timeouts: tuple[str, ...] = _setting(
        (),
        "Visibility timeouts per queue as `name=seconds`, comma-separated "
        "(`reminders=3600,critical=90`): any queue, a catalog-declared one (overriding its "
        "`visibility_timeout_seconds`) or one of the four (overriding "
        "`visibility_timeout_<queue>_seconds`). 0..43200 s each (SQS VisibilityTimeout); the "
        "queue's DLQ gets the same value. Applied by `provision`; workers read each queue's "
        "actual value at start.",
        unit="s",
    )
    sqs_managed_sse: bool = _setting(
        False, "Provision queues with SQS-managed server-side encryption (SSE-SQS)."
    )
    sqs_kms_key_id: str | None = _setting(
        None, "Provision queues with SSE-KMS using this key id or alias (wins over SSE-SQS)."
    )

    signing_keys: tuple[str, ...] = _setting(
        (),
        "Secret keys for message signatures, comma-separated. The relay signs every message "
        "with the first (HMAC-SHA256 of the body, attribute `signature`); workers accept any "
        "of them and send unsigned or badly signed messages to the DLQ unexecuted. Empty: "
        "no signing. Each key must be at least 16 characters long. List the new key first and "
        "keep the old one while rotating.",
    )

    # --- relay ---------------------------------------------------------------------------
    relay_sweep_interval_seconds: float = _setting(
        5.0,
        "The relay scans the outbox at least this often, wake or not. Also the BLPOP timeout.",
        unit="s",
    )
    relay_batch_size: int = _setting(
        100, "Rows claimed per outbox table per pass (sent as SendMessageBatch calls of <= 10)."
    )
    relay_send_concurrency: int = _setting(4, "SendMessageBatch calls in flight at once within one pass.")
    relay_backoff_base_seconds: float = _setting(
        1.0,
        "First delay after a failed send; doubles per failed send (capped exponential backoff, no jitter).",
        unit="s",
    )
    relay_backoff_max_seconds: float = _setting(300.0, "Cap of the relay's send backoff.", unit="s")
    relay_max_send_attempts: int = _setting(
        20,
        "A row whose message SQS does not take (an entry failed without sender fault) is parked "
        "after this many failed sends: its run fails with the SQS error and "
        "`python -m sqla_outbox outbox unpark` puts it back. A message SQS refuses outright "
        "(sender fault: invalid characters, too large) is parked at its first refusal; failures "
        "of whole calls (endpoint down, throttling, credentials, missing queue) never park a row.",
    )
    relay_lock_id: int = _setting(
        0x5351_4C41_4F42,
        "PostgreSQL advisory lock key that elects the active relay (or, with `relay_partitions` "
        "> 1, keys the partition locks) per database (a base-10 integer in the environment). "
        "Every relay of one database must use the same value: relays with another one form a "
        "separate set that the others neither see nor leave work to.",
    )
    relay_standby_poll_seconds: float = _setting(
        1.0,
        "How often a standby relay tries to take the advisory lock; with `relay_partitions` > 1, "
        "how often each relay rebalances partitions.",
        unit="s",
    )
    relay_partitions: int = _setting(
        1,
        "Partitions of the outbox (docs/scaling.md). 1: one active relay per database, the others "
        "hot standbys. P > 1: up to P relays are active at once, each owning a share of the "
        "partitions (a tenant's rows are in one partition); every relay of a database must use "
        "the same value. 1..1024.",
    )
    relay_scheduler: bool = _setting(True, "Run the recurring-task scheduler inside the active relay.")
    relay_hold_unserved: bool = _setting(
        True,
        "Keep due runs pending in the outbox while no live worker implements their task on "
        "their queue (rolling deploys; workers record what they implement in "
        "`worker_presence`). Off: send everything, as before workers recorded presence.",
    )

    relay_fairness: bool = _setting(
        True,
        "Tenant fairness (docs/flow-control.md): each pass is shared across the tenants with due "
        "rows by weight, higher priority first within a queue; SQS is handed only what workers "
        "take soon (`relay_queue_depth`); messages carry MessageGroupId = tenant. Off: claim "
        "oldest first across tenants, send without bound (the behaviour before flow control).",
    )
    relay_queue_depth: int | None = _setting(
        None,
        "Most messages left waiting (visible) in one SQS queue before the relay sends more; "
        "the backlog stays in the outbox. Default: 2 x `worker_concurrency` per live worker "
        "(at least 20; no bound while no live worker is recorded). 0: no bound.",
    )
    relay_depth_poll_seconds: float = _setting(
        0.2,
        "While a queue is at `relay_queue_depth`, the relay re-reads its depth "
        "(GetQueueAttributes) this often.",
        unit="s",
    )
    tenant_rate_limit_per_minute: int | None = _setting(
        None,
        "Runs the relay sends per tenant per sliding minute; excess waits in the outbox (no "
        "attempt spent). Per-tenant overrides: `python -m sqla_outbox flow tenant`. None: no limit.",
    )
    flow_refresh_seconds: float = _setting(
        1.0, "How often workers re-read paused tasks, tenants and queues.", unit="s"
    )

    # --- worker --------------------------------------------------------------------------
    worker_queues: tuple[str, ...] = _setting(
        QUEUE_NAMES,
        "Queues this worker consumes, comma-separated, in any order (critical is always served "
        "first): the four defaults and queues the task catalog declares (checked at start).",
        aliases=("QUEUES",),
    )
    worker_concurrency: int = _setting(8, "Handlers running at once per worker process.")
    worker_imports: tuple[str, ...] = _setting(
        (), "Modules to import at start so their `@task` handlers register (comma-separated)."
    )
    worker_wait_seconds: int = _setting(
        1,
        "ReceiveMessage long-poll wait (SQS allows 0..20). Also the longest an idle worker's stop "
        "waits for its pending poll (SQS has no way to cancel one): 1 s stops an idle worker within "
        "2 s of SIGTERM; 20 s saves empty receives (one per queue per wait when idle) but a stop "
        "then takes up to 20 s. See decision 0017.",
        unit="s",
    )
    worker_max_receives: int = _setting(
        5,
        "A transient failure on this receive (ApproximateReceiveCount) takes the "
        "permanent path: DLQ and run failed.",
    )
    worker_db_pool_size: int = _setting(
        4,
        "Most PostgreSQL connections a worker process holds for its own SQL and its handlers' "
        "sessions (one pool for sync handlers, one more of the same size once an async handler "
        "runs; no overflow). A checkout waits when all are busy. 1..1000. Little's law sizes "
        "it: runs/s per worker x seconds a run holds a connection (see docs/deployment.md).",
    )
    worker_stop_budget_seconds: float = _setting(
        20.0,
        "On SIGTERM, how long in-flight handlers may keep running before their messages "
        "are returned to the queue.",
        unit="s",
    )
    worker_backoff_base_seconds: float = _setting(
        5.0,
        "Nominal retry delay after the first transient failure; doubles per receive. Each delay "
        "is drawn uniformly between half and all of its nominal value (equal jitter), so the first "
        "retry comes after 2.5..5 s by default: the base is not a minimum.",
        unit="s",
    )
    worker_backoff_max_seconds: float = _setting(
        900.0, "Cap of the worker's retry backoff (SQS allows 43,200).", unit="s"
    )
    worker_run_relay: bool = _setting(
        False,
        "Also run the relay (as a hot-standby candidate) inside each worker process.",
        aliases=("SQLA_OUTBOX_RELAY",),
    )
    worker_id: str | None = _setting(None, "Name recorded in the run trail. Default: `<hostname>:<pid>`.")
    worker_cancel_check_seconds: float = _setting(
        2.0,
        "How often the worker looks for cancel requests of the runs it is executing (one "
        "primary-key query per interval while it runs any; the heartbeat ticks every second, "
        "so shorter values act as 1 s). docs/cancellation.md.",
        unit="s",
    )
    result_max_bytes: int = _setting(
        65_536,
        "Largest handler result stored on the run, as UTF-8 JSON. A larger (or non-JSON) "
        "result fails the run permanently (`result-too-large`). docs/results.md.",
        unit="bytes",
    )
    limits_slot_lease_seconds: float = _setting(
        15.0,
        "Lease of a `@task(concurrency=...)` slot in Valkey; the worker's heartbeat renews it every "
        "third, so a worker killed holding one frees it within this long.",
        unit="s",
    )
    limits_throttle_delay_seconds: float = _setting(
        1.0, "First delay of a run deferred by a concurrency cap or a busy half-open breaker.", unit="s"
    )
    limits_throttle_delay_max_seconds: float = _setting(
        10.0, "...doubling per deferral up to this (with jitter).", unit="s"
    )
    limits_valkey_timeout_ms: int = _setting(
        250,
        "Longest one flow-control call to Valkey may take before the worker limits per process.",
        unit="ms",
    )
    limits_valkey_retry_seconds: float = _setting(
        5.0,
        "After a failed flow-control call, per-process limits for this long before trying Valkey again.",
        unit="s",
    )
    health_port: int | None = _setting(
        None,
        "Port of the HTTP probe (`/livez`, `/readyz`, `/metrics`) for relay and worker. "
        "Unset: no HTTP server.",
        aliases=("SQLA_OUTBOX_METRICS_PORT",),
    )
    health_host: str = _setting(
        "0.0.0.0",  # noqa: S104 - probes and scrapers reach the process from outside by default
        "Address the HTTP probe binds: `0.0.0.0` (every IPv4 interface: what an orchestrator's "
        "probes and a Prometheus scraper on another host need), `::` (every interface, IPv6 too), "
        "`127.0.0.1` to answer only on the host, or one interface's address. The probe has no "
        "authentication; `/metrics` names tasks and queues.",
    )

    # --- webhooks ------------------------------------------------------------------------
    webhook_allowed_hosts: tuple[str, ...] = _setting(
        (),
        "Webhook destinations let through the SSRF guard although they are not public "
        "addresses, comma-separated: host names as written in endpoint URLs (`localhost`, "
        "`hooks.internal`) or IP addresses and networks (`127.0.0.1`, `10.1.2.0/24`). For "
        "tests and internal receivers. Empty: deliveries reach public addresses only.",
    )
    webhook_timeout_seconds: float = _setting(
        15.0,
        "Per-attempt limit of a webhook delivery: connecting, sending and waiting for the "
        "response each get at most this long (Standard Webhooks recommends 15 to 30 s).",
        unit="s",
    )

    # --- dashboard -----------------------------------------------------------------------
    dashboard_host: str = _setting(
        "127.0.0.1",
        "Address `python -m sqla_outbox dashboard` listens on. Any other address than a "
        "loopback one needs `dashboard_token` or `dashboard_basic_auth`.",
    )
    dashboard_port: int = _setting(8089, "TCP port of `python -m sqla_outbox dashboard`.")
    dashboard_token: str | None = _setting(
        None,
        "Secret token that opens the dashboard (at least 16 characters): typed once on its "
        "login page, or sent as `Authorization: Bearer <token>`. Unset: no token.",
    )
    dashboard_basic_auth: str | None = _setting(
        None,
        "`user:password` accepted through HTTP basic authentication (the password at least "
        "12 characters); the user name is recorded as who did an action. Unset: no basic auth.",
    )
    dashboard_actions: bool = _setting(
        False,
        "Enable the dashboard's actions (DLQ requeue, cancel runs; later pause, resume). Off: "
        "read-only. Actions need an authenticated operator and a CSRF token.",
    )
    dashboard_show_payloads: bool = _setting(
        False,
        "Show run payloads and handler results on the dashboard's run pages (hidden by default: "
        "they may hold personal data).",
    )
    dashboard_refresh_seconds: float = _setting(
        5.0, "How often the dashboard's overview refreshes itself.", unit="s"
    )

    # --- maintenance ---------------------------------------------------------------------
    purge_sent_after_days: float = _setting(
        7.0, "`maintenance.purge` deletes outbox rows sent longer ago than this.", unit="days"
    )
    purge_succeeded_after_days: float = _setting(
        7.0, "...and `succeeded` runs (with their trail) finished longer ago.", unit="days"
    )
    purge_failed_after_days: float = _setting(30.0, "...and `failed` runs finished longer ago.", unit="days")
    purge_batch_size: int = _setting(1000, "Rows deleted per purge statement.")

    def __post_init__(self) -> None:
        for name in (
            "valkey_url",
            "database_direct_url",
            "sqs_endpoint_url",
            "tenant_foreign_key",
            "sqs_kms_key_id",
            "dashboard_token",
            "dashboard_basic_auth",
        ):
            value = getattr(self, name)
            if isinstance(value, str) and value.strip().lower() in _NONE_WORDS:
                object.__setattr__(self, name, None)
        if isinstance(self.wake_mode, str):
            object.__setattr__(self, "wake_mode", self.wake_mode.strip().lower())
        _validate(self)

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
                values[field.name] = _parse(field, raw, name)
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
        of a declared queue) > 120 s.
        """
        for entry in self.queue_visibility_timeouts:
            name, _, seconds = entry.partition("=")
            if name.strip() == queue:
                return int(seconds)
        if queue in QUEUE_NAMES:
            return int(getattr(self, f"visibility_timeout_{queue}_seconds"))
        return VISIBILITY_TIMEOUT_SECONDS["default"] if declared is None else declared

    def dlq_url_name(self, queue: str) -> str:
        """SQS dead-letter queue name for a logical queue (``<prefix><queue>-dlq``)."""
        return f"{self.queue_prefix}{queue}-dlq"

    def redacted(self) -> dict[str, Any]:
        """Settings as a dict with passwords in URLs masked, for logs and ``--check``."""
        out: dict[str, Any] = {}
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if isinstance(value, str) and "://" in value:
                value = redact_url(value)
            if field.name == "signing_keys":
                value = ["***"] * len(value)
            if field.name == "dashboard_token" and value:
                value = "***"
            if field.name == "dashboard_basic_auth" and value:
                value = value.split(":", 1)[0] + ":***"
            out[field.name] = value
        return out


def env_names(field_name: str) -> tuple[str, ...]:
    """Environment variables read for ``field_name``, highest precedence first."""
    field = {f.name: f for f in dataclasses.fields(OutboxSettings)}[field_name]
    return (ENV_PREFIX + field_name.upper(), *field.metadata["aliases"])


_NONE_WORDS = {"", "none", "null", "off"}
_TRUE_WORDS = {"1", "true", "yes", "on"}
_FALSE_WORDS = {"0", "false", "no", "off", ""}


def _parse(field: dataclasses.Field[Any], raw: str, name: str) -> Any:
    kind = str(field.type)
    text = raw.strip()
    try:
        if "None" in kind and text.lower() in _NONE_WORDS:
            return None
        if kind.startswith("bool"):
            if text.lower() in _TRUE_WORDS:
                return True
            if text.lower() in _FALSE_WORDS:
                return False
            raise ValueError(f"expected true/false, got {raw!r}")
        if kind.startswith("int"):
            return _parse_int(text, raw)
        if kind.startswith("float"):
            return _parse_float(text, raw)
        if kind.startswith("tuple"):
            return tuple(part.strip() for part in text.split(",") if part.strip())
        return text
    except ValueError as exc:
        raise errors.ConfigurationError(str(exc), option=name) from exc


_INTEGER = re.compile(r"[+-]?[0-9]+")
_DECIMAL = re.compile(r"[+-]?([0-9]+\.?[0-9]*|\.[0-9]+)([eE][+-]?[0-9]+)?")


def _parse_int(text: str, raw: str) -> int:
    """A base-10 integer (``010`` is ten; ``0x10``, ``1_000`` and ``8.0`` are refused)."""
    if _INTEGER.fullmatch(text) is None:
        raise ValueError(f"expected a whole number in base 10 (like 8), got {raw!r}")
    return int(text, 10)


def _parse_float(text: str, raw: str) -> float:
    """A finite decimal number (``2``, ``2.5``, ``1e3``); ``nan``/``inf`` and ``1_000`` are refused."""
    if _DECIMAL.fullmatch(text) is None:
        raise ValueError(f"expected a number (like 2.5), got {raw!r}")
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"expected a finite number, got {raw!r}")
    return value


def _check(condition: bool, field: str, message: str) -> None:
    if not condition:
        raise errors.ConfigurationError(message, option=ENV_PREFIX + field.upper())


def _check_database_url(url: str, field: str = "database_url") -> None:
    """Refuse URLs SQLAlchemy cannot parse and databases other than PostgreSQL via psycopg 3.

    Raises:
        ConfigurationError: Naming the setting's variable (``SQLA_OUTBOX_DATABASE_URL``);
            the message shows the URL with its password masked.
    """
    shown = redact_url(url)
    try:
        parsed = make_url(sqlalchemy_url(url))
    except (sqlalchemy_exc.ArgumentError, ValueError):
        _check(
            False,
            field,
            f"{shown!r} is not a database URL; expected postgresql://user:password@host:5432/database",
        )
        return
    _check(
        parsed.drivername == "postgresql+psycopg",
        field,
        f"{parsed.drivername!r} is not supported ({shown}): sqla_outbox supports only PostgreSQL "
        "(through psycopg 3); use postgresql://user:password@host:5432/database",
    )
    _check(
        "@" not in (parsed.host or ""),
        field,
        f"{shown!r} has an '@' in its password: write it as %40 (SQLAlchemy and libpq end the "
        "password at the first '@' and would take the rest for the host name)",
    )


def _check_endpoint_url(url: str) -> None:
    """Refuse an SQS endpoint that is not an absolute ``http(s)://host[:port]`` URL."""
    try:
        parts = urlsplit(url)
        valid = parts.scheme in ("http", "https") and bool(parts.hostname)
        valid = valid and (parts.port is None or parts.port > 0)
    except ValueError:  # a port that is not a number
        valid = False
    _check(
        valid,
        "sqs_endpoint_url",
        f"{redact_url(url)!r} is not an http:// or https:// URL (example: http://127.0.0.1:4566); "
        "unset it to use AWS's endpoint for the region",
    )


WAKE_MODES = ("auto", "valkey", "postgres", "both", "none")
"""Values of ``wake_mode``; :attr:`OutboxSettings.wake_channels` says what each turns on."""

VALKEY_SCHEMES = ("redis://", "rediss://", "unix://", "valkey://", "valkeys://")
"""URL schemes accepted for ``valkey_url`` (``valkey``/``valkeys`` are read as redis/rediss)."""


def _validate(s: OutboxSettings) -> None:
    """Check every setting; a refused number is shown with its value.

    Raises:
        ConfigurationError: Naming the environment variable, what is wrong and, for a
            number, the value given (other values may be secrets and are shown only where
            the check says so, URLs with their password masked).
    """
    try:
        _validate_fields(s)
    except errors.ConfigurationError as exc:
        field = (exc.option or "").removeprefix(ENV_PREFIX).lower()
        value = getattr(s, field, None) if field else None
        if isinstance(value, (int, float)) and not isinstance(value, bool) and "got" not in exc.detail:
            shown = int(value) if isinstance(value, float) and value.is_integer() else value  # -1, not -1.0
            raise errors.ConfigurationError(f"{exc.detail}, got {shown!r}", option=exc.option) from None
        raise


def _validate_fields(s: OutboxSettings) -> None:
    _check(bool(s.database_url), "database_url", "must not be empty")
    _check_database_url(s.database_url)
    if s.database_direct_url is not None:
        _check_database_url(s.database_direct_url, "database_direct_url")
    _check(
        s.wake_mode in WAKE_MODES,
        "wake_mode",
        f"{s.wake_mode!r} is not a wake mode; expected one of {', '.join(WAKE_MODES)}",
    )
    if s.sqs_endpoint_url is not None:
        _check_endpoint_url(s.sqs_endpoint_url)
    if s.valkey_url is not None:
        _check(
            s.valkey_url.startswith(VALKEY_SCHEMES),
            "valkey_url",
            f"{redact_url(s.valkey_url)!r} is not a redis://, rediss://, valkey:// or unix:// URL "
            "(or `none` to run without Valkey)",
        )
    for field in dataclasses.fields(s):
        value = getattr(s, field.name)
        if isinstance(value, float):
            _check(math.isfinite(value), field.name, f"must be a finite number, got {value!r}")
    _check(1 <= s.wake_timeout_ms <= 10_000, "wake_timeout_ms", "must be within 1..10000 ms")
    _check(s.wake_retry_seconds >= 0, "wake_retry_seconds", "must be >= 0")
    _check(s.wake_list_max >= 1, "wake_list_max", "must be >= 1")
    _check(bool(s.wake_key), "wake_key", "must not be empty")
    _check(
        1024 <= s.max_message_bytes <= SQS_MAX_MESSAGE_BYTES,
        "max_message_bytes",
        f"must be within 1024..{SQS_MAX_MESSAGE_BYTES} bytes (SQS maximum message size)",
    )
    if s.tenant_foreign_key is not None:
        _check(
            re.fullmatch(r"[A-Za-z_][\w$]*(\.[A-Za-z_][\w$]*){1,2}", s.tenant_foreign_key) is not None,
            "tenant_foreign_key",
            f"must look like table.column or schema.table.column, got {s.tenant_foreign_key!r}",
        )
    _check(
        re.fullmatch(r"[A-Za-z0-9_-]{0,60}", s.queue_prefix) is not None,
        "queue_prefix",
        "may hold only letters, digits, '-' and '_' (SQS queue names), at most 60 characters",
    )
    _check(1 <= s.max_receive_count <= 1000, "max_receive_count", "must be within 1..1000")
    _check(
        all(len(key) >= 16 for key in s.signing_keys),
        "signing_keys",
        "each key must be at least 16 characters long",
    )
    _check(s.relay_sweep_interval_seconds > 0, "relay_sweep_interval_seconds", "must be > 0")
    _check(s.relay_queue_depth is None or s.relay_queue_depth >= 0, "relay_queue_depth", "must be >= 0")
    _check(s.relay_depth_poll_seconds > 0, "relay_depth_poll_seconds", "must be > 0")
    _check(
        s.tenant_rate_limit_per_minute is None or s.tenant_rate_limit_per_minute >= 1,
        "tenant_rate_limit_per_minute",
        "must be >= 1 (or unset for no limit)",
    )
    _check(s.flow_refresh_seconds > 0, "flow_refresh_seconds", "must be > 0")
    _check(1 <= s.relay_batch_size <= 10_000, "relay_batch_size", "must be within 1..10000")
    _check(1 <= s.relay_send_concurrency <= 64, "relay_send_concurrency", "must be within 1..64")
    _check(s.relay_backoff_base_seconds > 0, "relay_backoff_base_seconds", "must be > 0")
    _check(
        s.relay_backoff_max_seconds >= s.relay_backoff_base_seconds,
        "relay_backoff_max_seconds",
        "must be >= relay_backoff_base_seconds",
    )
    _check(s.relay_max_send_attempts >= 1, "relay_max_send_attempts", "must be >= 1")
    _check(s.relay_standby_poll_seconds > 0, "relay_standby_poll_seconds", "must be > 0")
    _check(1 <= s.relay_partitions <= 1024, "relay_partitions", "must be within 1..1024")
    _check(
        60 <= s.sqs_message_retention_seconds <= 1_209_600,
        "sqs_message_retention_seconds",
        "must be within 60..1209600 s (SQS MessageRetentionPeriod)",
    )
    for queue in QUEUE_NAMES:
        _check(
            0 <= s.visibility_timeout_seconds(queue) <= 43_200,
            f"visibility_timeout_{queue}_seconds",
            "must be within 0..43200 s (SQS VisibilityTimeout)",
        )
    for entry in s.queue_visibility_timeouts:
        name, equals, seconds = entry.partition("=")
        _check(
            bool(equals) and is_queue_name(name.strip()) and seconds.strip().isdigit(),
            "queue_visibility_timeouts",
            f"{entry!r} is not name=seconds (a queue name and a whole number of seconds)",
        )
        _check(
            0 <= int(seconds) <= 43_200,
            "queue_visibility_timeouts",
            f"{entry!r}: must be within 0..43200 s (SQS VisibilityTimeout)",
        )
    _check(bool(s.worker_queues), "worker_queues", "must name at least one queue")
    for queue in s.worker_queues:
        _check(  # declared queues are checked against the catalog when the worker starts
            is_queue_name(queue),
            "worker_queues",
            f"{queue!r} is not a queue name (1..40 letters, digits, '-' and '_'); the four "
            f"defaults are {', '.join(QUEUE_NAMES)}",
        )
    _check(1 <= s.worker_concurrency <= 1000, "worker_concurrency", "must be within 1..1000")
    _check(
        0 <= s.worker_wait_seconds <= 20,
        "worker_wait_seconds",
        "must be within 0..20 s (SQS ReceiveMessage WaitTimeSeconds)",
    )
    _check(1 <= s.worker_db_pool_size <= 1000, "worker_db_pool_size", "must be within 1..1000")
    _check(s.worker_max_receives >= 1, "worker_max_receives", "must be >= 1")
    _check(s.worker_stop_budget_seconds >= 0, "worker_stop_budget_seconds", "must be >= 0")
    _check(
        0.1 <= s.worker_cancel_check_seconds <= 3600,
        "worker_cancel_check_seconds",
        "must be within 0.1..3600 s",
    )
    _check(1 <= s.result_max_bytes <= 16_777_216, "result_max_bytes", "must be within 1..16777216 bytes")
    _check(s.worker_backoff_base_seconds >= 0, "worker_backoff_base_seconds", "must be >= 0")
    _check(
        s.worker_backoff_base_seconds <= s.worker_backoff_max_seconds <= 43_200,
        "worker_backoff_max_seconds",
        "must be within worker_backoff_base_seconds..43200 s (SQS visibility timeout maximum)",
    )
    _check(1 <= s.limits_slot_lease_seconds <= 3600, "limits_slot_lease_seconds", "must be within 1..3600 s")
    _check(
        0 < s.limits_throttle_delay_seconds <= s.limits_throttle_delay_max_seconds <= 3600,
        "limits_throttle_delay_max_seconds",
        "must be within limits_throttle_delay_seconds (> 0)..3600 s",
    )
    _check(
        1 <= s.limits_valkey_timeout_ms <= 10_000, "limits_valkey_timeout_ms", "must be within 1..10000 ms"
    )
    _check(s.limits_valkey_retry_seconds >= 0, "limits_valkey_retry_seconds", "must be >= 0")
    if s.health_port is not None:
        _check(0 <= s.health_port <= 65535, "health_port", "must be a TCP port (0..65535)")
    _check(0 < s.webhook_timeout_seconds <= 300, "webhook_timeout_seconds", "must be within 0..300 s (not 0)")
    for entry in s.webhook_allowed_hosts:
        _check(
            re.fullmatch(r"[A-Za-z0-9._:/-]{1,253}", entry) is not None,
            "webhook_allowed_hosts",
            f"{entry!r} is not a host name, IP address or network",
        )
    _check(
        re.fullmatch(r"[A-Za-z0-9.:_-]{1,253}", s.health_host) is not None,
        "health_host",
        f"must be an IP address or host name, got {s.health_host!r}",
    )
    _check(0 <= s.dashboard_port <= 65535, "dashboard_port", "must be a TCP port (0..65535)")
    _check(bool(s.dashboard_host.strip()), "dashboard_host", "must not be empty")
    if s.dashboard_token is not None:
        _check(len(s.dashboard_token) >= 16, "dashboard_token", "must be at least 16 characters long")
    if s.dashboard_basic_auth is not None:
        user, colon, password = s.dashboard_basic_auth.partition(":")
        _check(
            bool(user) and bool(colon) and len(password) >= 12,
            "dashboard_basic_auth",
            "must be user:password with a password of at least 12 characters",
        )
    _check(s.dashboard_refresh_seconds >= 1, "dashboard_refresh_seconds", "must be >= 1 s")
    for name in ("purge_sent_after_days", "purge_succeeded_after_days", "purge_failed_after_days"):
        _check(getattr(s, name) >= 0, name, "must be >= 0")
    _check(s.purge_batch_size >= 1, "purge_batch_size", "must be >= 1")


def reference_markdown() -> str:
    """The configuration reference (``docs/configuration.md``), generated from the fields."""
    lines = [
        "# Configuration reference",
        "",
        "<!-- generated by sqla_outbox.config.reference_markdown(); tests fail when it is stale -->",
        "",
        "Every setting is a field of `sqla_outbox.OutboxSettings` and has one canonical environment",
        "variable with the `SQLA_OUTBOX_` prefix; some also accept the bare names deployments already",
        "use. Precedence: command-line option > `SQLA_OUTBOX_*` variable > bare alias > default.",
        "`python -m sqla_outbox config` prints the values in effect (passwords masked).",
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
        "| setting | environment | default | unit | meaning |",
        "|---|---|---|---|---|",
    ]
    for field in dataclasses.fields(OutboxSettings):
        default = field.default
        if isinstance(default, tuple):
            shown = ",".join(default) if default else "(empty)"
        elif default is None:
            shown = "(unset)"
        else:
            shown = str(default)
        envs = "<br>".join(f"`{name}`" for name in env_names(field.name))
        unit = field.metadata["unit"] or ""
        doc = field.metadata["doc"].replace("|", "\\|")
        lines.append(f"| `{field.name}` | {envs} | `{shown}` | {unit} | {doc} |")
    return "\n".join(lines) + "\n"
