"""Settings: environment names, precedence, validation against SQS limits."""

from __future__ import annotations

import pytest

from sqla_outbox import errors
from sqla_outbox.config import OutboxSettings, env_names, redact_url, sqlalchemy_url


def test_defaults_are_valid_and_documented() -> None:
    settings = OutboxSettings()
    assert settings.max_message_bytes == 262_144
    assert settings.worker_queues == ("critical", "default", "bulk", "maintenance")
    import dataclasses

    for field in dataclasses.fields(OutboxSettings):
        assert field.metadata["doc"], field.name


def test_prefixed_variable_beats_bare_alias_which_beats_default() -> None:
    env = {"DATABASE_URL": "postgresql://bare/db"}
    assert OutboxSettings.from_env(env).database_url == "postgresql://bare/db"
    env["SQLA_OUTBOX_DATABASE_URL"] = "postgresql://prefixed/db"
    assert OutboxSettings.from_env(env).database_url == "postgresql://prefixed/db"
    chosen = OutboxSettings.from_env(env, database_url="postgresql://cli/db")
    assert chosen.database_url == "postgresql://cli/db"
    assert OutboxSettings.from_env(env, database_url=None).database_url == "postgresql://prefixed/db"


def test_types_are_parsed() -> None:
    settings = OutboxSettings.from_env(
        {
            "QUEUES": "critical, bulk",
            "SQLA_OUTBOX_WORKER_CONCURRENCY": "16",
            "SQLA_OUTBOX_RELAY_SWEEP_INTERVAL_SECONDS": "2.5",
            "SQLA_OUTBOX_WORKER_RUN_RELAY": "true",
            "REDIS_URL": "none",
            "SQLA_OUTBOX_TENANT_FOREIGN_KEY": "",
        }
    )
    assert settings.worker_queues == ("critical", "bulk")
    assert settings.worker_concurrency == 16
    assert settings.relay_sweep_interval_seconds == 2.5
    assert settings.worker_run_relay is True
    assert settings.valkey_url is None
    assert settings.tenant_foreign_key is None


@pytest.mark.parametrize(
    ("env", "variable"),
    [
        ({"SQLA_OUTBOX_WORKER_CONCURRENCY": "many"}, "SQLA_OUTBOX_WORKER_CONCURRENCY"),
        ({"SQLA_OUTBOX_WORKER_WAIT_SECONDS": "21"}, "SQLA_OUTBOX_WORKER_WAIT_SECONDS"),
        ({"SQLA_OUTBOX_MAX_MESSAGE_BYTES": "2000000"}, "SQLA_OUTBOX_MAX_MESSAGE_BYTES"),
        (
            {"QUEUES": "critical,not a queue!"},
            "SQLA_OUTBOX_WORKER_QUEUES",
        ),  # undeclared names: checked at start
        ({"SQLA_OUTBOX_WORKER_BACKOFF_MAX_SECONDS": "50000"}, "SQLA_OUTBOX_WORKER_BACKOFF_MAX_SECONDS"),
        ({"SQLA_OUTBOX_QUEUE_PREFIX": "bad prefix"}, "SQLA_OUTBOX_QUEUE_PREFIX"),
        ({"SQLA_OUTBOX_WORKER_RUN_RELAY": "maybe"}, "SQLA_OUTBOX_WORKER_RUN_RELAY"),
    ],
)
def test_bad_values_name_the_variable(env: dict[str, str], variable: str) -> None:
    with pytest.raises(errors.ConfigurationError) as caught:
        OutboxSettings.from_env(env)
    assert variable in str(caught.value)


@pytest.mark.parametrize(
    ("variable", "raw", "shown"),
    [
        ("SQLA_OUTBOX_RELAY_PARTITIONS", "0", "must be within 1..1024, got 0"),
        ("SQLA_OUTBOX_WORKER_WAIT_SECONDS", "21", "got 21"),
        ("SQLA_OUTBOX_MAX_MESSAGE_BYTES", "2000000", "got 2000000"),
        ("SQLA_OUTBOX_WAKE_LIST_MAX", "0", "must be >= 1, got 0"),
        ("SQLA_OUTBOX_WAKE_RETRY_SECONDS", "-2.5", "must be >= 0 s, got -2.5"),
        ("SQLA_OUTBOX_WAKE_RETRY_SECONDS", "-3", "must be >= 0 s, got -3"),
    ],
)
def test_a_refused_number_is_shown_with_its_value(variable: str, raw: str, shown: str) -> None:
    with pytest.raises(errors.ConfigurationError) as caught:
        OutboxSettings.from_env({variable: raw})
    assert str(caught.value).startswith(f"{variable}: ")
    assert shown in str(caught.value)
    assert str(caught.value).count("got") == 1


def test_a_refused_url_keeps_its_password_masked() -> None:
    with pytest.raises(errors.ConfigurationError) as caught:
        OutboxSettings.from_env({"SQLA_OUTBOX_VALKEY_URL": "http://user:s3cret@host:6379/0"})
    assert "s3cret" not in str(caught.value)


def test_env_names_list_prefix_first_then_aliases() -> None:
    assert env_names("valkey_url") == ("SQLA_OUTBOX_VALKEY_URL", "VALKEY_URL", "REDIS_URL")


def test_url_helpers() -> None:
    assert sqlalchemy_url("postgresql://u@h/db") == "postgresql+psycopg://u@h/db"
    assert sqlalchemy_url("postgresql+asyncpg://u@h/db") == "postgresql+psycopg://u@h/db"
    assert sqlalchemy_url("postgres+psycopg2://u@h/db") == "postgresql+psycopg://u@h/db"
    assert sqlalchemy_url("postgresql+psycopg://u@h/db") == "postgresql+psycopg://u@h/db"
    assert sqlalchemy_url("mysql://u@h/db") == "mysql://u@h/db"
    # an application's asyncpg URL serves sqla_outbox's (psycopg) engines as it is
    settings = OutboxSettings.from_env({"DATABASE_URL": "postgresql+asyncpg://u@h/db"})
    assert settings.sqlalchemy_url == "postgresql+psycopg://u@h/db"
    assert redact_url("postgresql://user:s3cret@host/db") == "postgresql://user:***@host/db"
    assert "s3cret" not in str(OutboxSettings(database_url="postgresql://u:s3cret@h/d").redacted())


def test_configuration_reference_in_docs_is_current() -> None:
    from pathlib import Path

    from sqla_outbox.config import reference_markdown

    path = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"
    assert path.read_text() == reference_markdown(), (
        "docs/configuration.md is stale: regenerate it with "
        '`python -c "from sqla_outbox.config import reference_markdown; '
        "open('docs/configuration.md','w').write(reference_markdown())\"`"
    )


@pytest.mark.parametrize(("raw", "value"), [("16", 16), ("010", 10), (" +8 ", 8)])
def test_integers_are_read_in_base_10(raw: str, value: int) -> None:
    settings = OutboxSettings.from_env({"SQLA_OUTBOX_WORKER_CONCURRENCY": raw})
    assert settings.worker_concurrency == value


@pytest.mark.parametrize("raw", ["0x10", "8.0", "1_000", "eight", "1e2"])
def test_other_integer_spellings_are_refused_naming_the_variable(raw: str) -> None:
    with pytest.raises(errors.ConfigurationError) as caught:
        OutboxSettings.from_env({"SQLA_OUTBOX_WORKER_CONCURRENCY": raw})
    message = str(caught.value)
    assert message.startswith("SQLA_OUTBOX_WORKER_CONCURRENCY: expected a whole number in base 10")
    assert repr(raw) in message and "int()" not in message


@pytest.mark.parametrize(("raw", "value"), [("2", 2.0), ("2.5", 2.5), (".5", 0.5), ("1e1", 10.0)])
def test_floats_accept_decimal_numbers(raw: str, value: float) -> None:
    settings = OutboxSettings.from_env({"SQLA_OUTBOX_RELAY_SWEEP_INTERVAL_SECONDS": raw})
    assert settings.relay_sweep_interval_seconds == value


@pytest.mark.parametrize("raw", ["inf", "nan", "1_0", "0x1p3", "soon"])
def test_floats_refuse_non_finite_and_odd_spellings(raw: str) -> None:
    with pytest.raises(errors.ConfigurationError) as caught:
        OutboxSettings.from_env({"SQLA_OUTBOX_RELAY_SWEEP_INTERVAL_SECONDS": raw})
    assert str(caught.value).startswith("SQLA_OUTBOX_RELAY_SWEEP_INTERVAL_SECONDS: expected a")
    with pytest.raises(errors.ConfigurationError, match="finite"):
        OutboxSettings(relay_backoff_max_seconds=float("inf"))


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        ("notaurl", "is not a database URL"),
        ("postgresql://app:s3cret@db:port/app", "is not a database URL"),
        ("mysql://app:s3cret@db/app", "supports only PostgreSQL"),
        ("sqlite:///outbox.db", "supports only PostgreSQL"),
        ("mysql+asyncmy://app:s3cret@db/app", "supports only PostgreSQL"),
    ],
)
def test_database_url_must_be_postgresql(url: str, expected: str) -> None:
    with pytest.raises(errors.ConfigurationError) as caught:
        OutboxSettings.from_env({"DATABASE_URL": url})
    message = str(caught.value)
    assert message.startswith("SQLA_OUTBOX_DATABASE_URL: ") and expected in message
    assert "s3cret" not in message


@pytest.mark.parametrize(
    "url", ["postgresql://u@h/db", "postgres://u:p@h:5433/db", "postgresql+psycopg://u@h/db?sslmode=require"]
)
def test_postgresql_urls_are_accepted(url: str) -> None:
    assert OutboxSettings(database_url=url).database_url == url


@pytest.mark.parametrize("url", ["notaurl", "127.0.0.1:4566", "ftp://h/", "http://", "http://h:port"])
def test_sqs_endpoint_must_be_an_http_url(url: str) -> None:
    with pytest.raises(errors.ConfigurationError) as caught:
        OutboxSettings.from_env({"SQLA_OUTBOX_SQS_ENDPOINT_URL": url})
    assert str(caught.value).startswith("SQLA_OUTBOX_SQS_ENDPOINT_URL: ")
    assert "is not an http:// or https:// URL" in str(caught.value)
    assert OutboxSettings(sqs_endpoint_url="https://sqs.eu-west-1.amazonaws.com").sqs_endpoint_url


def test_signing_key_length_is_documented_and_enforced() -> None:
    from sqla_outbox.config import reference_markdown

    row = next(line for line in reference_markdown().splitlines() if line.startswith("| `signing_keys`"))
    assert "each entry at least 16 characters" in row and "| yes |" in row
    with pytest.raises(errors.ConfigurationError, match="at least 16 characters"):
        OutboxSettings.from_env({"SQLA_OUTBOX_SIGNING_KEYS": "short," + "k" * 16})


def test_valkey_url_must_be_a_redis_url_at_every_entry_point() -> None:
    with pytest.raises(
        errors.ConfigurationError, match=r"^SQLA_OUTBOX_VALKEY_URL: 'notaurl' is not a redis://"
    ):
        OutboxSettings.from_env({"SQLA_OUTBOX_VALKEY_URL": "notaurl"})
    assert OutboxSettings.from_env({"SQLA_OUTBOX_VALKEY_URL": "none"}).valkey_url is None
    assert (
        OutboxSettings.from_env({"REDIS_URL": "valkey://cache:6379/0"}).valkey_url == "valkey://cache:6379/0"
    )


def test_an_asyncpg_url_query_is_translated_for_libpq() -> None:
    url = "postgresql+asyncpg://app:s3cret@db:5432/app?ssl=require&prepared_statement_cache_size=0&application_name=x"
    assert (
        sqlalchemy_url(url)
        == "postgresql+psycopg://app:s3cret@db:5432/app?application_name=x&sslmode=require"
    )
    assert (
        sqlalchemy_url("postgresql+asyncpg://app@db/app?ssl=true")
        == "postgresql+psycopg://app@db/app?sslmode=require"
    )


def test_a_variable_overridden_by_an_option_is_not_read() -> None:
    env = {"SQLA_OUTBOX_RELAY_BATCH_SIZE": "abc"}
    assert OutboxSettings.from_env(env, relay_batch_size=10).relay_batch_size == 10
    with pytest.raises(errors.ConfigurationError, match="SQLA_OUTBOX_RELAY_BATCH_SIZE"):
        OutboxSettings.from_env(env)


def test_wake_mode_says_which_wakes_are_in_force() -> None:
    valkey = "redis://cache:6379/0"
    cases = {
        ("auto", valkey): {"valkey"},
        ("auto", None): {"postgres"},
        ("valkey", valkey): {"valkey"},
        ("valkey", None): set(),
        ("postgres", valkey): {"postgres"},
        ("both", valkey): {"valkey", "postgres"},
        ("both", None): {"postgres"},
        ("none", valkey): set(),
    }
    for (mode, url), channels in cases.items():
        settings = OutboxSettings(wake_mode=mode, valkey_url=url)
        assert settings.wake_channels == channels, (mode, url)
        assert settings.wake_notify == ("postgres" in channels)
        assert settings.wake_valkey_url == (url if "valkey" in channels else None)
    assert OutboxSettings.from_env({"SQLA_OUTBOX_WAKE_MODE": " Postgres "}).wake_mode == "postgres"
    with pytest.raises(
        errors.ConfigurationError,
        match=r"^SQLA_OUTBOX_WAKE_MODE: must be a wake mode \(auto, valkey, postgres, both, none\), "
        r"got 'notify'$",
    ):
        OutboxSettings.from_env({"SQLA_OUTBOX_WAKE_MODE": "notify"})


def test_the_listen_url_is_the_direct_url_when_set() -> None:
    pooled = "postgresql+asyncpg://app:pw@pgbouncer:6432/app"
    settings = OutboxSettings(database_url=pooled)
    assert settings.listen_url == "postgresql://app:pw@pgbouncer:6432/app"
    direct = OutboxSettings.from_env(
        {"DATABASE_URL": pooled, "DATABASE_DIRECT_URL": "postgres://app:pw@db/app"}
    )
    assert direct.listen_url == "postgresql://app:pw@db/app"
    with pytest.raises(errors.ConfigurationError, match=r"^SQLA_OUTBOX_DATABASE_DIRECT_URL: 'mysql"):
        OutboxSettings(database_direct_url="mysql://db/app")


def test_worker_pool_size_defaults_small_and_is_validated() -> None:
    """Issue 17: a bounded pool per worker (not concurrency + 4), and a short long poll so
    an idle worker stops within 2 s."""
    settings = OutboxSettings()
    assert (settings.worker_db_pool_size, settings.worker_wait_seconds) == (4, 1)
    assert OutboxSettings.from_env({"SQLA_OUTBOX_WORKER_DB_POOL_SIZE": "2"}).worker_db_pool_size == 2
    for bad in (0, 1001):
        with pytest.raises(errors.ConfigurationError, match=r"WORKER_DB_POOL_SIZE: must be within 1\.\.1000"):
            OutboxSettings(worker_db_pool_size=bad)
