"""The rescuer: every unfinished run has a live copy, checked rather than hoped for.

The relay that runs the singletons (the owner of partition 0) looks, every
``relay_rescue_interval_seconds`` (60 s), for unfinished runs whose message was sent and
that show no sign of life for longer than their queue's **window**
(:func:`sqla_outbox.lifecycle.rescue.candidates`), and sends them again through the outbox
(:func:`sqla_outbox.lifecycle.rescue.rescue`).

The window of a queue is how long SQS may legitimately keep a run's message without the
run moving: ``visibility timeout x maxReceiveCount + relay_rescue_margin_seconds`` (a message
received and lost by a crashing worker on every one of its receives comes back after each
visibility timeout until SQS redrives it), for the default queue 120 s x 7 + 120 s = 16
minutes (the margin, 120 s by default, covers clock differences, a worker's start-up and
a slow receive). A candidate is rescued when either:

* its message was sent longer ago than the queue's retention (``sqs_message_retention_
  seconds``): SQS has dropped it if nobody received it (``past-retention``); or
* its queue has no visible messages (nothing waits in line before it: the message is not
  simply queued behind a backlog) and a live worker consumes its queue and implements its
  task (someone would have received it) (``no-live-copy``).

Otherwise it waits: a backlog in SQS, or no worker for it (the relay holds such runs
anyway). A queue whose depth cannot be read counts as not empty.

Each rescue is logged (``relay.rescued``, per run, WARNING: a run without a live copy is a
fault somewhere), counted (``sqla_outbox_runs_rescued_total{queue, reason}``), and shown
by ``python -m sqla_outbox status``.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable

from sqlalchemy.engine import Connection

from sqla_outbox import metrics, presence
from sqla_outbox.config import OutboxSettings
from sqla_outbox.lifecycle import rescue
from sqla_outbox.logging import log_extra
from sqla_outbox.queues import QueueRegistry

logger = logging.getLogger("sqla_outbox.relay")

BATCH = 500
"""Most runs looked at and rescued per round."""


def windows(queues: QueueRegistry, settings: OutboxSettings) -> dict[str, float]:
    """Queue → window, seconds: ``visibility timeout x maxReceiveCount +
    relay_rescue_margin_seconds`` as deployed."""
    out = {}
    for queue in queues:
        deployed = queues.deployed(queue.name, settings)
        out[queue.name] = (
            deployed.visibility_timeout_seconds * deployed.max_receive_count
            + settings.relay_rescue_margin_seconds
        )
    return out


@dataclasses.dataclass(frozen=True)
class RescueRound:
    """What one round did.

    Attributes:
        candidates: Runs silent past their window.
        rescued: Runs sent again.
        waiting: Candidates left alone (a backlog in their queue, no worker for them).
    """

    candidates: int
    rescued: int
    waiting: int


class Rescuer:
    """The rescuer's schedule and its decisions (see the module docstring).

    Args:
        settings: ``relay_rescue_interval_seconds``, the queues' deployment settings.
        queues: The relay's queue registry.
        name: The relay's name, recorded as who rescued.
        clock: Monotonic seconds (tests pass their own).
    """

    def __init__(
        self,
        settings: OutboxSettings,
        queues: QueueRegistry,
        *,
        name: str,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.settings = settings
        self.name = name
        self.windows = windows(queues, settings)
        self.interval = settings.relay_rescue_interval_seconds
        self._clock = clock
        self._next = clock() + min(self.interval, 10.0)  # a first look soon after start
        self.rescued_total = 0

    def due(self) -> bool:
        """Whether a round is due (never when ``relay_rescue_interval_seconds`` is 0)."""
        return self.interval > 0 and self._clock() >= self._next

    def seconds_until_due(self) -> float | None:
        """Until the next round (None when off)."""
        return None if self.interval <= 0 else max(0.0, self._next - self._clock())

    def round(
        self,
        connection: Connection,
        *,
        coverage: presence.Coverage,
        visible: Callable[[str], int | None],
    ) -> RescueRound:
        """Look once and rescue what the rules allow; commits.

        Args:
            connection: The relay's connection (a transaction of its own).
            coverage: The live workers (who would have received a message).
            visible: Queue → visible messages in SQS, None when it cannot be read.
        """
        self._next = self._clock() + self.interval
        found = rescue.candidates(
            connection,
            windows=self.windows,
            retention_seconds=self.settings.sqs_message_retention_seconds,
            limit=BATCH,
        )
        connection.commit()
        if not found:
            return RescueRound(0, 0, 0)
        depth: dict[str, int | None] = {}
        chosen: list[tuple[rescue.Candidate, str]] = []
        for run in found:
            if run.past_retention:
                chosen.append((run, "past-retention"))
                continue
            if run.queue not in depth:
                depth[run.queue] = visible(run.queue)
            served = coverage.workers > 0 and coverage.serves(run.task, run.queue)
            if depth[run.queue] == 0 and served:
                chosen.append((run, "no-live-copy"))
        done = rescue.rescue(connection, [(run.run_id, why) for run, why in chosen], by=self.name)
        connection.commit()
        for run, why in chosen:
            if run.run_id not in done:
                continue
            metrics.RUNS_RESCUED.labels(run.queue, why).inc()
            logger.warning(
                "run without a live copy sent again through the outbox",
                extra=log_extra(
                    action="relay.rescued",
                    run_id=str(run.run_id),
                    task=run.task,
                    queue=run.queue,
                    tenant_id=run.tenant_id,
                    status=run.status,
                    reason=why,
                    silent_s=round(run.silent_seconds, 1),
                ),
            )
        self.rescued_total += len(done)
        return RescueRound(len(found), len(done), len(found) - len(done))
