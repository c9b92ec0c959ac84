"""The short chaos run (CI): kills, outages and a PostgreSQL restart; nothing lost, nothing twice.

The long version: ``scripts/chaos --duration 600`` (see docs/reliability.md).
"""

from __future__ import annotations

import pytest

from tests.chaos import harness

pytestmark = [pytest.mark.e2e, pytest.mark.chaos]


def assert_nothing_lost_or_repeated(report: harness.ChaosReport) -> None:
    assert report.purge_violations == []
    assert report.parked == []  # a denial or an outage is retried, never parked
    assert report.lost == []
    assert report.wrong_status == []
    assert report.phantom_runs == []
    assert report.stuck == []
    assert report.effect_errors == []
    assert report.dlq_missing == []
    assert report.uncertain_split == []


def test_short_chaos_run_loses_nothing_and_repeats_nothing(redis_url: str) -> None:
    try:
        report = harness.run(duration=45, rate=10, seed=3)
    except harness.Unavailable as exc:
        pytest.fail(f"the chaos run needs its own PostgreSQL and Valkey servers: {exc}")
    harness.print_report(report)
    assert report.runs_committed > 100
    assert report.faults.get("postgres_restarts") == 1
    assert report.faults.get("relay_kills", 0) + report.faults.get("worker_kills", 0) >= 5
    assert report.faults.get("send_streaks") == 1  # sends denied after 1,100 failed attempts
    assert report.faults.get("purges", 0) >= 3  # sent rows of finished runs purged meanwhile
    assert_nothing_lost_or_repeated(report)


def test_chaos_with_three_active_relays_sharing_partitions(redis_url: str) -> None:
    """Three relays, all active on 8 partitions, killed and restarted at random: partitions
    move at every kill and restart; the same checks hold."""
    try:
        report = harness.run(duration=40, rate=10, seed=5, relays=3, relay_partitions=8)
    except harness.Unavailable as exc:
        pytest.fail(f"the chaos run needs its own PostgreSQL and Valkey servers: {exc}")
    harness.print_report(report)
    assert report.runs_committed > 100
    assert report.faults.get("relay_kills", 0) >= 2
    assert_nothing_lost_or_repeated(report)
