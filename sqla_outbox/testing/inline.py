"""Running pending runs inline, with the real handlers and without SQS, a relay or a worker.

See :mod:`sqla_outbox.testing` for the overview and what inline execution does not do.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import traceback as tb
import uuid
from collections.abc import Coroutine, Iterable
from typing import Any, TypeVar

from sqlalchemy import text
from sqlalchemy.engine import Engine
from sqlalchemy.orm import Session, sessionmaker

from sqla_outbox import envelope, errors, tracing
from sqla_outbox.catalog import Catalog
from sqla_outbox.config import OutboxSettings
from sqla_outbox.events import install, installation_for, uninstall
from sqla_outbox.lifecycle import attempts, sending, verdict
from sqla_outbox.lifecycle.attempts import Failure
from sqla_outbox.types import JSONValue
from sqla_outbox.worker import execute
from sqla_outbox.worker.context import bounded_detail
from sqla_outbox.worker.registry import Registry
from sqla_outbox.worker.registry import registry as default_registry

T = TypeVar("T")

WORKER_ID = "sqla_outbox.testing"
"""The ``worker_id`` inline runs record in ``task_runs.lease_owner`` and the trail."""

# --------------------------------------------------------------------------------------
# running inline


@dataclasses.dataclass(frozen=True)
class RunOutcome:
    """What :func:`run_pending` did with one run.

    Attributes:
        run_id / task / tenant_id / event / queue / payload: From the envelope.
        round: The round (from 1) in which the run was picked up; follow-ups dispatched
            by handlers of round N run in round N + 1.
        status: The run's status afterwards: ``succeeded``, ``failed``, ``retrying`` (a
            transient failure with ``retries=False``), or for a run that was not
            executed, its status as found.
        attempts: Handler attempts made by this call (0 when not executed).
        failures: The failure of each failed attempt, oldest first (type, message,
            traceback excerpt), as the trail stores them.
        reason: Why a run ended ``failed``, as the trail records it: ``permanent-error``,
            ``retries-exhausted`` or ``receive-limit``; else None.
        skipped: Why the run was not executed, else None: ``no-handler`` (no handler is
            registered for its task: as a worker does, the run is left ``queued`` with its
            outbox row pending, and :meth:`RunReport.assert_all_succeeded` reports it),
            ``already-succeeded``, ``already-failed``, ``leased`` (another worker holds it),
            ``unknown-run``, ``envelope-mismatch`` or ``malformed-envelope``.
    """

    run_id: uuid.UUID
    task: str
    tenant_id: int | None
    event: str | None
    queue: str
    payload: JSONValue
    round: int
    status: str
    attempts: int = 0
    failures: tuple[Failure, ...] = ()
    reason: str | None = None
    skipped: str | None = None

    @property
    def error(self) -> Failure | None:
        """The last failure when the run did not succeed, else None."""
        if self.status == "succeeded" or not self.failures:
            return None
        return self.failures[-1]

    def describe(self) -> str:
        """One line: task, tenant, status, attempts and the last error."""
        line = (
            f"{self.task} tenant_id={self.tenant_id} run_id={self.run_id} round={self.round}: {self.status}"
        )
        if self.skipped:
            line += f" (not executed: {self.skipped})"
        elif self.attempts:
            line += f" after {self.attempts} attempt(s)"
        if self.reason:
            line += f" [{self.reason}]"
        if self.failures:
            last = self.failures[-1]
            line += f"; last error {last.error_type}: {last.message}"
        return line


@dataclasses.dataclass
class RunReport:
    """Result of :func:`run_pending`.

    Attributes:
        runs: One :class:`RunOutcome` per run picked up, in execution order.
        rounds: Rounds that executed at least one run.
    """

    runs: list[RunOutcome] = dataclasses.field(default_factory=list)
    rounds: int = 0

    def for_task(self, task: str) -> list[RunOutcome]:
        """Outcomes of ``task``'s runs."""
        return [outcome for outcome in self.runs if outcome.task == task]

    def by_run_id(self, run_id: uuid.UUID) -> RunOutcome:
        """The outcome of one run.

        Raises:
            KeyError: The run was not picked up by this call.
        """
        for outcome in self.runs:
            if outcome.run_id == run_id:
                return outcome
        raise KeyError(run_id)

    @property
    def succeeded(self) -> list[RunOutcome]:
        return [o for o in self.runs if o.status == "succeeded" and not o.skipped]

    @property
    def failed(self) -> list[RunOutcome]:
        return [o for o in self.runs if o.status == "failed" and not o.skipped]

    @property
    def retrying(self) -> list[RunOutcome]:
        return [o for o in self.runs if o.status == "retrying" and not o.skipped]

    @property
    def skipped(self) -> list[RunOutcome]:
        return [o for o in self.runs if o.skipped]

    def statuses(self) -> dict[str, str]:
        """``{task: status}`` when each task ran once; the last outcome wins otherwise."""
        return {o.task: o.status for o in self.runs}

    def assert_all_succeeded(self) -> None:
        """Raise unless every executed run succeeded and every run found a handler.

        Raises:
            AssertionError: Lists each run that did not succeed, with its last error and
                traceback excerpt.
        """
        bad = [
            o for o in self.runs if (o.status != "succeeded" and not o.skipped) or o.skipped == "no-handler"
        ]
        if not bad:
            return
        lines = [f"{len(bad)} of {len(self.runs)} run(s) did not succeed:"]
        for outcome in bad:
            lines.append(f"  - {outcome.describe()}")
            if outcome.error is not None and outcome.error.traceback:
                lines += ["      " + line for line in outcome.error.traceback.rstrip().splitlines()[-12:]]
        raise AssertionError("\n".join(lines))

    def __str__(self) -> str:
        lines = [f"{len(self.runs)} run(s) in {self.rounds} round(s):"]
        return "\n".join(lines + [f"  - {o.describe()}" for o in self.runs])


class RoundLimitReached(errors.OutboxError):
    """:func:`run_pending` still found due runs after ``max_rounds`` rounds.

    Usually a handler that dispatches work that dispatches work again, forever. An
    :class:`~sqla_outbox.errors.OutboxError` like every error the library raises (not an
    ``AssertionError``: it reports a runaway workload, not a failed assertion, and must
    not depend on how assertions are compiled).

    Attributes:
        report: What was run until then.
        max_rounds: The limit that was reached. left: Due runs still waiting.
    """

    code = "round-limit-reached"

    def __init__(self, report: RunReport, max_rounds: int, left: int) -> None:
        self.report = report
        self.max_rounds = max_rounds
        self.left = left
        super().__init__(
            f"still {left} due run(s) after {max_rounds} round(s) of run_pending; a handler may "
            f"keep dispatching follow-ups (raise max_rounds if that is expected).\n{report}"
        )


_DUE = text(
    """
SELECT o.tbl, o.run_id, o.envelope, COALESCE(r.attempts, 0) AS attempts
FROM (
    SELECT 'outbox_messages' AS tbl, id, run_id, envelope, available_at, created_at
    FROM outbox_messages WHERE sent_at IS NULL
    UNION ALL
    SELECT 'platform_outbox_messages', id, run_id, envelope, available_at, created_at
    FROM platform_outbox_messages WHERE sent_at IS NULL
) AS o
LEFT JOIN task_runs AS r ON r.run_id = o.run_id
WHERE :include_delayed OR o.available_at <= clock_timestamp()
ORDER BY o.available_at, o.created_at, o.tbl, o.id
"""
)
_SKIPPED = {
    attempts.ClaimStatus.NOT_FOUND: "unknown-run",
    attempts.ClaimStatus.MISMATCH: "envelope-mismatch",
    attempts.ClaimStatus.SUCCEEDED: "already-succeeded",
    attempts.ClaimStatus.FAILED: "already-failed",
    attempts.ClaimStatus.CANCELLED: "cancelled",
    attempts.ClaimStatus.LEASED: "leased",
    attempts.ClaimStatus.NOT_DUE: "not-due",
}


def run_pending(
    source: Any,
    *,
    registry: Registry | None = None,
    catalog: Catalog | None = None,
    settings: OutboxSettings | None = None,
    include_delayed: bool = False,
    retries: bool = True,
    tasks: Iterable[str] | None = None,
    max_rounds: int = 10,
) -> RunReport:
    """Execute pending runs inline with their real handlers, round after round.

    Each round takes the due pending outbox rows (``available_at`` passed, or all of them
    with ``include_delayed``), oldest first, and for each: decodes the envelope, takes
    the run's lease, runs the handler (sync handlers in a ``Session``, ``async def``
    handlers in an ``AsyncSession``, both committing with ``running → succeeded``),
    records a failure as the worker does, and marks the outbox row sent. Handler
    exceptions are recorded in the report, never raised: check
    :meth:`RunReport.assert_all_succeeded` or the outcomes. Rounds continue while due
    rows remain (follow-ups dispatched by handlers), up to ``max_rounds``.

    Failures are classified by the worker's own verdict
    (:func:`sqla_outbox.lifecycle.verdict.decide`, which ``sqla_outbox.worker.handle`` calls
    too): :class:`~sqla_outbox.errors.PermanentError` or a type in ``@task(permanent=...)``
    → ``failed`` (reason ``permanent-error``); another exception or
    :class:`~sqla_outbox.errors.Retry` → transient: with ``retries`` the run is attempted
    again at once until it succeeds or its tries (``@task(retry=RetryPolicy(
    max_receives=...))``, else ``settings.worker_max_receives``) are spent and it ends
    ``failed`` (``retries-exhausted``); without ``retries`` it stays ``retrying`` and its
    outbox row stays pending, so the next call runs it again (as SQS would redeliver it).
    A retry's trail row records the delay the worker would wait. A run whose task has no
    handler here is left ``queued`` (``skipped="no-handler"``), as the worker defers it.

    Args:
        source: A ``sessionmaker`` bound to an ``Engine`` (handler sessions come from it;
            when it has the listeners from :func:`sqla_outbox.install`, their settings
            and catalog are used), or an ``Engine``.
        registry: Where the handlers are registered (default: the ``@task`` registry;
            import your task modules first).
        catalog: For follow-up dispatches of async handlers, and of sync handlers when
            ``source`` has no installation (on the factory or its Session class), which is
            otherwise used as it is. Default: the installation's, else
            ``registry.catalog()``.
        settings: As ``catalog``; also gives ``max_message_bytes`` and
            ``worker_max_receives``. Default: the installation's, else
            ``OutboxSettings(wake_mode="none")`` (no wake signal).
        include_delayed: Also run rows whose ``available_at`` is in the future.
        retries: Re-run transient failures at once (see above).
        tasks: Only pick up runs of these tasks; others stay pending.
        max_rounds: Most rounds; at least 1.

    Returns:
        The :class:`RunReport`.

    Raises:
        RoundLimitReached: Due runs remain after ``max_rounds`` rounds.
        ConfigurationError: ``source`` is neither an ``Engine`` nor a ``sessionmaker``
            bound to one, or ``max_rounds`` < 1.
    """
    if max_rounds < 1:
        raise errors.ConfigurationError("max_rounds must be >= 1", option="run_pending(max_rounds)")
    runner = _InlineRunner(source, registry=registry, catalog=catalog, settings=settings, retries=retries)
    try:
        return runner.run(include_delayed=include_delayed, tasks=tasks, max_rounds=max_rounds)
    finally:
        runner.close()


class _InlineRunner:
    """State of one :func:`run_pending` call: engine, session factories, event loop."""

    def __init__(
        self,
        source: Any,
        *,
        registry: Registry | None,
        catalog: Catalog | None,
        settings: OutboxSettings | None,
        retries: bool,
    ) -> None:
        self.registry = registry or default_registry
        self.retries = retries
        self._installed_here: Any = None
        if isinstance(source, sessionmaker):
            bind = source.kw.get("bind")
            if not isinstance(bind, Engine):
                raise errors.ConfigurationError(
                    f"the sessionmaker is bound to {bind!r}; run_pending needs one bound to an Engine",
                    option="run_pending(source)",
                )
            self.engine = bind
            factory: sessionmaker[Session] = source
        elif isinstance(source, Engine):
            self.engine = source
            factory = sessionmaker(source)
        else:
            raise errors.ConfigurationError(
                f"cannot run pending work through {source!r}: pass a sessionmaker or an Engine",
                option="run_pending(source)",
            )
        # listeners may sit on the factory or on its Session class (install(MySession));
        # installing a second set would process every Dispatch twice
        installation = installation_for(factory) or installation_for(factory.class_)
        self.settings = settings or (
            installation.settings if installation else OutboxSettings(wake_mode="none")
        )
        self.catalog = catalog or (installation.catalog if installation else self.registry.catalog())
        if installation is None:
            install(factory, self.settings, catalog=self.catalog)
            self._installed_here = factory
        self.session_factory = factory
        self._async: _AsyncBridge | None = None

    # --- the loop ------------------------------------------------------------------------
    def run(self, *, include_delayed: bool, tasks: Iterable[str] | None, max_rounds: int) -> RunReport:
        only = None if tasks is None else set(tasks)
        report = RunReport()
        seen_pending: set[uuid.UUID] = set()  # left pending by this call (retrying, leased)
        while True:
            with self.engine.connect() as connection:
                rows = connection.execute(_DUE, {"include_delayed": include_delayed}).all()
            due = [
                row
                for row in rows
                if row.run_id not in seen_pending
                and (only is None or (isinstance(row.envelope, dict) and row.envelope.get("task") in only))
            ]
            if not due:
                return report
            if report.rounds >= max_rounds:
                raise RoundLimitReached(report, max_rounds, len(due))
            report.rounds += 1
            for row in due:
                outcome, still_pending = self._deliver(row, report.rounds)
                report.runs.append(outcome)
                if still_pending:
                    seen_pending.add(outcome.run_id)

    def _deliver(self, row: Any, round_number: int) -> tuple[RunOutcome, bool]:
        """Take one outbox row to a verdict; return the outcome and whether the row stays pending."""
        try:
            env = envelope.decode(
                envelope.encode_document(row.envelope), max_bytes=self.settings.max_message_bytes
            )
        except envelope.MalformedEnvelope as exc:
            self._mark_sent(row.tbl, row.run_id)
            doc = row.envelope if isinstance(row.envelope, dict) else {}
            outcome = RunOutcome(
                run_id=row.run_id,
                task=str(doc.get("task")),
                tenant_id=None,
                event=None,
                queue=str(doc.get("queue")),
                payload=None,
                round=round_number,
                status=self._status(row.run_id),
                failures=(attempts.Failure.from_exception(exc),),
                skipped="malformed-envelope",
            )
            return outcome, False
        base = RunOutcome(
            run_id=env.run_id,
            task=env.task,
            tenant_id=env.tenant_id,
            event=env.event,
            queue=env.queue,
            payload=env.payload,
            round=round_number,
            status="queued",
        )
        if env.task not in self.registry.tasks:  # the worker defers it, unleased, to a worker that has it
            status = self._status(env.run_id)
            return dataclasses.replace(base, status=status, skipped="no-handler"), True
        receive_count = int(row.attempts) + 1
        failures: list[attempts.Failure] = []
        tries = 0
        while True:
            with self.engine.begin() as connection:
                claim = attempts.take_lease(
                    connection,
                    run_id=env.run_id,
                    task=env.task,
                    tenant_id=env.tenant_id,
                    worker_id=WORKER_ID,
                    lease_seconds=self._lease_seconds(env.queue),
                    receive_count=receive_count,
                    honour_due_time=False,  # rows were picked by due time, or include_delayed
                )
            if claim.status is not attempts.ClaimStatus.CLAIMED:
                leased = claim.status is attempts.ClaimStatus.LEASED
                if not leased:
                    self._mark_sent(row.tbl, env.run_id)
                status = claim.previous_status or "missing"
                if tries:  # lost the run between our own attempts (not expected inline)
                    outcome = dataclasses.replace(
                        base, status=status, attempts=tries, failures=tuple(failures)
                    )
                    return outcome, leased
                return dataclasses.replace(base, status=status, skipped=_SKIPPED[claim.status]), leased
            tries += 1
            attempt = attempts.Attempt(env.run_id, claim.attempt, receive_count, WORKER_ID)
            status, failure, reason = self._attempt(env, attempt)
            if failure is not None:
                failures.append(failure)
            if status == "retrying" and self.retries:
                receive_count += 1
                continue
            still_pending = status == "retrying"
            if not still_pending:
                self._mark_sent(row.tbl, env.run_id)
            outcome = dataclasses.replace(
                base, status=status, attempts=tries, failures=tuple(failures), reason=reason
            )
            return outcome, still_pending

    def _attempt(
        self, env: envelope.Envelope, attempt: attempts.Attempt
    ) -> tuple[str, attempts.Failure | None, str | None]:
        """Run one attempt the way the worker does; return (status, failure, failed reason).

        The verdict is :func:`sqla_outbox.lifecycle.verdict.decide`'s, the worker's own."""
        definition = self.registry.get(env.task)
        rules = definition.retry_rules(self.settings)
        refused = verdict.before_attempt(attempt.receive_count, rules)
        if refused is not None:
            return self._record(attempt, refused, trace=None, detail=None)
        ctx = execute.make_context(env, attempt, definition, queue=env.queue, settings=self.settings)
        attributes = execute.span_attributes(env, attempt, queue=env.queue)
        error: BaseException | None = None
        trace: str | None = None
        try:
            with tracing.handler_span(f"{env.task} process", env.trace, attributes):
                if definition.is_async:
                    bridge = self._bridge()
                    bridge.run(
                        execute.run_async(bridge.session_factory, definition, env.payload, ctx, attempt)
                    )
                else:
                    execute.run_sync(self.session_factory, definition, env.payload, ctx, attempt)
        except execute.LeaseLost:
            with self.engine.begin() as connection:  # a committed Cancel asked the run to stop
                if attempts.mark_cancelled(connection, attempt):
                    return "cancelled", None, None
            return self._status(env.run_id), None, None
        except errors.Retry as exc:
            error = exc
        except Exception as exc:
            error, trace = exc, "".join(tb.format_exception(exc))
        decided = verdict.decide(error, rules, receive_count=attempt.receive_count, attempt=attempt.attempt)
        if decided.kind is verdict.Kind.SUCCEED:
            return "succeeded", None, None
        return self._record(attempt, decided, trace=trace, detail=ctx.trail_detail)

    # --- verdicts --------------------------------------------------------------------------
    def _record(
        self,
        attempt: attempts.Attempt,
        decided: verdict.Verdict,
        *,
        trace: str | None,
        detail: dict[str, Any] | None,
    ) -> tuple[str, attempts.Failure | None, str | None]:
        """Apply a RETRY or FAIL verdict with the worker's statements. A retry's trail row
        records the delay the worker would wait (inline, the next attempt follows at once)."""
        assert decided.error is not None
        failure = attempts.Failure.from_exception(decided.error, trace)
        with self.engine.begin() as connection:
            if decided.kind is verdict.Kind.FAIL:
                assert decided.reason is not None
                moved = attempts.mark_failed(
                    connection, attempt, failure, reason=decided.reason, detail=bounded_detail(detail or {})
                )
            else:
                moved = attempts.mark_retrying(
                    connection,
                    attempt,
                    failure,
                    backoff_seconds=decided.delay_seconds,
                    detail=bounded_detail(detail or {}),
                )
        if not moved:
            return self._status(attempt.run_id), failure, None
        if decided.kind is verdict.Kind.FAIL:
            return "failed", failure, decided.reason
        return "retrying", failure, None

    def _lease_seconds(self, queue: str) -> int:
        """The lease a worker takes for a run of ``queue``: its visibility timeout as the
        settings deploy it (the default queue's for a queue the catalog does not know)."""
        known = self.catalog.queue_registry
        return known.deployed(
            queue if queue in known else "default", self.settings
        ).visibility_timeout_seconds

    def _status(self, run_id: uuid.UUID) -> str:
        with self.engine.connect() as connection:
            return attempts.current_status(connection, run_id) or "missing"

    def _mark_sent(self, table: str, run_id: uuid.UUID) -> None:
        with self.engine.begin() as connection:
            sending.mark_sent_by_run(connection, table, run_id)

    # --- resources -------------------------------------------------------------------------
    def _bridge(self) -> _AsyncBridge:
        if self._async is None:
            self._async = _AsyncBridge(self.engine, self.settings, self.catalog)
        return self._async

    def close(self) -> None:
        if self._async is not None:
            self._async.close()
            self._async = None
        if self._installed_here is not None:
            uninstall(self._installed_here)
            self._installed_here = None


class _AsyncBridge:
    """An event loop for async handlers, and an installed ``async_sessionmaker`` on it.

    Without a running loop in the calling thread, the loop runs in this thread
    (``asyncio.Runner``); when the caller is itself inside a running loop (an async test
    calling the sync helper), the loop runs on a helper thread and the caller waits.
    The async engine uses the sync engine's URL with the psycopg 3 driver.
    """

    def __init__(self, engine: Engine, settings: OutboxSettings, catalog: Catalog) -> None:
        from sqlalchemy.ext.asyncio import async_sessionmaker, create_async_engine

        url = engine.url
        if url.drivername in ("postgresql", "postgres", "postgresql+psycopg2", "postgresql+pg8000"):
            url = url.set(drivername="postgresql+psycopg")
        self.engine = create_async_engine(url, hide_parameters=engine.hide_parameters)
        self.session_factory: Any = async_sessionmaker(self.engine)
        install(self.session_factory, settings, catalog=catalog)
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            self._thread: concurrent.futures.ThreadPoolExecutor | None = None
        else:
            self._thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="sqla-outbox-testing")
        self._runner = asyncio.Runner()

    def run(self, coroutine: Coroutine[Any, Any, T]) -> T:
        if self._thread is None:
            return self._runner.run(coroutine)
        return self._thread.submit(self._runner.run, coroutine).result()

    def close(self) -> None:
        try:
            self.run(self.engine.dispose())
            if self._thread is None:
                self._runner.close()
            else:
                self._thread.submit(self._runner.close).result()
                self._thread.shutdown()
        finally:
            uninstall(self.session_factory)
