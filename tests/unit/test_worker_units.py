"""Pure worker logic: slot sharing between queues, the 12-hour visibility ceiling, task registration."""

from __future__ import annotations

import asyncio
import json
import uuid

import pytest

from sqla_outbox import errors
from sqla_outbox.config import OutboxSettings
from sqla_outbox.lifecycle import retry
from sqla_outbox.worker.consumer import visibility_ends_by
from sqla_outbox.worker.flight import InFlight
from sqla_outbox.worker.receive import SlotPool
from sqla_outbox.worker.registry import Registry, RetryPolicy


def test_slots_never_exceed_capacity_and_critical_is_served_first_without_starving_others() -> None:
    """Four backed-up queues, two slots: receivers wait while handlers hold the slots."""

    async def scenario() -> list[str]:
        pool = SlotPool(2)
        grants: list[str] = []
        held: list[asyncio.Task[None]] = []
        peak = 0

        async def handler(count: int) -> None:
            nonlocal peak
            peak = max(peak, pool.busy)
            await asyncio.sleep(0.001)
            pool.release(count)

        async def receiver(queue: str) -> None:
            while len(grants) < 150:
                got = await pool.acquire(queue, 1)
                grants.append(queue)
                held.append(asyncio.create_task(handler(got)))

        tasks = [asyncio.create_task(receiver(q)) for q in ("bulk", "critical", "default", "maintenance")]
        await asyncio.wait_for(asyncio.gather(*tasks), 10)
        assert peak <= 2
        return grants

    grants = asyncio.run(scenario())
    counts = {q: grants.count(q) for q in ("critical", "default", "bulk", "maintenance")}
    assert counts["critical"] > counts["default"] > counts["bulk"] > counts["maintenance"] >= 5, counts
    assert counts["critical"] >= 0.4 * len(grants)  # about 8 of every 15


def test_acquire_grants_at_most_what_is_free() -> None:
    async def scenario() -> tuple[int, int]:
        pool = SlotPool(3)
        first = await pool.acquire("default", 10)
        return first, pool.free

    assert asyncio.run(scenario()) == (3, 0)


def test_cancelled_waiter_gives_its_grant_back() -> None:
    async def scenario() -> int:
        pool = SlotPool(1)
        await pool.acquire("default", 1)
        waiter = asyncio.ensure_future(pool.acquire("critical", 1))
        await asyncio.sleep(0)
        waiter.cancel()
        await asyncio.gather(waiter, return_exceptions=True)
        pool.release(1)
        return pool.free

    assert asyncio.run(scenario()) == 1


def test_a_message_is_hidden_at_most_12_hours_after_its_first_receive() -> None:
    """SQS keeps a message hidden at most 12 hours after its first receive; the retry's
    ceiling is what is left of it."""
    now = 1000.0
    # first received 43,000 s ago (SQS epoch milliseconds): 200 s left, less a minute of margin
    ends_by = visibility_ends_by(str((1_800_000_000 - 43_000) * 1000), now=now, wall=1_800_000_000)
    flight = InFlight("default", "m", "h", 3, "{}", {}, visibility_ends_by=ends_by)
    assert flight.hideable_seconds(43_200, now=now) == pytest.approx(140)
    assert flight.hideable_seconds(30, now=now) == 30
    assert flight.hideable_seconds(43_200, now=now + 500) == 0
    assert retry.backoff_bounds(
        20, retry.RetryRules(5, 60, 43_200), ceiling=flight.hideable_seconds(43_200, now=now)
    )[1] == pytest.approx(140)


@pytest.mark.parametrize("stamp", [None, "", "soon", "-5", str(10**20)])
def test_an_implausible_first_receive_timestamp_counts_as_this_receive(stamp: str | None) -> None:
    ends_by = visibility_ends_by(stamp, now=50.0, wall=1_800_000_000)
    assert 50.0 <= ends_by <= 50.0 + 43_200
    if stamp in (None, "", "soon", str(10**20)):
        assert ends_by == 50.0 + 43_200


def test_registry_builds_the_catalog_from_decorators() -> None:
    registry = Registry()

    @registry.task("send", queue="critical", scope="tenant", subscribes=["order.placed"], timeout_seconds=10)
    def send(payload: dict) -> None: ...

    @registry.task("stock", subscribes=["order.placed"])
    async def stock(payload: dict, ctx: object) -> None: ...

    catalog = registry.catalog()
    assert catalog.task("send").queue == "critical"
    assert catalog.task("send").timeout_seconds == 10
    assert catalog.subscribers("order.placed") == ("send", "stock")
    assert registry.get("stock").is_async and registry.get("stock").takes_context
    assert not registry.get("send").takes_context
    with pytest.raises(errors.HandlerNotFound):
        registry.get("ghost")


def test_registry_refuses_bad_options() -> None:
    registry = Registry()
    with pytest.raises(errors.ConfigurationError, match="unknown queue"):
        registry.task("x", queue="urgent")
    with pytest.raises(errors.ConfigurationError):
        RetryPolicy(max_receives=0)

    @registry.task("x")
    def one(payload: dict) -> None: ...

    with pytest.raises(errors.ConfigurationError, match="already registered"):

        @registry.task("x")
        def two(payload: dict) -> None: ...


def test_bad_names_and_schedules_are_refused_when_the_module_is_imported() -> None:
    registry = Registry()
    with pytest.raises(errors.ConfigurationError, match="'bad name!'"):

        @registry.task("bad name!")
        def named(payload: dict) -> None: ...

    with pytest.raises(errors.ConfigurationError, match=r"'nightly'.*cron"):

        @registry.task("nightly", queue="maintenance", scope="platform", schedule={"cron": "61 * * * *"})
        def nightly(payload: dict) -> None: ...

    with pytest.raises(errors.ConfigurationError, match="'listener'"):

        @registry.task("listener", subscribes=["order placed"])
        def listener(payload: dict) -> None: ...

    assert registry.tasks == {}


def test_no_limit_timeout_is_written_to_the_catalog_as_zero() -> None:
    registry = Registry()

    @registry.task("forever", timeout_seconds=0)
    def forever(payload: dict) -> None: ...

    assert registry.get("forever").effective_timeout() is None
    assert registry.catalog().task("forever").timeout_seconds == 0
    assert json.loads(registry.catalog().to_json())["tasks"]["forever"]["timeout_seconds"] == 0


def test_preflight_refuses_a_worker_without_handlers_and_warns_of_dead_lettering() -> None:
    from sqla_outbox.config import OutboxSettings

    settings = OutboxSettings()
    builtins_only = Registry()
    builtins_only.task("maintenance.purge", queue="maintenance", scope="platform")(lambda payload: None)
    with pytest.raises(errors.ConfigurationError, match="no task handlers are registered"):
        builtins_only.preflight(settings, queues=("critical", "default"))
    assert builtins_only.preflight(settings, queues=("maintenance",)) == []

    registry = Registry()
    registry.task("send", queue="critical")(lambda payload: None)
    warnings = registry.preflight(settings, queues=("critical", "bulk"))
    assert warnings == [
        "no registered task uses queue 'bulk': this worker would hand its messages back to the outbox"
    ]
    # against the max_receive_count setting these are warnings: the worker refuses the
    # conflict at start against each queue's actual RedrivePolicy, which may differ
    [warning] = registry.preflight(settings.replace(worker_max_receives=7), queues=("critical",))
    assert warning.startswith("worker_max_receives (7) is not below max_receive_count (7)")

    registry.task("patient", retry=RetryPolicy(max_receives=10))(lambda payload: None)
    [warning] = registry.preflight(settings, queues=("critical", "default"))
    assert warning.startswith(
        "task 'patient': RetryPolicy(max_receives=10) is not below max_receive_count (7)"
    )
    assert registry.preflight(settings.replace(max_receive_count=11), queues=("critical", "default")) == []


def test_a_worker_on_the_default_queues_does_not_warn_of_the_ones_its_tasks_leave_unused() -> None:
    """The documented worker command consumes the default four queues; an application
    whose tasks use one of them is not warned about the other three (a queue the operator
    named is still warned about)."""
    from sqla_outbox.config import OutboxSettings

    defaults = OutboxSettings()
    chosen = defaults.replace(worker_queues=("default", "bulk"))
    assert (defaults.worker_queues_chosen, chosen.worker_queues_chosen) == (False, True)
    assert (
        defaults.replace(worker_queues=tuple(reversed(defaults.worker_queues))).worker_queues_chosen is False
    )
    registry = Registry.with_builtins()
    registry.task("send_welcome", queue="default")(lambda payload: None)
    assert registry.unserved_queues(defaults.worker_queues) == ["critical", "bulk"]
    assert registry.preflight(defaults, queues=defaults.worker_queues, queues_chosen=False) == []
    assert registry.preflight(chosen, queues=chosen.worker_queues, queues_chosen=True) == [
        "no registered task uses queue 'bulk': this worker would hand its messages back to the outbox"
    ]
    # a queue nobody declared is refused at start: no warning before that error contradicts it
    assert registry.preflight(chosen, queues=("default", "nope"), queues_chosen=True) == []


@pytest.mark.parametrize("delay", ["30", None, True, -1, 43_201, float("nan")])
def test_retry_with_a_bad_delay_says_what_is_wrong(delay: object) -> None:
    with pytest.raises(errors.ConfigurationError, match=r"Retry\.delay_seconds"):
        errors.Retry(delay)  # type: ignore[arg-type]


def test_handler_signature_and_schedule_type_are_checked_at_import() -> None:
    registry = Registry()
    with pytest.raises(errors.ConfigurationError, match=r"must take \(payload\) or \(payload, ctx\)"):

        @registry.task("three")
        def three(payload: dict, ctx: object, extra: object) -> None: ...

    with pytest.raises(errors.ConfigurationError, match="must take"):

        @registry.task("none")
        def none() -> None: ...

    with pytest.raises(errors.ConfigurationError, match="must take"):

        @registry.task("keyword")
        def keyword(payload: dict, *, flag: bool) -> None: ...

    with pytest.raises(errors.ConfigurationError, match="schedule must be a mapping"):
        registry.task("nightly", schedule="0 3 * * *")  # type: ignore[arg-type]

    @registry.task("defaults")
    def defaults(payload: dict, ctx: object = None, retries: int = 3) -> None: ...

    @registry.task("star")
    def star(*args: object) -> None: ...

    assert set(registry.tasks) == {"defaults", "star"}
    assert registry.get("defaults").takes_context and not registry.get("star").takes_context


def test_preflight_refuses_async_handlers_without_greenlet(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    from sqla_outbox.config import OutboxSettings

    registry = Registry()

    @registry.task("index")
    async def index(payload: dict) -> None: ...

    assert registry.preflight(OutboxSettings(), queues=("default",)) == []
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "greenlet" else real_find_spec(name, *a)
    )
    with pytest.raises(errors.ConfigurationError, match=r"async handlers \(index\) need greenlet"):
        registry.preflight(OutboxSettings(), queues=("default",))


def test_one_tenants_webhook_deliveries_hold_at_most_their_share_of_the_slots() -> None:
    """worker_concurrency 4 x webhook_tenant_slot_share 0.5: two deliveries per tenant at
    once; a third waits (deferred as tenant-share), another tenant's are admitted."""
    from sqla_outbox.worker import gate as gate_module
    from sqla_outbox.worker.limits import TaskLimits

    settings = OutboxSettings(valkey_url=None, worker_concurrency=4, webhook_tenant_slot_share=0.5)
    gate = gate_module.Gate(settings, breakers={}, worker_id="w")
    task, none = "webhooks.deliver", TaskLimits()
    assert gate.counts_shares(task) and not gate.counts_shares("send_welcome")
    first, second = (gate.admit(task, none, uuid.uuid4(), 1) for _ in range(2))
    assert first.admission is not None and second.admission is not None
    third = gate.admit(task, none, uuid.uuid4(), 1)
    assert (third.admission, third.reason, third.wait_seconds) == (None, "tenant-share", None)
    other = gate.admit(task, none, uuid.uuid4(), 2)
    assert other.admission is not None
    gate.release(first.admission, "success")
    again = gate.admit(task, none, uuid.uuid4(), 1)
    assert again.admission is not None
    # a share of 1 (or one slot per tenant anyway) counts nothing
    whole = gate_module.Gate(settings.replace(webhook_tenant_slot_share=1.0), breakers={}, worker_id="w")
    assert not whole.counts_shares(task)
    tiny = gate_module.Gate(settings.replace(webhook_tenant_slot_share=0.1), breakers={}, worker_id="w")
    assert tiny.tenant_slots == 1
