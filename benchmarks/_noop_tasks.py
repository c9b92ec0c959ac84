"""No-op handlers for the benchmark worker subprocesses (``--imports _noop_tasks``)."""

from __future__ import annotations

from typing import Any

from sqla_outbox.worker import task


@task("bench_noop", queue="default")
def bench_noop(payload: Any) -> None:
    """Does nothing: the benchmark measures the runtime around the handler."""


@task("bench_tenant", queue="default", scope="tenant")
def bench_tenant(payload: Any) -> None:
    """Does nothing (tenant-scoped twin of ``bench_noop``)."""
