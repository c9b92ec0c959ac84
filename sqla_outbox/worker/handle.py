"""Handling one received message, from untrusted body to final verdict.

1. **Authenticate** (when ``signing_keys`` is set): the body's HMAC signature must match;
   otherwise → DLQ with reason ``bad-signature``, never executed, nothing read from the
   database.
2. **Decode** the body (:func:`sqla_outbox.envelope.decode`: JSON only, size-bounded,
   every field checked). Malformed → DLQ with the reason, never executed. An envelope
   naming another queue than the one the message arrived on → DLQ as ``wrong-queue``
   (it would run under that queue's visibility timeout and concurrency).
3. **Paused** (its task, tenant or queue, :mod:`sqla_outbox.flow`; sent before the pause)
   or **no handler here** (a task only newer code implements, during a rolling deploy): the
   run is deferred to the outbox (:mod:`sqla_outbox.worker.deferral`): the message is
   deleted and the outbox sends a fresh one later, so no attempt, no receive budget and
   no DLQ is spent on it. A run that is not ours is dead-lettered as below.
   **Flow control** (a task with ``rate_limit``, ``concurrency`` or ``breaker``): the
   admission gate (:mod:`sqla_outbox.worker.gate`) decides first; a refused run is
   deferred through the outbox the same way (ADR 0014), and an admitted one gives its
   admission back when handling ends, with the outcome its breaker counts (a transient
   failure: before its verdict is applied, see 7). A webhook delivery also counts against
   its tenant's share of this worker's slots (``webhook_tenant_slot_share``); over it, it
   is deferred the same way (``tenant-share``).
4. **Take the run's lease** (:func:`sqla_outbox.lifecycle.attempts.take_lease`, in one transaction
   with the other messages of the same receive: :mod:`sqla_outbox.worker.leases`). No such run
   (foreign or forged message) or a run of another task/tenant/queue → DLQ, never
   executed. A finished run → the copy is acknowledged and skipped (a failed run whose
   DLQ send was interrupted gets it completed). A cancelled run (``Cancel`` committed
   after the relay sent it) → acknowledged, the handler never called. A live lease
   elsewhere → the copy is hidden until that lease would expire; it runs only if the
   other worker vanished. A run not due yet (``available_at`` ahead) → an early copy,
   hidden until the due time or, when that is more than a minute away and the relay
   still holds the run's own message, deleted (:func:`_early_copy`); the run's attempts
   are untouched.
5. **Check** the receive count (a message redelivered past ``max_receives`` without a
   verdict, e.g. after worker crashes, goes to the DLQ).
6. **Run** the handler with its timeout, heartbeat running (see ``heartbeat.py``). The
   handler's session commits together with ``running → succeeded``.
7. **Verdict**: success → delete; :class:`~sqla_outbox.errors.Retry` or another exception
   → ``retrying`` and ChangeMessageVisibility(backoff), or the permanent path on the
   last allowed receive (or attempt: a deferral restarts the receive count);
   :class:`~sqla_outbox.errors.PermanentError` or a type listed in ``@task(permanent=...)``
   → ``failed``, DLQ with the error context, delete; timeout → transient, cancellation
   signalled, slot freed. A transient failure that leaves the task's breaker open
   (it opened it, or a probe failed) is deferred through the outbox instead, the attempt
   not counted, while the outage is younger than the breaker's ``max_outage_seconds``
   (:func:`sqla_outbox.lifecycle.verdict.ride_out`). A cancel request (the heartbeat saw
   a committed ``Cancel``) → cancellation signalled, the handler's session discarded,
   run ``cancelled``, message deleted, slot freed; any verdict the attempt tries after a
   cancel was committed turns into ``cancelled`` too (:func:`_reconcile_lost`).

Database first, then SQS: if the worker dies in between, the copy that comes back finds
the run's state and finishes the job (acknowledges, or completes the DLQ send).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
import traceback as tb
from typing import Any

from sqla_outbox import envelope, errors, flow, metrics, tracing
from sqla_outbox.lifecycle import attempts, retry, verdict
from sqla_outbox.logging import log_extra, short_handle
from sqla_outbox.types import SQS_MAX_VISIBILITY_SECONDS
from sqla_outbox.worker import deferral, execute, gate
from sqla_outbox.worker.context import bounded_detail
from sqla_outbox.worker.flight import InFlight
from sqla_outbox.worker.outcome import utc_now_text
from sqla_outbox.worker.registry import TaskDefinition
from sqla_outbox.worker.runtime import Runtime

logger = logging.getLogger("sqla_outbox.worker")


class _TimedOut(Exception):
    """The attempt's own timeout fired (as opposed to a TimeoutError the handler raised)."""


class _StopRequested(Exception):
    """A committed ``Cancel`` asked the attempt to stop (the heartbeat signalled it)."""


CANCEL_UNWIND_SECONDS = 5.0
"""How long an async handler cancelled by a ``Cancel`` may take to unwind (its session
rolls back) before the worker records the run and moves on."""


async def _until_stopped(awaitable: Any, stop: asyncio.Event) -> Any:
    """Await ``awaitable`` unless ``stop`` is set first; then cancel it and raise
    :class:`_StopRequested` (a sync handler's thread keeps running, signalled through
    ``ctx.cancel_event``; whatever it does later is rolled back, as after a timeout)."""
    work = asyncio.ensure_future(awaitable)
    stopper = asyncio.ensure_future(stop.wait())
    try:
        done, _ = await asyncio.wait({work, stopper}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        work.cancel()
        stopper.cancel()
        raise
    stopper.cancel()
    if work in done:
        return work.result()
    work.cancel()
    await asyncio.wait({work}, timeout=CANCEL_UNWIND_SECONDS)
    if work.done() and not work.cancelled():
        work.exception()  # retrieved: an unwinding handler's error is not "never retrieved"
    raise _StopRequested


async def _with_timeout(awaitable: Any, timeout: float | None) -> Any:
    if not timeout:
        return await awaitable
    scope = asyncio.timeout(timeout)
    try:
        async with scope:
            return await awaitable
    except TimeoutError:
        if scope.expired():
            raise _TimedOut from None
        raise


async def handle_message(runtime: Runtime, flight: InFlight) -> None:
    """Take one message to a verdict (see the module docstring)."""
    keys = runtime.settings.signing_keys
    if keys:
        signature = flight.attributes.get(envelope.SIGNATURE_ATTRIBUTE, {}).get("StringValue")
        if not envelope.signature_valid(flight.body, signature, keys):
            await _dead_letter_foreign(
                runtime,
                flight,
                reason="bad-signature",
                detail="missing or invalid signature: not sent by our relay",
            )
            return
    try:
        env = envelope.decode(flight.body, max_bytes=runtime.settings.max_message_bytes)
    except envelope.MalformedEnvelope as exc:
        await _dead_letter_foreign(
            runtime, flight, reason=f"malformed-envelope:{exc.reason}", detail=str(exc)
        )
        return
    if env.queue != flight.queue:
        await _dead_letter_foreign(
            runtime,
            flight,
            reason="wrong-queue",
            detail=f"the envelope names queue {env.queue!r} but the message arrived on {flight.queue!r}",
        )
        return
    flight.run_id, flight.task_name, flight.tenant_id = env.run_id, env.task, env.tenant_id
    if runtime.pauses.stale:
        await runtime.io(runtime.in_transaction, runtime.pauses.refresh)
    paused = runtime.pauses.pauses.blocking(env.task, env.tenant_id, env.queue)
    if paused is not None:  # sent before the pause: back to the outbox, handler not called
        deferred = await deferral.defer_message(
            runtime,
            flight,
            env,
            reason="paused",
            delay_seconds=flow.PAUSE_HOLD_SECONDS,
            detail={"paused": str(paused)},
        )
        if deferred.claim is not None:
            await _settle_unclaimed(runtime, flight, deferred.claim, env)
        return
    definition = runtime.registry.tasks.get(env.task)
    if definition is None:  # e.g. old code during a rolling deploy: leave it to a worker that has it
        deferred = await deferral.defer_message(
            runtime, flight, env, reason="no-handler", delay_seconds=retry.no_handler_delay
        )
        if deferred.claim is not None:
            await _settle_unclaimed(runtime, flight, deferred.claim, env)
        return
    if definition.limits.any or runtime.gate.counts_shares(env.task):
        verdict = await runtime.io(runtime.gate.admit, env.task, definition.limits, env.run_id, env.tenant_id)
        if verdict.admission is None:
            await _throttled(runtime, flight, env, verdict)
            return
        flight.admission = verdict.admission
    try:
        await _claim_and_run(runtime, flight, env, definition)
    finally:
        if flight.admission is not None:
            # not awaited: a shutdown's cancellation must not skip it; a slot Valkey does not
            # hear about expires with its lease
            asyncio.get_running_loop().run_in_executor(
                None, runtime.gate.release, flight.admission, flight.limit_outcome or "refund"
            )
            flight.admission = None


async def _throttled(
    runtime: Runtime, flight: InFlight, env: envelope.Envelope, verdict: gate.Verdict
) -> None:
    """The gate refused the run: defer it through the outbox (no attempt, no receive, no DLQ
    spent; ADR 0014), due when the gate says it may run (rate limit, open breaker) or after
    a growing delay (full concurrency cap, busy half-open probes)."""
    assert verdict.reason is not None
    wait = verdict.wait_seconds
    delay: deferral.Delay = (
        gate.spread(wait)
        if wait is not None
        else lambda deferrals: gate.throttle_delay(runtime.settings, deferrals)
    )
    deferred = await deferral.defer_message(
        runtime, flight, env, reason=verdict.reason, delay_seconds=delay, detail={"throttled": verdict.reason}
    )
    if deferred.claim is not None:
        await _settle_unclaimed(runtime, flight, deferred.claim, env)


async def _claim_and_run(
    runtime: Runtime, flight: InFlight, env: envelope.Envelope, definition: TaskDefinition
) -> None:
    claim = await runtime.leases.take(  # with the other messages of this receive: one commit
        run_id=env.run_id,
        task=env.task,
        tenant_id=env.tenant_id,
        worker_id=runtime.worker_id,
        lease_seconds=runtime.visibility[flight.queue],
        receive_count=flight.receive_count,
        document=env.encode(),
        queue=env.queue,
    )
    if claim.status is not attempts.ClaimStatus.CLAIMED:
        await _settle_unclaimed(runtime, flight, claim, env)
        return

    flight.attempt, flight.leased = claim.attempt, True
    attempt = attempts.Attempt(env.run_id, claim.attempt, flight.receive_count, runtime.worker_id)
    rules = definition.retry_rules(runtime.settings)
    refused = verdict.before_attempt(flight.receive_count, rules)
    if refused is not None:
        await _apply(runtime, flight, attempt, refused, trace=None, document=env.encode())
        return
    await _execute(runtime, flight, env, definition, attempt, rules)


async def _settle_unclaimed(
    runtime: Runtime, flight: InFlight, claim: attempts.Claim, env: envelope.Envelope
) -> None:
    """A delivery that did not get the run: foreign, a copy of a finished run, or a copy of
    a run another worker holds."""
    status = claim.status
    if status is attempts.ClaimStatus.NOT_FOUND:
        await _dead_letter_foreign(
            runtime, flight, reason="unknown-run", detail="no task_runs row for this run_id"
        )
        return
    if status is attempts.ClaimStatus.MISMATCH:
        await _dead_letter_foreign(
            runtime,
            flight,
            reason="envelope-mismatch",
            detail="the run exists, but this is not the envelope the relay sent "
            "(task, tenant or content differ)",
        )
        return
    if status is attempts.ClaimStatus.SUCCEEDED:
        runtime.counters.duplicates_skipped += 1
        _log(
            logging.INFO,
            "copy of a finished run acknowledged",
            "worker.duplicate",
            flight,
            status="succeeded",
        )
        runtime.acks.ack_soon(flight.queue, flight.receipt_handle)
        return
    if status is attempts.ClaimStatus.CANCELLED:
        runtime.counters.duplicates_skipped += 1
        _log(
            logging.INFO, "cancelled run acknowledged; handler not called", "worker.cancelled_skipped", flight
        )
        runtime.acks.ack_soon(flight.queue, flight.receipt_handle)
        return
    if status is attempts.ClaimStatus.FAILED:
        if claim.dead_lettered:
            runtime.counters.duplicates_skipped += 1
            runtime.acks.ack_soon(flight.queue, flight.receipt_handle)
        else:  # the permanent path was interrupted after `failed`: finish it
            await _send_to_dlq(runtime, flight, reason="completed-after-interruption", failure=None)
        return
    if status is attempts.ClaimStatus.NOT_DUE:
        await _early_copy(runtime, flight, claim.due_in_seconds, env)
        return
    if status is attempts.ClaimStatus.LEASED:
        runtime.counters.duplicates_held += 1
        needed = claim.lease_remaining_seconds + 2
        hide = flight.hideable_seconds(needed)
        if hide >= needed and await runtime.io(
            runtime.outcomes.retry_after, flight.queue, flight.receipt_handle, hide
        ):
            _log(
                logging.INFO,
                "run leased by another worker; copy hidden",
                "worker.leased_elsewhere",
                flight,
                hide_s=hide,
            )
            return
        # SQS cannot keep this copy hidden as long as the lease needs (its 12-hour ceiling)
        # or no longer lets this handle hide it: visibility 0 would bring it back at once,
        # again and again, into the DLQ. The worker holding the lease gives the verdict; if
        # it vanishes, the rescuer sends the run again (docs/lifecycle.md).
        _log(
            logging.INFO,
            "copy of a leased run deleted: SQS cannot hide it until the lease ends",
            "worker.copy_dropped",
            flight,
            lease_left_s=round(claim.lease_remaining_seconds, 1),
            hideable_s=round(hide, 1),
        )
        runtime.acks.ack_soon(flight.queue, flight.receipt_handle)


async def _execute(
    runtime: Runtime,
    flight: InFlight,
    env: envelope.Envelope,
    definition: TaskDefinition,
    attempt: attempts.Attempt,
    rules: retry.RetryRules,
) -> None:
    timeout = definition.effective_timeout()
    ctx = execute.make_context(env, attempt, definition, queue=flight.queue, settings=runtime.settings)
    flight.ctx = ctx
    stop = flight.stop_requested = asyncio.Event()
    payload = env.payload
    started = time.perf_counter()
    _log(logging.DEBUG, "attempt started", "worker.attempt_started", flight, attempt=attempt.attempt)
    span_attributes = execute.span_attributes(env, attempt, queue=flight.queue)
    error: BaseException | None = None
    trace: str | None = None
    try:
        with tracing.handler_span(f"{env.task} process", env.trace, span_attributes):
            if definition.is_async:
                runner = execute.run_async(runtime.async_session_factory, definition, payload, ctx, attempt)
                await _until_stopped(_with_timeout(runner, timeout), stop)
            else:
                future = runtime.handler_threads.run(
                    lambda: execute.run_sync(runtime.session_factory, definition, payload, ctx, attempt)
                )
                await _until_stopped(_with_timeout(asyncio.shield(future), timeout), stop)
    except _StopRequested:  # record `cancelled` (mark_cancelled), delete the message
        ctx.cancel_event.set()
        flight.limit_outcome = "neutral"
        await _reconcile_lost(runtime, flight)
        return
    except _TimedOut:
        ctx.cancel_event.set()
        assert timeout is not None
        error = errors.AttemptTimeout(timeout)
    except asyncio.CancelledError:
        ctx.cancel_event.set()
        flight.limit_outcome = "neutral"
        raise
    except execute.LeaseLost:
        flight.limit_outcome = "neutral"
        await _reconcile_lost(runtime, flight)
        return
    except errors.Retry as exc:
        error = exc
    except Exception as exc:
        error = exc
        trace = "".join(tb.format_exception(exc))
    finally:
        metrics.HANDLER_SECONDS.labels(env.task).observe(time.perf_counter() - started)
    decided = verdict.decide(
        error,
        rules,
        receive_count=flight.receive_count,
        attempt=attempt.attempt,
        visibility_left_seconds=flight.hideable_seconds(SQS_MAX_VISIBILITY_SECONDS),
    )
    flight.limit_outcome = decided.breaker_outcome
    if decided.breaker_outcome == "failure" and flight.admission is not None:
        decided = await _ride_out(runtime, flight, decided)
    if decided.kind is verdict.Kind.DEFER:
        await _defer_failed_attempt(runtime, flight, env, attempt, decided, trace=trace)
        return
    if decided.kind is not verdict.Kind.SUCCEED:
        await _apply(runtime, flight, attempt, decided, trace=trace, document=env.encode())
        return
    flight.verdict = "succeeded"
    runtime.counters.succeeded += 1
    metrics.RUNS_FINISHED.labels(env.task, "succeeded").inc()
    _log(
        logging.INFO,
        "run succeeded",
        "worker.succeeded",
        flight,
        attempt=attempt.attempt,
        duration_ms=round((time.perf_counter() - started) * 1000, 2),
    )
    runtime.acks.ack_soon(flight.queue, flight.receipt_handle)


async def _ride_out(runtime: Runtime, flight: InFlight, decided: verdict.Verdict) -> verdict.Verdict:
    """Record a transient failure on the run's breaker now (not after the verdict, as other
    outcomes are), then let :func:`sqla_outbox.lifecycle.verdict.ride_out` decide whether
    the outage, not the run, pays for it."""
    admission = flight.admission
    breaker = runtime.gate.breaker_for(admission.limits)
    released = await runtime.io(runtime.gate.release, admission, "failure")
    flight.admission = None  # given back: handle_message's release is not needed
    if breaker is None or released.state is None:
        return decided
    waits = released.admits_in_seconds if released.state == "open" else None
    view = verdict.BreakerView(
        state=released.state,
        outage_seconds=released.outage_seconds,
        # half-open (probing): as a run refused for busy probes waits
        admits_in_seconds=waits if waits is not None else runtime.settings.limits_throttle_delay_seconds,
        max_outage_seconds=breaker.max_outage_seconds,
    )
    return verdict.ride_out(decided, view)


async def _defer_failed_attempt(
    runtime: Runtime,
    flight: InFlight,
    env: envelope.Envelope,
    attempt: attempts.Attempt,
    decided: verdict.Verdict,
    *,
    trace: str | None,
) -> None:
    """A DEFER verdict: the attempt failed during its breaker's outage; the run goes back
    to the outbox, due when the breaker may admit it again, the attempt not counted."""
    assert decided.error is not None and decided.reason is not None
    failure = attempts.Failure.from_exception(decided.error, trace)
    deferred = await deferral.defer_message(
        runtime,
        flight,
        env,
        reason=decided.reason,
        delay_seconds=gate.spread(decided.delay_seconds),
        detail={**(_handler_detail(flight) or {}), "uncounted_attempt": attempt.attempt},
        failure=failure,
    )
    if deferred.status is deferral.DeferStatus.NOT_DEFERRABLE:
        await _reconcile_lost(runtime, flight)  # a Cancel committed meanwhile, or the lease was lost
        return
    metrics.RUNS_FINISHED.labels(attempt_task(flight), "queued").inc()
    _log(
        logging.WARNING,
        "attempt failed while its breaker is open; deferred to the next probe, attempt not counted",
        "worker.outage_deferred",
        flight,
        attempt=attempt.attempt,
        error_type=failure.error_type,
        delay_s=round(decided.delay_seconds, 2),
    )


async def _apply(
    runtime: Runtime,
    flight: InFlight,
    attempt: attempts.Attempt,
    decided: verdict.Verdict,
    *,
    trace: str | None,
    document: str,
) -> None:
    """Record a RETRY or FAIL verdict (:mod:`sqla_outbox.lifecycle.verdict`), then tell SQS:
    hide the message until the next try, delete it (a retry through the outbox), or send it
    to the DLQ.

    Args:
        document: The received envelope as JSON text (a retry through the outbox may have
            to write the run's outbox row again from it).
    """
    assert decided.error is not None
    failure = attempts.Failure.from_exception(decided.error, trace)
    detail = _handler_detail(flight)
    outbox = decided.via is verdict.Via.OUTBOX
    if decided.kind is verdict.Kind.FAIL:
        assert decided.reason is not None
        reason = decided.reason
        moved = await runtime.io(
            runtime.in_transaction,
            lambda conn: attempts.mark_failed(conn, attempt, failure, reason=reason, detail=detail),
        )
    else:
        moved = await runtime.io(
            runtime.in_transaction,
            lambda conn: attempts.mark_retrying(
                conn,
                attempt,
                failure,
                backoff_seconds=decided.delay_seconds,
                detail=detail,
                via_outbox=outbox,
                document=document,
            ),
        )
    if not moved:
        await _reconcile_lost(runtime, flight)
        return
    if decided.kind is verdict.Kind.RETRY:
        flight.verdict = "retrying"
        runtime.counters.retried += 1
        metrics.RUNS_FINISHED.labels(attempt_task(flight), "retrying").inc()
        _log(
            logging.WARNING,
            "attempt failed; will retry",
            "worker.retrying",
            flight,
            attempt=attempt.attempt,
            error_type=failure.error_type,
            backoff_s=round(decided.delay_seconds, 2),
            via=decided.via.value,
        )
        if not outbox and not await runtime.io(
            runtime.outcomes.retry_after, flight.queue, flight.receipt_handle, decided.delay_seconds
        ):
            # the handle went stale while the handler ran (the message was received again
            # elsewhere, or reached SQS's 12-hour ceiling): the copy in SQS is not ours to
            # hide, and may be in the DLQ already; the next try comes from the outbox
            run_id, delay = attempt.run_id, decided.delay_seconds
            await runtime.io(
                runtime.in_transaction,
                lambda conn: attempts.pend_for_retry(conn, run_id, delay_seconds=delay, document=document),
            )
            outbox = True
            _log(
                logging.INFO,
                "the message could not be hidden; the next try comes from the outbox",
                "worker.retry_via_outbox",
                flight,
                attempt=attempt.attempt,
            )
        if outbox:
            runtime.wake_relay()
            runtime.acks.ack_soon(flight.queue, flight.receipt_handle)
        return
    flight.verdict = "failed"
    runtime.counters.failed += 1
    metrics.RUNS_FINISHED.labels(attempt_task(flight), "failed").inc()
    _log(
        logging.ERROR,
        "run failed; sending to the DLQ",
        "worker.failed",
        flight,
        attempt=attempt.attempt,
        error_type=failure.error_type,
        reason=decided.reason,
    )
    await _send_to_dlq(runtime, flight, reason=decided.reason or "failed", failure=failure)


async def _send_to_dlq(
    runtime: Runtime, flight: InFlight, *, reason: str, failure: attempts.Failure | None
) -> None:
    context = {
        "reason": reason,
        "error_type": failure.error_type if failure else "",
        "error_message": failure.message if failure else "",
        "failed_at": utc_now_text(),
        "receive_count": str(flight.receive_count),
        "source_queue": flight.queue,
    }
    dlq = await runtime.io(
        runtime.outcomes.dead_letter,
        flight.queue,
        flight.receipt_handle,
        flight.body,
        _run_attributes(flight),
        context,
    )
    metrics.DLQ_SENDS.labels(flight.queue, reason).inc()
    runtime.counters.dead_lettered += 1
    if flight.run_id is not None:
        run_id = flight.run_id
        await runtime.io(
            runtime.in_transaction,
            lambda conn: attempts.mark_dead_lettered(
                conn,
                run_id,
                receive_count=flight.receive_count,
                worker_id=runtime.worker_id,
                dlq=dlq.rsplit("/", 1)[-1],
            ),
        )


def _run_attributes(flight: InFlight) -> dict[str, Any]:
    """The DLQ message's ``run_id``/``task``/``tenant_id`` attributes for a run's own message:
    the decoded envelope's (which matched the run), not the received attributes, which
    whoever sent the message wrote; the relay's ``signature`` is kept with the body."""
    if flight.run_id is None or flight.task_name is None:
        return flight.attributes
    kept = {k: v for k, v in flight.attributes.items() if k == envelope.SIGNATURE_ATTRIBUTE}
    return {**kept, **envelope.message_attributes(flight.run_id, flight.task_name, flight.tenant_id)}


async def _dead_letter_foreign(runtime: Runtime, flight: InFlight, *, reason: str, detail: str) -> None:
    """A message that is not one of our runs: DLQ with the reason, never executed."""
    runtime.counters.foreign += 1
    _log(
        logging.WARNING,
        "foreign or malformed message sent to the DLQ",
        "worker.foreign",
        flight,
        reason=reason,
    )
    context = {
        "reason": reason,
        "error_message": detail[:500],
        "failed_at": utc_now_text(),
        "receive_count": str(flight.receive_count),
        "source_queue": flight.queue,
    }
    await runtime.io(
        runtime.outcomes.dead_letter,
        flight.queue,
        flight.receipt_handle,
        flight.body,
        flight.attributes,
        context,
    )
    metrics.DLQ_SENDS.labels(flight.queue, reason.split(":")[0]).inc()


EARLY_COPY_HIDE_SECONDS = 60
"""A copy due within this long is hidden until its due time rather than deleted: it might
be the relay's own message, sent as the database clock stepped back, whose ``sent_at`` is
not committed yet (PostgreSQL ``clock_timestamp()`` follows the system clock)."""


async def _early_copy(
    runtime: Runtime, flight: InFlight, due_in_seconds: float, env: envelope.Envelope
) -> None:
    """A message for a run that is not due yet: the relay sends a run only once it is due,
    and a retry's message comes back only at its next try, so this is a copy (a resent or
    replayed message, a duplicate). It never runs early, and it spends none of the run's
    attempts nor receives of the run's own message (SQS counts every receive toward the
    redrive limit):

    * due within :data:`EARLY_COPY_HIDE_SECONDS`: hidden until the due time, then handled
      again (one more receive of this copy only);
    * later, while the run's outbox row is pending: the relay sends the run's own message
      at its due time, so the copy is deleted (hiding it for hours would spend a receive of
      it every 12 hours, the SQS visibility limit);
    * later, with the row already sent (a retry's message in SQS, a clock stepped back):
      hidden until the due time;
    * whenever SQS cannot hide it that long (its 12-hour ceiling from the first receive, a
      stale receipt handle): deferred through the outbox to the due time
      (:func:`~sqla_outbox.worker.deferral.defer_message`), never shown again at once.
    """
    assert flight.run_id is not None
    run_id = flight.run_id
    pending = due_in_seconds > EARLY_COPY_HIDE_SECONDS and await runtime.io(
        runtime.in_transaction, lambda conn: attempts.outbox_pending(conn, run_id)
    )
    runtime.counters.foreign += 1
    if pending:
        _log(
            logging.WARNING,
            "early copy of a delayed run deleted; the relay sends the run at its due time",
            "worker.early_copy",
            flight,
            due_in_s=round(due_in_seconds, 3),
        )
        runtime.acks.ack_soon(flight.queue, flight.receipt_handle)
        return
    wanted = max(1, math.ceil(due_in_seconds))
    hide = int(flight.hideable_seconds(wanted))  # within SQS's 12-hour ceiling from the first receive
    if hide >= wanted and await runtime.io(
        runtime.outcomes.retry_after, flight.queue, flight.receipt_handle, hide
    ):
        _log(
            logging.INFO, "run not due yet; message hidden until then", "worker.not_due", flight, hide_s=hide
        )
        return
    deferred = await deferral.defer_message(
        runtime, flight, env, reason="not-due", delay_seconds=float(wanted), detail={"early_copy": True}
    )
    if deferred.claim is not None:  # finished or leased since: settle it as such
        await _settle_unclaimed(runtime, flight, deferred.claim, env)


def _record_cancelled(runtime: Runtime, flight: InFlight) -> None:
    flight.verdict = "cancelled"
    runtime.counters.cancelled += 1
    metrics.RUNS_FINISHED.labels(attempt_task(flight), "cancelled").inc()
    _log(logging.INFO, "run cancelled while running", "worker.cancelled", flight, attempt=flight.attempt)
    runtime.acks.ack_soon(flight.queue, flight.receipt_handle)


async def _reconcile_lost(runtime: Runtime, flight: InFlight) -> None:
    """The attempt's transition matched nothing: act on the run's real status. A committed
    cancel request is why, when :func:`~sqla_outbox.lifecycle.attempts.mark_cancelled` matches:
    the run ends ``cancelled`` and the message is deleted."""
    assert flight.run_id is not None
    run_id = flight.run_id
    if flight.leased and flight.verdict is None:
        attempt = attempts.Attempt(run_id, flight.attempt, flight.receive_count, runtime.worker_id)
        detail = _handler_detail(flight)
        if await runtime.io(
            runtime.in_transaction, lambda conn: attempts.mark_cancelled(conn, attempt, detail=detail)
        ):
            _record_cancelled(runtime, flight)
            return
    status = await runtime.io(runtime.in_transaction, lambda conn: attempts.current_status(conn, run_id))
    runtime.counters.lost_leases += 1
    _log(logging.WARNING, "attempt lost the run; reconciling", "worker.lease_lost", flight, status=status)
    if status in ("succeeded", "cancelled"):
        runtime.acks.ack_soon(flight.queue, flight.receipt_handle)
    # otherwise another attempt owns the run, or its verdict is recorded and this copy
    # comes back later and is handled by what the run says then


async def give_back(runtime: Runtime, flight: InFlight, *, reason: str, hide_seconds: float = 0.0) -> None:
    """Return a message; an attempt in progress puts its run back to ``queued``.

    Args:
        hide_seconds: How long the message stays hidden (0: visible at once). A stopping
            worker passes what is left of its own pending long poll on the queue, so that
            poll cannot take the message back (SQS counts every receive toward redrive).
    """
    if flight.leased and flight.verdict is None and flight.run_id is not None:
        attempt = attempts.Attempt(flight.run_id, flight.attempt, flight.receive_count, runtime.worker_id)
        moved = await runtime.io(
            runtime.in_transaction, lambda conn: attempts.mark_requeued(conn, attempt, reason=reason)
        )
        if not moved:
            await _reconcile_lost(runtime, flight)
            return
        metrics.RUNS_FINISHED.labels(attempt_task(flight), "queued").inc()
    if flight.verdict is None:
        runtime.counters.returned += 1
        hide = flight.hideable_seconds(math.ceil(hide_seconds) + 1) if hide_seconds > 0 else 0
        _log(
            logging.INFO,
            "message returned to the queue",
            "worker.returned",
            flight,
            reason=reason,
            hide_s=hide,
        )
        await runtime.io(runtime.outcomes.retry_after, flight.queue, flight.receipt_handle, hide)


def _handler_detail(flight: InFlight) -> dict[str, Any] | None:
    """What the handler put in ``ctx.trail_detail`` (bounded), for the trail row."""
    return bounded_detail(flight.ctx.trail_detail) if flight.ctx is not None else None


def attempt_task(flight: InFlight) -> str:
    return flight.task_name or "unknown"


def _log(level: int, message: str, action: str, flight: InFlight, **fields: Any) -> None:
    """Log about a message; run_id and task only once the envelope was read (a message
    returned unread during shutdown has neither)."""
    known = {"run_id": str(flight.run_id) if flight.run_id else None, "task": flight.task_name}
    logger.log(
        level,
        message,
        extra=log_extra(
            action=action,
            **{name: value for name, value in known.items() if value is not None},
            queue=flight.queue,
            message_id=flight.message_id,
            receipt=short_handle(flight.receipt_handle),
            receive_count=flight.receive_count,
            **fields,
        ),
    )
