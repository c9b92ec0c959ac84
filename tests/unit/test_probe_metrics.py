"""The probe's ``/metrics``: each process serves its own families, over real HTTP."""

from __future__ import annotations

import urllib.request

import pytest
from prometheus_client import Counter

from sqla_outbox import metrics
from sqla_outbox.health import ProbeServer

_HANDLER_METRIC = Counter("probe_test_handler_calls", "A handler's own metric, in the default registry.")


def _scrape(roles: tuple[str, ...]) -> str:
    probe = ProbeServer(0, ready=lambda: True, host="127.0.0.1", roles=roles)
    probe.start()
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{probe.port}/metrics", timeout=5) as response:
            return response.read().decode()
    finally:
        probe.stop()


def test_a_worker_shows_no_relay_gauges_and_a_relay_no_worker_ones() -> None:
    metrics.IN_FLIGHT.set(2)
    metrics.RELAY_LEADER.set(1)
    _HANDLER_METRIC.inc()
    worker = _scrape(("worker",))
    assert "sqla_outbox_worker_in_flight 2.0" in worker
    assert "sqla_outbox_relay_leader" not in worker
    assert "sqla_outbox_relay_partitions_owned" not in worker
    assert "probe_test_handler_calls_total 1.0" in worker  # the application's own metrics stay
    relay = _scrape(("relay",))
    assert "sqla_outbox_relay_leader 1.0" in relay
    assert "sqla_outbox_worker_in_flight" not in relay
    both = _scrape(("worker", "relay"))  # a worker with worker_run_relay
    assert "sqla_outbox_relay_leader 1.0" in both and "sqla_outbox_worker_in_flight 2.0" in both
    metrics.IN_FLIGHT.set(0)
    metrics.RELAY_LEADER.set(0)


def test_an_unknown_role_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown metrics roles"):
        metrics.served(["dashboard"])
