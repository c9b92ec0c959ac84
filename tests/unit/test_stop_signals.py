"""``cli.options.StopSignals``: in this process, with real signals (the handlers are put back)."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator

import pytest

from sqla_outbox.cli.options import Abandon, StopSignals


@pytest.fixture
def restored() -> Iterator[None]:
    saved = {signum: signal.getsignal(signum) for signum in (signal.SIGTERM, signal.SIGINT)}
    yield
    for signum, handler in saved.items():
        signal.signal(signum, handler)


def test_a_signal_before_attach_stops_the_service_when_it_attaches(restored: None) -> None:
    stops: list[str] = []
    signals = StopSignals()
    os.kill(os.getpid(), signal.SIGTERM)  # during start-up: kept, the process lives on
    assert signals.requested.is_set()
    signals.attach(lambda: stops.append("stop"))
    assert stops == ["stop"]


def test_after_attach_the_first_signal_stops_and_the_second_abandons(restored: None) -> None:
    stops: list[str] = []
    signals = StopSignals()
    signals.attach(lambda: stops.append("stop"))
    assert stops == []
    os.kill(os.getpid(), signal.SIGINT)
    assert stops == ["stop"] and signals.requested.is_set()
    with pytest.raises(Abandon):
        os.kill(os.getpid(), signal.SIGTERM)
    assert stops == ["stop"]
