"""The admission gate (rate limits, concurrency slots, circuit breakers) against a real Valkey.

Two :class:`Gate` objects stand for two worker processes sharing one Valkey; the e2e
tests (``tests/e2e/test_limits_process.py``) run the same through real worker processes.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator

import pytest

from sqla_outbox import metrics
from sqla_outbox.config import OutboxSettings
from sqla_outbox.logging import _EXTRA_KEY
from sqla_outbox.worker.gate import Gate, key_prefix
from sqla_outbox.worker.limits import Breaker, RateLimit, TaskLimits
from tests.support import closed_port_url, private_valkey, wait_for

BREAKER = Breaker("payments-api", failures=3, open_seconds=1, successes=2)


def make_gate(redis_url: str | None, tag: str, *, lease: float = 15.0, name: str = "w1") -> Gate:
    settings = OutboxSettings(
        valkey_url=redis_url,
        queue_prefix=f"g{tag}-",
        limits_slot_lease_seconds=lease,
        limits_valkey_timeout_ms=200,
        limits_valkey_retry_seconds=0.2,
    )
    return Gate(settings, breakers={BREAKER.key: BREAKER}, worker_id=name)


@pytest.fixture
def tag() -> str:
    return uuid.uuid4().hex[:8]


@pytest.fixture
def gates(redis_url: str, tag: str) -> Iterator[tuple[Gate, Gate]]:
    one, two = make_gate(redis_url, tag, name="w1"), make_gate(redis_url, tag, name="w2")
    yield one, two
    one.close()
    two.close()


def admit(gate: Gate, limits: TaskLimits, task: str = "charge") -> object:
    return gate.admit(task, limits, uuid.uuid4())


def test_rate_limit_is_shared_and_refused_runs_are_spread(gates: tuple[Gate, Gate]) -> None:
    one, two = gates
    limits = TaskLimits(rate=RateLimit(4, 60))
    verdicts = [admit(gate, limits) for gate in (one, two, one, two, one, two, one)]
    admitted = [v for v in verdicts if v.admission is not None]  # type: ignore[attr-defined]
    refused = [v for v in verdicts if v.admission is None]  # type: ignore[attr-defined]
    assert len(admitted) == 4 and len(refused) == 3
    assert {v.reason for v in refused} == {"rate-limit"}  # type: ignore[attr-defined]
    waits = [v.wait_seconds for v in refused]  # type: ignore[attr-defined]
    # each refused run gets the next free moment, period/count (15 s) after the previous one
    assert 59 < waits[0] <= 60
    assert waits[1] - waits[0] == pytest.approx(15, abs=0.1)
    assert waits[2] - waits[1] == pytest.approx(15, abs=0.1)


def test_refund_gives_back_a_rate_admission(gates: tuple[Gate, Gate]) -> None:
    one, _ = gates
    limits = TaskLimits(rate=RateLimit(1, 60))
    first = admit(one, limits)
    assert first.admission is not None  # type: ignore[attr-defined]
    one.release(first.admission, "refund")  # type: ignore[attr-defined]
    assert admit(one, limits).admission is not None  # type: ignore[attr-defined]
    assert admit(one, limits).reason == "rate-limit"  # type: ignore[attr-defined]


def test_concurrency_slots_are_shared_and_released(gates: tuple[Gate, Gate]) -> None:
    one, two = gates
    limits = TaskLimits(concurrency=2)
    a, b = admit(one, limits), admit(two, limits)
    assert a.admission and b.admission  # type: ignore[attr-defined]
    refused = admit(one, limits)
    assert refused.reason == "concurrency" and refused.wait_seconds is None  # type: ignore[attr-defined]
    two.release(b.admission, "success")  # type: ignore[attr-defined]
    assert admit(one, limits).admission is not None  # type: ignore[attr-defined]


def test_a_slot_of_a_vanished_worker_frees_after_its_lease(redis_url: str, tag: str) -> None:
    dead, alive = make_gate(redis_url, tag, lease=1.0, name="dead"), make_gate(redis_url, tag, name="alive")
    limits = TaskLimits(concurrency=1)
    held = admit(dead, limits)
    assert held.admission is not None  # type: ignore[attr-defined]
    # the holder renews while it lives...
    for _ in range(4):
        time.sleep(0.4)
        dead.renew()
        assert admit(alive, limits).reason == "concurrency"  # type: ignore[attr-defined]
    # ...and once it stops (as after kill -9), the slot stops counting within the lease
    started = time.monotonic()
    wait_for(lambda: admit(alive, limits).admission is not None, timeout=3)  # type: ignore[attr-defined]
    assert time.monotonic() - started <= 1.5


def test_breaker_opens_half_opens_and_closes_across_workers(gates: tuple[Gate, Gate]) -> None:
    one, two = gates
    limits = TaskLimits(breaker=BREAKER)
    before = metrics.BREAKER_TRANSITIONS.labels(BREAKER.key, "closed", "open")._value.get()
    for gate in (one, two, one):  # three failures in a row, from two workers
        verdict = admit(gate, limits)
        gate.release(verdict.admission, "failure")  # type: ignore[attr-defined]
    assert metrics.BREAKER_TRANSITIONS.labels(BREAKER.key, "closed", "open")._value.get() == before + 1
    refused = admit(two, limits)
    assert refused.reason == "breaker-open"  # type: ignore[attr-defined]
    assert 0.5 < refused.wait_seconds <= 1.0  # type: ignore[attr-defined]
    time.sleep(refused.wait_seconds + 0.05)  # type: ignore[attr-defined]
    # half-open: two probes at a time, the third waits
    probes = [admit(two, limits), admit(one, limits)]
    assert all(p.admission for p in probes)  # type: ignore[attr-defined]
    assert admit(one, limits).reason == "breaker-probing"  # type: ignore[attr-defined]
    assert metrics.BREAKER_STATE.labels(BREAKER.key)._value.get() == 1
    two.release(probes[0].admission, "success")  # type: ignore[attr-defined]
    one.release(probes[1].admission, "success")  # type: ignore[attr-defined]
    assert metrics.BREAKER_STATE.labels(BREAKER.key)._value.get() == 0
    # closed again: everything passes
    assert all(admit(g, limits).admission for g in (one, two, one))  # type: ignore[attr-defined]


def test_a_failed_probe_opens_it_again_and_neutral_outcomes_do_not_count(gates: tuple[Gate, Gate]) -> None:
    one, _ = gates
    limits = TaskLimits(breaker=BREAKER)
    for _ in range(5):  # permanent errors (bad input) are neutral: never open it
        one.release(admit(one, limits).admission, "neutral")  # type: ignore[attr-defined]
    for _ in range(3):
        one.release(admit(one, limits).admission, "failure")  # type: ignore[attr-defined]
    time.sleep(1.05)
    probe = admit(one, limits)
    one.release(probe.admission, "failure")  # type: ignore[attr-defined]
    assert admit(one, limits).reason == "breaker-open"  # type: ignore[attr-defined]


def test_a_success_resets_the_failure_streak(gates: tuple[Gate, Gate]) -> None:
    one, _ = gates
    limits = TaskLimits(breaker=BREAKER)
    for outcome in ("failure", "failure", "success", "failure", "failure"):
        one.release(admit(one, limits).admission, outcome)  # type: ignore[attr-defined]
    assert admit(one, limits).admission is not None  # type: ignore[attr-defined]


@pytest.fixture(params=["valkey", "per-process"])
def breaker_gates(request: pytest.FixtureRequest, redis_url: str, tag: str) -> Iterator[tuple[Gate, Gate]]:
    """Two gates sharing a breaker through Valkey, or one gate on a Valkey that refuses
    connections (its per-process breaker, twice: a local breaker is one process's own)."""
    if request.param == "valkey":
        one, two = make_gate(redis_url, tag, name="w1"), make_gate(redis_url, tag, name="w2")
    else:
        one = make_gate(closed_port_url(), tag)
        two = one
    yield one, two
    one.close()
    two.close()


def _open(gate: Gate, limits: TaskLimits) -> None:
    for _ in range(BREAKER.failures):
        gate.release(admit(gate, limits).admission, "failure")  # type: ignore[attr-defined]
    assert admit(gate, limits).reason == "breaker-open"  # type: ignore[attr-defined]


def test_only_probes_close_a_half_open_breaker(breaker_gates: tuple[Gate, Gate]) -> None:
    """Two runs admitted while the breaker was closed end with successes during half-open,
    while its one probe still runs: the breaker stays half-open (they do not close it), the
    probe's failure opens it again, and the runs waiting are refused, not let through."""
    one, two = breaker_gates
    limits = TaskLimits(breaker=BREAKER)
    early = [admit(one, limits), admit(two, limits)]  # closed: admitted, still running
    _open(one, limits)
    time.sleep(1.05)
    probe = admit(two, limits)
    assert probe.admission is not None and probe.admission.probe  # type: ignore[attr-defined]
    for gate, run in zip((one, two), early, strict=True):
        released = gate.release(run.admission, "success")  # type: ignore[attr-defined]
        assert (released.state, released.counted, released.transition) == ("half_open", False, "")
    failed = two.release(probe.admission, "failure")  # type: ignore[attr-defined]
    assert (failed.state, failed.counted, failed.transition) == ("open", True, "half_open>open")
    assert [admit(g, limits).reason for g in (one, two, one, two)] == ["breaker-open"] * 4  # type: ignore[attr-defined]


def test_runs_admitted_before_the_open_neither_reopen_nor_extend_it(breaker_gates: tuple[Gate, Gate]) -> None:
    """Failures of runs admitted while closed that end after the breaker opened, or while
    it probes, count for nothing: the open period is not extended, a probe is not cut short."""
    one, two = breaker_gates
    limits = TaskLimits(breaker=BREAKER)
    early = [admit(one, limits) for _ in range(2)]
    _open(one, limits)
    late = one.release(early[0].admission, "failure")  # type: ignore[attr-defined]
    assert (late.state, late.counted) == ("open", False)
    assert 0.5 < late.admits_in_seconds <= 1.0 and late.outage_seconds is not None
    time.sleep(1.05)
    probes = [admit(two, limits), admit(one, limits)]
    stale = one.release(early[1].admission, "failure")  # type: ignore[attr-defined]
    assert (stale.state, stale.counted) == ("half_open", False)
    for gate, probe in zip((two, one), probes, strict=True):
        gate.release(probe.admission, "success")  # type: ignore[attr-defined]
    assert admit(one, limits).admission is not None  # type: ignore[attr-defined]  # closed by its probes


def test_a_probe_of_an_earlier_half_open_period_counts_for_nothing(breaker_gates: tuple[Gate, Gate]) -> None:
    one, two = breaker_gates
    limits = TaskLimits(breaker=BREAKER)
    _open(one, limits)
    time.sleep(1.05)
    slow_probe, failing_probe = admit(one, limits), admit(two, limits)
    two.release(failing_probe.admission, "failure")  # type: ignore[attr-defined]  # open again
    time.sleep(1.05)
    probe = admit(two, limits)
    assert probe.admission is not None  # type: ignore[attr-defined]
    late = one.release(slow_probe.admission, "success")  # type: ignore[attr-defined]
    assert (late.state, late.counted) == ("half_open", False)  # one success short of closing


def test_the_release_reports_the_outage_for_the_retry_rule(breaker_gates: tuple[Gate, Gate]) -> None:
    """What :func:`sqla_outbox.lifecycle.verdict.ride_out` reads: the failure that opens the
    breaker sees an outage of about 0 s and the wait until the probe; a failed probe sees
    the outage's age, counted from the first open; a closing success ends the outage."""
    one, two = breaker_gates
    limits = TaskLimits(breaker=BREAKER)
    for _ in range(BREAKER.failures - 1):
        assert one.release(admit(one, limits).admission, "failure").state == "closed"  # type: ignore[attr-defined]
    tripped = one.release(admit(one, limits).admission, "failure")  # type: ignore[attr-defined]
    assert (tripped.state, tripped.transition) == ("open", "closed>open")
    assert tripped.outage_seconds is not None and tripped.outage_seconds < 0.5
    assert 0.5 < tripped.admits_in_seconds <= 1.0
    time.sleep(1.05)
    reopened = two.release(admit(two, limits).admission, "failure")  # type: ignore[attr-defined]
    assert reopened.transition == "half_open>open"
    assert reopened.outage_seconds is not None and reopened.outage_seconds >= 1.0
    time.sleep(1.05)
    probes = [admit(one, limits), admit(one, limits)]
    closed = [one.release(p.admission, "success") for p in probes]  # type: ignore[attr-defined]
    assert (closed[-1].state, closed[-1].outage_seconds) == ("closed", None)
    tripped_again = one.release(admit(one, limits).admission, "failure")  # type: ignore[attr-defined]
    assert tripped_again.outage_seconds is None  # closed: one failure in a new streak


def test_valkey_refusing_connections_limits_per_process(tag: str, caplog: pytest.LogCaptureFixture) -> None:
    gate = make_gate(closed_port_url(), tag)
    limits = TaskLimits(rate=RateLimit(2, 60), concurrency=5)
    verdicts = [admit(gate, limits) for _ in range(3)]
    assert [v.admission is not None for v in verdicts] == [True, True, False]  # type: ignore[attr-defined]
    assert verdicts[2].reason == "rate-limit"  # type: ignore[attr-defined]
    assert not any(v.admission.shared for v in verdicts[:2])  # type: ignore[attr-defined]
    assert [r for r in caplog.records if getattr(r, _EXTRA_KEY, {}).get("action") == "limits.valkey_lost"]


def test_valkey_stopping_mid_run_falls_back_then_shares_again(tag: str) -> None:
    """A private Valkey stopped while runs hold slots: the gate limits per process, never
    raises, and uses the shared state again once a Valkey answers at that address."""
    with private_valkey() as url:
        gate = make_gate(url, tag)
        limits = TaskLimits(concurrency=2)
        shared = admit(gate, limits)
        assert shared.admission.shared  # type: ignore[attr-defined]
    # the server is gone: the held slot's release is lost (its lease ends it) ...
    gate.release(shared.admission, "success")  # type: ignore[attr-defined]
    local = [admit(gate, limits) for _ in range(3)]
    assert [v.admission is not None for v in local] == [True, True, False]  # type: ignore[attr-defined]
    assert not local[0].admission.shared  # type: ignore[attr-defined]
    gate.renew()  # nothing raises while Valkey is down
    gate.close()


def test_status_keys_live_under_the_queue_prefix(redis_url: str, tag: str) -> None:
    gate = make_gate(redis_url, tag)
    assert gate.prefix == key_prefix(gate.settings) == f"sqla_outbox:limits:g{tag}-"
    gate.close()


def test_snapshot_shows_declared_limits_and_live_state(gates: tuple[Gate, Gate]) -> None:
    from sqla_outbox.worker.gate import snapshot

    one, two = gates
    charge = TaskLimits(rate=RateLimit(10, 60), concurrency=3, breaker=BREAKER)
    one.publish({"charge": charge, "plain": TaskLimits()})
    held = [admit(one, charge), admit(two, charge)]
    for _ in range(3):
        verdict = admit(one, charge)
        one.release(verdict.admission, "failure")  # type: ignore[attr-defined]
    state = snapshot(one.settings)
    assert state is not None and state.error is None
    [task] = state.tasks
    assert (task.task, task.concurrency, task.running, task.rate_count, task.admitted_in_window) == (
        "charge",
        3,
        2,
        10,
        5,
    )
    [breaker] = state.breakers
    assert breaker.key == BREAKER.key and breaker.state == "open" and breaker.settings == BREAKER
    assert 0 < breaker.open_for_seconds <= 1
    for gate, verdict in zip((one, two), held, strict=True):
        gate.release(verdict.admission, "neutral")  # type: ignore[attr-defined]
    time.sleep(1.05)
    later = snapshot(one.settings)
    assert later is not None and later.tasks[0].running == 0 and later.breakers[0].state == "half_open"


def test_snapshot_without_valkey(tag: str) -> None:
    from sqla_outbox.worker.gate import snapshot

    assert snapshot(OutboxSettings(valkey_url=None)) is None
    down = snapshot(OutboxSettings(valkey_url=closed_port_url()))
    assert down is not None and down.error is not None and "ConnectionError" in down.error


def test_status_command_shows_limits_in_use_and_breaker_states(
    settings: OutboxSettings, sqs_endpoint: str
) -> None:
    """``python -m sqla_outbox status``: a table and ``--json`` with each limited task's
    slots in use and each breaker's state, read from the Valkey the workers share."""
    import json
    import subprocess
    import sys

    from tests.support import service_env

    slow = Breaker("payments-api", failures=3, open_seconds=600, max_outage_seconds=1200)
    gate = Gate(settings, breakers={slow.key: slow}, worker_id="w1")
    charge = TaskLimits(rate=RateLimit(10, 60), concurrency=3, breaker=slow)
    gate.publish({"charge": charge})
    held = admit(gate, charge)
    for _ in range(3):
        gate.release(admit(gate, charge).admission, "failure")  # type: ignore[attr-defined]
    env = service_env(settings, sqs_endpoint)

    def status(*args: str) -> str:
        done = subprocess.run(
            [sys.executable, "-m", "sqla_outbox", "status", "--no-sqs", *args],
            capture_output=True,
            text=True,
            env={**env, "COLUMNS": "200"},
            timeout=60,
        )
        assert done.returncode == 0, done.stderr
        return done.stdout

    document = json.loads(status("--json"))["flow_control"]
    assert document["error"] is None
    assert [
        (t["task"], t["running"], t["concurrency"], t["admitted_in_window"]) for t in document["tasks"]
    ] == [("charge", 1, 3, 4)]
    [breaker] = document["breakers"]
    assert (breaker["key"], breaker["state"], breaker["settings"]["failures"]) == ("payments-api", "open", 3)
    assert breaker["settings"]["max_outage_seconds"] == 1200 and 0 <= breaker["outage_seconds"] < 30
    human = status()
    assert "Circuit breakers" in human and "payments-api" in human and "open" in human
    assert "outages up to 20m" in human
    assert "Per-task limits" in human and "1 / 3" in human
    gate.release(held.admission, "neutral")  # type: ignore[attr-defined]
    gate.close()
