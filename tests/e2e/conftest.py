"""Fixtures the e2e modules share."""

from __future__ import annotations

from typing import Any

import pytest

from sqla_outbox.config import OutboxSettings
from tests.support import start_worker


@pytest.fixture
def worker_with_relay(settings: OutboxSettings, sqs_endpoint: str, queues: dict[str, str]):
    processes = []

    def start(**extra: str) -> Any:
        extra.setdefault("SQLA_OUTBOX_WORKER_RUN_RELAY", "true")
        process = start_worker(settings, sqs_endpoint, name=f"worker{len(processes)}", **extra)
        processes.append(process)
        process.wait_for_action("worker.started")
        return process

    yield start
    for process in processes:
        process.kill()
        print(f"--- {process.name} log (tail) ---\n" + "".join(process.raw[-60:]))  # shown on failure
