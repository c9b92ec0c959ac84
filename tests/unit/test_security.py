"""Pure pieces of the threat model (docs/security.md): URL masking, visible escapes, whole
name matching, what a log line may say about a database error, the DLQ attribute budget."""

from __future__ import annotations

import json
import uuid

import pytest
import sqlalchemy as sa

from sqla_outbox import Dispatch, Publish, envelope, errors, webhooks
from sqla_outbox.catalog import Catalog
from sqla_outbox.config import OutboxSettings, redact_text, redact_url
from sqla_outbox.logging import describe_error, error_fields, printable, safe_traceback
from sqla_outbox.worker.outcome import CONTEXT_ATTRIBUTES, ORIGIN_ATTRIBUTES, SQS_MAX_MESSAGE_ATTRIBUTES
from sqla_outbox.worker.registry import Registry

# --- every URL shown, every form ------------------------------------------------------------


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("postgresql://app:s3cret@db:5432/app", "postgresql://app:***@db:5432/app"),
        # issue 12 (5): the query form, and an unescaped @ in the password
        (
            "postgresql://app@db/app?password=s3cret&sslmode=require",
            "postgresql://app@db/app?password=***&sslmode=require",
        ),
        ("postgresql://app:s3@cret@db:5432/app", "postgresql://app:***@db:5432/app"),
        (
            "postgresql://app:s3/cr@et@db/app?sslpassword=s3cret",
            "postgresql://app:***@db/app?sslpassword=***",
        ),
        (
            "postgresql://app:pw@db/app?application_name=me@host",
            "postgresql://app:***@db/app?application_name=me%40host",
        ),
        (
            "postgresql://app:pw@db:notaport/app?password=s3cret",
            "postgresql://app:***@db:notaport/app?password=***",
        ),
        ("redis://:s3cret@cache:6379/0", "redis://:***@cache:6379/0"),
        ("rediss://default:s3@cret@cache:6379/0", "rediss://default:***@cache:6379/0"),
        ("unix:///run/valkey.sock?password=s3cret&db=0", "unix:///run/valkey.sock?db=0&password=***"),
        ("http://key:s3cret@127.0.0.1:4566", "http://key:***@127.0.0.1:4566"),
        ("https://sqs.eu-west-1.amazonaws.com", "https://sqs.eu-west-1.amazonaws.com"),
        (
            "postgresql+psycopg://postgres@127.0.0.1:5432/test",
            "postgresql+psycopg://postgres@127.0.0.1:5432/test",
        ),
    ],
)
def test_every_url_is_shown_without_its_password(url: str, shown: str) -> None:
    assert redact_url(url) == shown
    assert "s3cret" not in redact_url(url) and "cret" not in redact_url(url).replace("secret", "")


def test_settings_and_messages_never_show_a_password() -> None:
    with pytest.raises(errors.ConfigurationError, match="write it as %40") as refused:
        OutboxSettings(
            database_url="postgresql://app:s3@cret@db/app"
        )  # libpq would take cret@db for the host
    assert "cret" not in str(refused.value)
    settings = OutboxSettings(
        database_url="postgresql://app:s3cret@db/app?password=s3cret",
        valkey_url="redis://:s3cret@cache:6379/0?password=s3cret",
        sqs_endpoint_url="http://key:s3cret@127.0.0.1:4566",
    )
    assert "cret" not in json.dumps(settings.redacted())
    message = (
        'Could not connect to the endpoint URL: "http://key:s3cret@127.0.0.1:4566/" (dsn password=s3cret)'
    )
    assert "s3cret" not in redact_text(message)


# --- untrusted text on a terminal ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "shown"),
    [
        ("\x1b[2J\x1b]0;pwned\x07", "\\x1b[2J\\x1b]0;pwned\\x07"),  # clear screen, window title
        ("invoice\u202egnp.exe", "invoice\\u202egnp.exe"),  # bidi override
        ("a\u2066b\u2069c\u200bd", "a\\u2066b\\u2069c\\u200bd"),  # isolates, zero width space
        ("c1\x9bcsi\x85nel", "c1\\x9bcsi\\x85nel"),  # C1 controls
        ("line\nbreak\r\tand\x7f", "line\\x0abreak\\x0d\\x09and\\x7f"),
        ("Zoë ☃ 日本 🦆 [bold] \\x1b", "Zoë ☃ 日本 🦆 [bold] \\x1b"),  # printable text is untouched
    ],
)
def test_control_and_invisible_characters_are_shown_as_escapes(text: str, shown: str) -> None:
    assert printable(text) == shown


def test_multiline_text_keeps_its_line_breaks_only() -> None:
    assert printable("Traceback\n\tframe\x1b[31m", multiline=True) == "Traceback\n\tframe\\x1b[31m"


# --- names match whole strings ------------------------------------------------------------------


@pytest.mark.parametrize("name", ["record\n", "record\r\n", "\nrecord", "a" * 201, "", "bad name"])
def test_a_name_with_a_trailing_newline_is_refused_everywhere(name: str) -> None:
    """Issue 12 (5): ``$`` accepts a trailing newline; names are matched whole."""
    with pytest.raises(errors.InvalidDispatch):
        Dispatch(name, {})
    with pytest.raises(errors.InvalidDispatch):
        Publish(name, {})
    with pytest.raises(errors.ConfigurationError):
        Registry().task(name)(lambda payload: None)
    with pytest.raises(errors.CatalogError):
        Catalog.from_dict({"version": 1, "tasks": {name: {}}})
    with pytest.raises(errors.CatalogError):
        Catalog.from_dict({"version": 1, "tasks": {"t": {}}, "events": {name: {"subscribers": ["t"]}}})
    body = {
        "v": 1,
        "run_id": str(uuid.uuid4()),
        "task": name,
        "queue": "default",
        "tenant_id": None,
        "payload": "{}",
    }
    with pytest.raises(envelope.MalformedEnvelope, match="bad-field"):
        envelope.decode(json.dumps(body), max_bytes=262_144)
    with pytest.raises(envelope.MalformedEnvelope, match="bad-field"):
        envelope.decode(json.dumps({**body, "task": "t", "event": name}), max_bytes=262_144)
    # a webhook endpoint's events, when it is saved (they would never match a publish)
    with pytest.raises(errors.InvalidEndpoint, match="not an event name"):
        webhooks.new_endpoint(tenant_id=1, url="https://hooks.example/in", events=[name])
    endpoint = webhooks.new_endpoint(tenant_id=1, url="https://hooks.example/in", events=["order.paid"])
    with pytest.raises(errors.InvalidEndpoint, match="not an event name"):
        webhooks.update_endpoint(endpoint, events=["order.paid", name])
    # a breaker key (part of Valkey key names)
    with pytest.raises(errors.ConfigurationError, match="breaker key"):
        Registry().task("t", breaker=name)(lambda payload: None)


@pytest.mark.parametrize("event", ["order\x1bpaid", "order\x00", "order.paid\r", "\u202eorder"])
def test_an_endpoint_event_with_control_characters_is_refused_when_saved(event: str) -> None:
    with pytest.raises(errors.InvalidEndpoint) as refused:
        webhooks.new_endpoint(tenant_id=1, url="https://hooks.example/in", events=[event])
    assert refused.value.field == "events"


# --- database errors in logs ---------------------------------------------------------------------


MARKER = "card-4242-4242-4242-4242"


def _database_error() -> BaseException:
    """A real SQLAlchemy error of a statement whose parameter and failing row hold MARKER."""
    engine = sa.create_engine("sqlite://")
    try:
        with engine.begin() as conn:
            conn.execute(sa.text("CREATE TABLE t (v TEXT CHECK (v NOT LIKE 'card%'))"))
            conn.execute(sa.text("INSERT INTO t VALUES (:v)"), {"v": MARKER})
    except sa.exc.DBAPIError as exc:
        try:
            raise RuntimeError("handling failed") from exc
        except RuntimeError as outer:
            return outer
    raise AssertionError("no error")


def test_what_is_logged_about_a_database_error_never_holds_its_parameters() -> None:
    wrapped = _database_error()
    database_error = wrapped.__cause__
    assert database_error is not None and MARKER in str(database_error)  # what SQLAlchemy puts in its text
    fields = error_fields(database_error)
    assert fields["error_type"] == "sqlite3.IntegrityError" and MARKER not in json.dumps(fields)
    assert MARKER not in describe_error(database_error)
    rendered = safe_traceback(wrapped)
    assert MARKER not in rendered
    assert "sqlalchemy.exc.IntegrityError: [text hidden: sqlite3.IntegrityError]" in rendered
    assert "RuntimeError: handling failed" in rendered and "direct cause" in rendered
    assert error_fields(ValueError("bad\nsecond line")) == {"error_type": "ValueError", "error": "bad"}


# --- the DLQ keeps the proof of origin -----------------------------------------------------------


def test_dlq_attributes_fit_the_sqs_limit_with_the_signature_kept() -> None:
    """SQS allows 10 message attributes; the relay's signature must never be the one dropped."""
    assert len(ORIGIN_ATTRIBUTES) + len(CONTEXT_ATTRIBUTES) <= SQS_MAX_MESSAGE_ATTRIBUTES
    assert envelope.SIGNATURE_ATTRIBUTE in ORIGIN_ATTRIBUTES
    assert len(set(ORIGIN_ATTRIBUTES) | set(CONTEXT_ATTRIBUTES)) == len(ORIGIN_ATTRIBUTES) + len(
        CONTEXT_ATTRIBUTES
    )


def test_the_terminal_module_is_the_one_place_that_renders_for_people() -> None:
    """Every command prints through sqla_outbox/cli/terminal.py, which escapes what it shows:
    no other module imports rich or writes with click.echo/print (JSON goes through
    print_json, the configuration reference is the library's own text)."""
    import ast
    from pathlib import Path

    package = Path(__file__).resolve().parents[2] / "sqla_outbox"
    offenders = []
    for path in package.rglob("*.py"):
        if path.name == "terminal.py" and path.parent.name == "cli":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
                offenders += [
                    f"{path.name}:{node.lineno} imports {n}" for n in names if n.split(".")[0] == "rich"
                ]
            if isinstance(node, ast.Call):
                called = ast.unparse(node.func)
                if called in ("print", "click.echo", "click.secho") and not (
                    path.name == "config.py" and path.parent.name == "cli"
                ):
                    offenders.append(f"{path.relative_to(package)}:{node.lineno} calls {called}")
    assert offenders == []


def test_signing_keys_rotate_with_the_new_key_first() -> None:
    """The relay signs with the first key; workers and requeue accept any listed key, so a
    message (or a DLQ copy) signed before a rotation verifies while the old key is listed."""
    from sqla_outbox.ops.dlq import origin_of

    old, new = "old-signing-key-0123456789", "new-signing-key-0123456789"
    body = '{"v":1}'
    signed_before = {envelope.SIGNATURE_ATTRIBUTE: envelope.sign(body, old)}
    assert envelope.signature_valid(body, envelope.sign(body, old), [new, old])
    assert origin_of(body, signed_before, [new, old]) == "verified"
    assert origin_of(body, signed_before, [new]) == "unverified"  # the old key was dropped
    assert origin_of(body, {}, [new]) == "unverified" and origin_of(body, signed_before, []) == "unverified"
    assert not envelope.signature_valid(body + " ", envelope.sign(body, new), [new])


def test_every_test_docs_security_names_exists() -> None:
    """docs/security.md backs each guarantee with a named test (``path::name``, or
    ``::name`` for another test of the path named just before); each must exist."""
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    document = (root / "docs" / "security.md").read_text()
    named: list[tuple[str, str]] = []
    current = ""
    for path, name in re.findall(r"`(tests/[\w/]+\.py)?(?:::(\w+))?`", document):
        if path:
            current = path
        if name:
            named.append((current, name))
        elif path:
            named.append((path, ""))
    assert len(named) > 30
    for path, name in named:
        source = root / path
        assert source.exists(), path
        if name:
            assert re.search(rf"^def {name}\(", source.read_text(), re.MULTILINE), f"{path}::{name}"
