"""The run states, who may move a run from one to another, and by which function.

A run (one ``task_runs`` row, one ``run_id``) is always in one of six states. Three are
*unfinished* (the partial unique indexes on the idempotency key count them, and every
unfinished run must have a live copy somewhere: a pending outbox row, a live lease, or a
message SQS still holds); three are *finished* (only an operator's requeue moves a
``failed`` run back).

``queued``
    Written at dispatch, in the application's transaction, together with the run's
    outbox row. The relay sends the row when it is due; a worker that receives the
    message takes the run's lease. A worker that stops gracefully, or defers the run
    (a pause, a flow-control refusal, no handler here), puts a run it leased back here.
``running``
    A worker holds the run's lease (``lease_owner``, ``lease_expires_at``, renewed by its
    heartbeat) and runs attempt ``attempts``. Another worker may take the run over only
    once the lease has expired (the first worker vanished).
``retrying``
    The last attempt failed transiently; the run's message (or its outbox row) comes
    back after the backoff and the next attempt takes the lease again.
``succeeded``
    The handler returned; its database effects committed with this state (and its
    ``result``). Finished.
``failed``
    The handler failed for good (a permanent error, the retries or receives exhausted) or
    SQS refused the message for good (the relay parked it). Finished; the run's message is
    in the DLQ once ``dead_lettered_at`` is set. An operator's requeue makes it ``queued``.
``cancelled``
    A committed ``Cancel`` ended it (before it ran, or by stopping the running attempt).
    Finished; its handler never runs again.

:data:`TRANSITIONS` declares every move, the actor that makes it and the function of
:mod:`sqla_outbox.lifecycle` that runs the statement. ``tests/unit/test_lifecycle_rules.py``
reads every ``UPDATE task_runs`` statement of this package and fails when one moves a run
between states that no declared transition names (or when a declaration names a move no
statement makes), and fails when any module outside this package writes ``task_runs``,
``task_run_trail`` or an outbox row after the row was created. ``docs/lifecycle.md`` is
generated from this table (:func:`reference_markdown`).
"""

from __future__ import annotations

import dataclasses
import enum

from sqla_outbox.types import FINISHED_STATUSES, RUN_STATUSES, UNFINISHED_STATUSES, RunStatus

__all__ = [
    "FINISHED_STATUSES",
    "RUN_STATUSES",
    "STATE_DOCS",
    "TRANSITIONS",
    "UNFINISHED_STATUSES",
    "Actor",
    "RunStatus",
    "Transition",
    "declared",
    "reference_markdown",
]


class Actor(enum.StrEnum):
    """Who moves a run.

    ``worker``: ``python -m sqla_outbox.worker`` (and the inline test runner, which runs the
    worker's statements). ``relay``: ``python -m sqla_outbox.relay``. ``application``: a
    ``Cancel`` or ``Reschedule`` added to the application's own session. ``operator``: the
    CLI (``dlq requeue``, ``outbox unpark|resend``, ``runs cancel``) and the dashboard.
    """

    WORKER = "worker"
    RELAY = "relay"
    APPLICATION = "application"
    OPERATOR = "operator"


@dataclasses.dataclass(frozen=True)
class Transition:
    """One declared move of a run between two states.

    Attributes:
        source: The status the statement's guard requires (``status = ...``).
        target: The status it sets.
        actors: Who makes the move.
        function: The :mod:`sqla_outbox.lifecycle` function that runs the statement,
            ``module.function`` relative to the package.
        when: One sentence for the docs.
    """

    source: str
    target: str
    actors: tuple[Actor, ...]
    function: str
    when: str


_W, _R, _A, _O = Actor.WORKER, Actor.RELAY, Actor.APPLICATION, Actor.OPERATOR

TRANSITIONS: tuple[Transition, ...] = (
    Transition("queued", "running", (_W,), "attempts.take_lease", "a worker takes the lease for an attempt"),
    Transition(
        "retrying", "running", (_W,), "attempts.take_lease", "the next attempt after a transient failure"
    ),
    Transition(
        "running",
        "running",
        (_W,),
        "attempts.take_lease",
        "another worker takes over a run whose lease expired (its worker vanished)",
    ),
    Transition("running", "succeeded", (_W,), "attempts.mark_succeeded", "the handler returned"),
    Transition("running", "retrying", (_W,), "attempts.mark_retrying", "the attempt failed transiently"),
    Transition(
        "running",
        "failed",
        (_W,),
        "attempts.mark_failed",
        "a permanent error, or the retries or receives are exhausted",
    ),
    Transition(
        "running",
        "queued",
        (_W,),
        "attempts.mark_requeued",
        "a stopping worker gives the run back (the attempt is not finished)",
    ),
    Transition(
        "running",
        "queued",
        (_W,),
        "deferral.defer_run",
        "a worker that took the lease defers the run to the outbox (the attempt is not counted)",
    ),
    Transition(
        "running",
        "cancelled",
        (_W,),
        "attempts.mark_cancelled",
        "the running attempt stopped for a committed Cancel",
    ),
    Transition(
        "running",
        "cancelled",
        (_W,),
        "attempts.take_lease",
        "a Cancel asked a running run to stop and its worker vanished",
    ),
    Transition(
        "queued", "failed", (_R,), "sending.park", "SQS refused the message for good (the row is parked)"
    ),
    Transition(
        "running",
        "queued",
        (_R, _O),
        "rescue.rescue",
        "the rescuer sends again a run whose lease expired and whose message is gone",
    ),
    Transition("queued", "cancelled", (_A, _O), "controls.cancel_statement", "a committed Cancel"),
    Transition("retrying", "cancelled", (_A, _O), "controls.cancel_statement", "a committed Cancel"),
    Transition(
        "failed",
        "queued",
        (_O,),
        "operator.run_to_queued",
        "an operator requeues a failed run (from the DLQ, or unparks its outbox row)",
    ),
)
"""Every move of a run between states; see the module docstring."""

STATE_DOCS: dict[str, str] = {
    "queued": "Dispatched (or given back); its outbox row is pending or its message is in SQS.",
    "running": "A worker holds the lease and runs an attempt; the heartbeat renews the lease.",
    "retrying": "The last attempt failed transiently; the next one comes after the backoff.",
    "succeeded": "The handler returned; its database effects committed with this state. Finished.",
    "failed": "Failed for good (permanent error, retries exhausted, refused by SQS). Finished; "
    "an operator's requeue makes it queued again.",
    "cancelled": "A committed Cancel ended it. Finished; the handler never runs again.",
}
"""One line per state, for the docs."""

assert set(STATE_DOCS) == set(RUN_STATUSES)


def declared(source: str, target: str) -> tuple[Transition, ...]:
    """The declared transitions from ``source`` to ``target`` (empty when none is)."""
    return tuple(t for t in TRANSITIONS if t.source == source and t.target == target)


def reference_markdown() -> str:
    """``docs/lifecycle.md``'s generated part: the states and the transition table.

    ``tests/unit/test_lifecycle_rules.py`` fails when the page's copy is stale.
    """
    lines = [
        "<!-- generated by sqla_outbox.lifecycle.states.reference_markdown(); "
        "tests fail when it is stale -->",
        "",
        "| state | unfinished | meaning |",
        "|---|---|---|",
    ]
    for status in RUN_STATUSES:
        lines.append(
            f"| `{status}` | {'yes' if status in UNFINISHED_STATUSES else 'no'} | {STATE_DOCS[status]} |"
        )
    lines += ["", "| from | to | who | statement | when |", "|---|---|---|---|---|"]
    for t in TRANSITIONS:
        who = ", ".join(a.value for a in t.actors)
        lines.append(f"| `{t.source}` | `{t.target}` | {who} | `lifecycle.{t.function}` | {t.when} |")
    lines.append("<!-- end of generated part -->")
    return "\n".join(lines) + "\n"
