"""The wake after commit: one LPUSH, bounded list, and Valkey trouble never reaches the app."""

from __future__ import annotations

import logging
import shutil
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
import sqlalchemy as sa
from sqlalchemy.orm import Session, sessionmaker

import sqla_outbox
from sqla_outbox import Dispatch
from sqla_outbox.catalog import Catalog
from sqla_outbox.config import OutboxSettings
from tests.support import black_hole, closed_port_url, count, drain_wakes, free_port, wait_for


def installed(engine: sa.Engine, settings: OutboxSettings, catalog: Catalog) -> sessionmaker[Session]:
    maker = sessionmaker(engine)
    sqla_outbox.install(maker, settings, catalog=catalog)
    return maker


@pytest.fixture
def cleanup() -> Iterator[list[sessionmaker[Session]]]:
    makers: list[sessionmaker[Session]] = []
    yield makers
    for maker in makers:
        sqla_outbox.uninstall(maker)


def commit_one(maker: sessionmaker[Session]) -> float:
    started = time.monotonic()
    with maker() as session, session.begin():
        session.add(Dispatch("audit", {}))
    return time.monotonic() - started


def test_wake_list_stays_bounded_while_no_relay_listens(
    engine: sa.Engine, settings: OutboxSettings, catalog: Catalog, valkey: redis.Redis, cleanup: list
) -> None:
    maker = installed(engine, settings.replace(wake_list_max=5), catalog)
    cleanup.append(maker)
    for _ in range(40):
        commit_one(maker)
    drain_wakes()
    # trimmed to one entry whenever a push finds it over the bound (all entries are alike)
    assert 1 <= valkey.llen(settings.wake_key) <= 5
    assert sqla_outbox.installation_for(maker).waker.stats.sent == 40  # type: ignore[union-attr]


def empty_wake_list(
    engine: sa.Engine, settings: OutboxSettings, catalog: Catalog, valkey: redis.Redis, cleanup: list
) -> tuple[sessionmaker[Session], Any]:
    """A sessionmaker installed with ``settings``, its waker, and the wake list emptied."""
    maker = installed(engine, settings, catalog)
    cleanup.append(maker)
    valkey.delete(settings.wake_key)
    return maker, sqla_outbox.installation_for(maker).waker  # type: ignore[union-attr]


def test_an_unpopped_wake_list_is_cut_to_one_entry_when_it_overflows(
    engine: sa.Engine, settings: OutboxSettings, catalog: Catalog, valkey: redis.Redis, cleanup: list
) -> None:
    maker, waker = empty_wake_list(engine, settings.replace(wake_list_max=5), catalog, valkey, cleanup)
    lengths = []
    for _ in range(12):  # isolated commits: one push each
        commit_one(maker)
        assert waker.drain(2.0)
        time.sleep(0.02)
        lengths.append(int(valkey.llen(settings.wake_key)))
    # the 6th push finds 6 > 5 entries and cuts the list to one; so does the 11th
    assert lengths == [1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2]


def test_a_burst_of_commits_shares_pushes_and_an_isolated_commit_is_pushed_at_once(
    engine: sa.Engine, settings: OutboxSettings, catalog: Catalog, valkey: redis.Redis, cleanup: list
) -> None:
    maker, waker = empty_wake_list(engine, settings.replace(wake_list_max=100_000), catalog, valkey, cleanup)
    started = time.monotonic()
    for _ in range(60):
        commit_one(maker)
    elapsed = time.monotonic() - started
    assert waker.drain(2.0)
    pushes = int(valkey.llen(settings.wake_key))
    # at most one push per 10 ms window of the burst (plus the first, at once), every
    # commit counted once
    assert 1 <= pushes <= elapsed / 0.01 + 2
    assert waker.stats.sent == 60
    time.sleep(0.05)  # the burst is over: the thread went back to waiting
    commit_one(maker)
    assert wait_for(lambda: int(valkey.llen(settings.wake_key)) == pushes + 1, timeout=1.0)
    assert waker.stats.sent == 61


def test_valkey_refusing_connections_never_reaches_the_app(
    engine: sa.Engine,
    settings: OutboxSettings,
    catalog: Catalog,
    cleanup: list,
    caplog: pytest.LogCaptureFixture,
) -> None:
    maker = installed(engine, settings.replace(valkey_url=closed_port_url()), catalog)
    cleanup.append(maker)
    with caplog.at_level(logging.WARNING, logger="sqla_outbox"):
        durations = [commit_one(maker) for _ in range(5)]
        drain_wakes()
    assert count(engine, "task_runs") == 5
    assert max(durations) < 0.5
    stats = sqla_outbox.installation_for(maker).waker.stats  # type: ignore[union-attr]
    assert stats.sent == 0 and stats.failed >= 1 and stats.failed + stats.skipped == 5
    warnings = [r for r in caplog.records if "wake failed" in r.getMessage()]
    assert len(warnings) == 1  # once per outage, not once per commit


def test_hung_valkey_adds_nothing_to_commits(
    engine: sa.Engine, settings: OutboxSettings, catalog: Catalog, cleanup: list
) -> None:
    with black_hole() as url:
        maker = installed(engine, settings.replace(valkey_url=url, wake_timeout_ms=2000), catalog)
        cleanup.append(maker)
        durations = [commit_one(maker) for _ in range(3)]
        drain_wakes(timeout=8)
    assert count(engine, "task_runs") == 3
    # far below the 2 s wake timeout, far above scheduling noise on a busy machine
    assert max(durations) < 1.0  # commits never wait for the wake, even with Valkey hung
    stats = sqla_outbox.installation_for(maker).waker.stats  # type: ignore[union-attr]
    assert stats.sent == 0 and stats.failed >= 1 and stats.failed + stats.skipped == 3


def test_wakes_resume_when_valkey_comes_back(
    engine: sa.Engine,
    settings: OutboxSettings,
    catalog: Catalog,
    cleanup: list,
    caplog: pytest.LogCaptureFixture,
) -> None:
    server = shutil.which("redis-server") or shutil.which("valkey-server")
    if server is None:  # pragma: no cover - the CI machine has it
        pytest.fail("redis-server or valkey-server is needed for this test")
    port = free_port()
    url = f"redis://127.0.0.1:{port}/0"
    maker = installed(engine, settings.replace(valkey_url=url, wake_retry_seconds=0.2), catalog)
    cleanup.append(maker)
    commit_one(maker)  # nothing listens yet: fails
    drain_wakes()  # (else, on a busy machine, the push can land after the server started)
    process = subprocess.Popen(
        [server, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
        stdout=subprocess.DEVNULL,
    )
    try:
        client = redis.Redis.from_url(url)
        wait_for(lambda: _pings(client), timeout=10)
        time.sleep(0.25)  # past the retry window
        with caplog.at_level(logging.INFO, logger="sqla_outbox"):
            commit_one(maker)
            drain_wakes()
        assert client.llen(settings.wake_key) == 1
        assert any("wake recovered" in r.getMessage() for r in caplog.records)
        client.close()
    finally:
        process.terminate()
        process.wait(10)


def _pings(client: redis.Redis) -> bool:
    try:
        return bool(client.ping())
    except redis.RedisError:
        return False


def test_no_wake_configured_means_sweep_only(
    engine: sa.Engine, settings: OutboxSettings, catalog: Catalog, cleanup: list
) -> None:
    maker = installed(engine, settings.replace(valkey_url=None, wake_mode="none"), catalog)
    cleanup.append(maker)
    commit_one(maker)
    assert count(engine, "task_runs") == 1


def test_rows_exist_when_the_process_dies_right_after_commit(
    database_url: str, settings: OutboxSettings, valkey: redis.Redis, tmp_path: Path
) -> None:
    """Commit, then SIGKILL before anything else runs (not even the wake)."""
    script = tmp_path / "crash.py"
    script.write_text(
        textwrap.dedent(
            f"""
            import os, signal
            import sqlalchemy as sa
            from sqlalchemy.orm import sessionmaker
            import sqla_outbox
            from sqla_outbox import Dispatch, OutboxSettings

            engine = sa.create_engine({database_url!r})
            maker = sessionmaker(engine)
            # runs before sqla_outbox's own after_commit listener: the wake never happens
            sa.event.listen(maker, "after_commit", lambda s: os.kill(os.getpid(), signal.SIGKILL))
            sqla_outbox.install(maker, OutboxSettings(
                database_url={database_url!r}, valkey_url={settings.valkey_url!r},
                wake_key={settings.wake_key!r}, catalog_path={settings.catalog_path!r}))
            with maker() as session, session.begin():
                session.add(Dispatch("audit", {{"survives": True}}, tenant_id=1))
            print("unreachable")
            """
        )
    )
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60)
    assert result.returncode == -9, result.stderr
    assert "unreachable" not in result.stdout
    engine = sa.create_engine(database_url)
    assert count(engine, "outbox_messages") == 1
    assert count(engine, "task_runs") == 1
    engine.dispose()
    assert valkey.llen(settings.wake_key) == 0


def test_valkey_url_that_is_not_a_redis_url_is_refused_at_install(
    engine: sa.Engine, settings: OutboxSettings, catalog: Catalog
) -> None:
    from sqla_outbox import errors

    maker = sessionmaker(engine)
    for url in ("http://127.0.0.1:6379", "127.0.0.1:6379"):
        with pytest.raises(errors.ConfigurationError, match="SQLA_OUTBOX_VALKEY_URL"):
            sqla_outbox.install(maker, settings.replace(valkey_url=url), catalog=catalog)
        assert sqla_outbox.installation_for(maker) is None


def test_valkey_url_pointing_at_another_service_never_reaches_the_app(
    engine: sa.Engine, settings: OutboxSettings, catalog: Catalog, cleanup: list, moto_endpoint: str
) -> None:
    """Misconfigured: the URL points at another service (an HTTP server), which does not
    speak the Redis protocol."""
    port = moto_endpoint.rsplit(":", 1)[1].split("/")[0]
    maker = installed(engine, settings.replace(valkey_url=f"redis://127.0.0.1:{port}/0"), catalog)
    cleanup.append(maker)
    durations = [commit_one(maker) for _ in range(3)]
    drain_wakes()
    assert max(durations) < 0.6
    assert count(engine, "task_runs") == 3
    stats = sqla_outbox.installation_for(maker).waker.stats  # type: ignore[union-attr]
    assert stats.sent == 0 and stats.failed >= 1 and stats.failed + stats.skipped == 3
