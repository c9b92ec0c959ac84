"""The whole exception tree of sqla_outbox.

Every exception the library raises derives from :class:`OutboxError`. Each class has a
short ``code`` that names its section in ``docs/errors.md``; its docstring's first line is
the default message. Context travels as attributes (``task``, ``size_bytes``, ...), not
only inside the message text.

Handlers raise :class:`PermanentError` (send the run to the dead-letter queue now) or
:class:`Retry` (retry after a chosen delay); any other exception is a transient failure.
"""

from __future__ import annotations

import uuid


class OutboxError(Exception):
    """sqla_outbox error."""

    code = "outbox-error"

    def __init__(self, message: str | None = None) -> None:
        if message is None:
            doc = type(self).__doc__ or type(self).__name__
            message = doc.strip().splitlines()[0]
        super().__init__(message)

    @property
    def message(self) -> str:
        return str(self.args[0]) if self.args else ""


class ConfigurationError(OutboxError):
    """A setting or option is invalid.

    Attributes:
        option: The setting or environment variable at fault, when known.
        detail: What is wrong, without the option's name.
    """

    code = "configuration"

    def __init__(self, message: str, *, option: str | None = None) -> None:
        self.option = option
        self.detail = message
        super().__init__(f"{option}: {message}" if option else message)


class CatalogError(OutboxError):
    """The task catalog (tasks.json) is missing or invalid.

    Attributes:
        path: The catalog file, when it came from a file.
        pointer: JSON path of the bad entry (``tasks.send_welcome.queue``), when known.
    """

    code = "catalog"

    def __init__(self, message: str, *, path: str | None = None, pointer: str | None = None):
        self.path = path
        self.pointer = pointer
        where = ""
        if path:
            where += f"{path}: "
        if pointer:
            where += f"at {pointer}: "
        super().__init__(f"{where}{message}")


class NotInstalled(OutboxError):
    """A Dispatch or Publish reached a session without sqla_outbox listeners.

    Call ``sqla_outbox.install(session_factory_or_class)`` once at start-up. Without the
    listeners the object would be silently dropped or half-written, so it is refused.
    """

    code = "not-installed"


class DispatchError(OutboxError):
    """The dispatch was refused; nothing was written.

    Attributes:
        task: The task (or event, for :class:`UnknownEvent`) the dispatch named; None when
            what it was given is not a name at all (``Dispatch(None)``), the message then
            says what it was.
    """

    code = "dispatch"

    def __init__(self, task: str | None, problem: str) -> None:
        self.task = task
        self.problem = problem
        if task is None:
            super().__init__(problem)
            return
        shown = task if len(task) <= 80 else task[:77] + "..."  # a 10,000-character "name"
        super().__init__(f"task {shown!r}: {problem}")


class UnknownTask(DispatchError):
    """The task is not in the catalog."""

    code = "unknown-task"


class UnknownEvent(DispatchError):
    """The event is not in the catalog."""

    code = "unknown-event"

    def __init__(self, event: str, problem: str) -> None:
        self.event = event
        super().__init__(event, problem)
        self.args = (f"event {event!r}: {problem}",)


class UnknownQueue(DispatchError):
    """The queue is not one of critical, default, bulk, maintenance."""

    code = "unknown-queue"


class PayloadNotSerializable(DispatchError):
    """The payload is not plain JSON (including NaN and Infinity, which JSON does not have)."""

    code = "payload-not-serializable"


class EnvelopeTooLarge(DispatchError):
    """The SQS message for this run would exceed the configured size limit.

    Attributes:
        size_bytes: Body plus message attributes, counted the way SQS counts them.
        limit_bytes: The limit (``SQLA_OUTBOX_MAX_MESSAGE_BYTES``, default 262,144 bytes,
            the classic SQS maximum message size).
    """

    code = "envelope-too-large"

    def __init__(self, task: str, *, size_bytes: int, limit_bytes: int) -> None:
        self.size_bytes = size_bytes
        self.limit_bytes = limit_bytes
        super().__init__(
            task,
            f"the SQS message would be {size_bytes} bytes, over the {limit_bytes}-byte limit",
        )


class InvalidDispatch(DispatchError):
    """The dispatch options are inconsistent (negative delay, missing tenant, ...)."""

    code = "invalid-dispatch"


class IdempotencyKeyContended(DispatchError):
    """The idempotency key's unfinished run kept finishing while the flush wrote this run.

    Raised at flush: three times in a row the INSERT met an unfinished run with the same
    task, tenant and key, and that run had finished by the time the lookup that follows
    looked for it (another process dispatching and finishing runs of that key without a
    pause). The flush fails and nothing of it stays written (what it had inserted is deleted
    again, so catching the error and committing writes none of the flush); retrying the
    transaction dispatches again.
    """

    code = "idempotency-key-contended"


class HandlerNotFound(OutboxError):
    """The worker has no handler registered for the task.

    Attributes:
        task: The task name the message asked for.
    """

    code = "handler-not-found"

    def __init__(self, task: str) -> None:
        self.task = task
        super().__init__(f"no handler registered for task {task!r}")


class RunNotFound(OutboxError):
    """No run has this run_id (not committed yet, never dispatched, or purged).

    Attributes:
        run_id: The run asked for.
    """

    code = "run-not-found"

    def __init__(self, run_id: uuid.UUID) -> None:
        self.run_id = run_id
        super().__init__(
            f"no run {run_id} (its dispatch not committed yet, never dispatched, or purged; a "
            "group's completion run exists once the group's last member finished)"
        )


class PermanentError(OutboxError):
    """The handler failed in a way that retrying cannot fix; the run goes to the DLQ now.

    Subclass it (or list exception types in ``@task(permanent=...)``) for validation,
    forbidden and not-found errors.
    """

    code = "permanent"


PermanentFailure = PermanentError
"""Alias kept for the name used in the style guide."""


class ValidationFailed(PermanentError):
    """The payload or the state it refers to is invalid; retrying cannot help."""

    code = "validation-failed"


class Forbidden(PermanentError):
    """The run is not allowed to do what it asks."""

    code = "forbidden"


class NotFound(PermanentError):
    """Something the run needs does not exist."""

    code = "not-found"


class HandlerCommitForbidden(PermanentError):
    """A handler called ``commit()`` on ``ctx.session``.

    The worker commits the handler's session itself, in the same transaction that marks
    the run ``succeeded``; a commit inside the handler would make its effects permanent
    even when the attempt then fails, and repeat them on the retry. Use ``flush()`` to get
    generated ids. Raised by the session's commit, so the attempt fails permanently.
    """

    code = "handler-commit-forbidden"

    def __init__(self, task: str) -> None:
        self.task = task
        super().__init__(
            f"task {task!r}: ctx.session.commit() inside a handler; the worker commits the session "
            "with the run's success (use flush() for generated ids)"
        )


class Retry(OutboxError):
    """Retry this run after ``delay_seconds`` instead of the computed backoff.

    Attributes:
        delay_seconds: Seconds until the message becomes visible again, 0..43,200
            (SQS ChangeMessageVisibility allows at most 12 hours).
    """

    code = "retry"

    def __init__(self, delay_seconds: float, message: str | None = None) -> None:
        if isinstance(delay_seconds, bool) or not isinstance(delay_seconds, int | float):
            raise ConfigurationError(
                f"delay_seconds must be a number of seconds, got {delay_seconds!r}",
                option="Retry.delay_seconds",
            )
        if not 0 <= delay_seconds <= 43_200:
            raise ConfigurationError(
                f"delay_seconds must be within 0..43200, got {delay_seconds}",
                option="Retry.delay_seconds",
            )
        self.delay_seconds = delay_seconds
        super().__init__(message or f"retry requested in {delay_seconds:g} s")


class AttemptTimeout(OutboxError):
    """The handler did not finish within its per-attempt timeout.

    Attributes:
        timeout_seconds: The limit that expired.
    """

    code = "attempt-timeout"

    def __init__(self, timeout_seconds: float) -> None:
        self.timeout_seconds = timeout_seconds
        super().__init__(f"attempt exceeded its {timeout_seconds:g} s timeout")


class InvalidEndpoint(OutboxError):
    """A webhook endpoint setting is invalid (URL, events, secret, tenant).

    Raised by :mod:`sqla_outbox.webhooks` when an endpoint is created or changed, before
    anything reaches the database.

    Attributes:
        field: The endpoint field at fault (``url``, ``events``, ``secret``, ...).
    """

    code = "invalid-endpoint"

    def __init__(self, field: str, problem: str) -> None:
        self.field = field
        self.problem = problem
        super().__init__(f"webhook endpoint {field}: {problem}")


class WebhookRefused(PermanentError):
    """A webhook delivery failed in a way that repeats on every attempt; it is not retried.

    The destination was refused by the SSRF guard (not http(s), or an address that is not
    public), or the receiver answered with a redirect or a 4xx status other than 429
    (``410 Gone`` also disables the endpoint).

    Attributes:
        reason: ``destination-refused``, ``redirect``, ``gone`` or ``client-error``.
    """

    code = "webhook-refused"

    def __init__(self, reason: str, message: str) -> None:
        self.reason = reason
        super().__init__(f"{reason}: {message}")


class WebhookFailed(OutboxError):
    """A webhook delivery failed in a way another attempt may fix (a transient failure).

    5xx and 429 responses, timeouts, refused or reset connections, and names that do not
    resolve (yet). The run is retried with the task's backoff; a ``Retry-After`` the receiver
    sent only lengthens that delay (the next attempt waits the longer of the two), so a
    receiver asking for 2 s cannot make every attempt run out within seconds.

    Attributes:
        reason: ``server-error``, ``rate-limited``, ``timeout``, ``connection`` or ``dns``.
        retry_after_seconds: The receiver's ``Retry-After`` in seconds (already capped), or
            None when it sent none.
    """

    code = "webhook-failed"

    def __init__(self, reason: str, message: str, *, retry_after_seconds: float | None = None) -> None:
        self.reason = reason
        self.retry_after_seconds = retry_after_seconds
        super().__init__(f"{reason}: {message}")


class InvalidControl(OutboxError):
    """A ``Cancel`` or ``Reschedule`` names no run or has inconsistent options.

    Raised at construction or ``session.add``; nothing was changed.

    Attributes:
        control: ``Cancel`` or ``Reschedule``.
    """

    code = "invalid-control"

    def __init__(self, control: str, message: str) -> None:
        self.control = control
        super().__init__(f"{control}: {message}")


class ResultNotSerializable(PermanentError):
    """The handler returned a value that is not plain JSON; the run failed permanently.

    Attributes:
        task: The task whose handler returned it.
    """

    code = "result-not-serializable"

    def __init__(self, task: str, detail: str) -> None:
        self.task = task
        super().__init__(
            f"task {task!r} returned a value that is not plain JSON ({detail}); return a dict, "
            "list, str, int, float (finite), bool or None"
        )


class ResultTooLarge(PermanentError):
    """The handler's result is larger than ``result_max_bytes``; the run failed permanently.

    Attributes:
        task: The task whose handler returned it.
        size_bytes: Size of the result as UTF-8 JSON. limit_bytes: ``result_max_bytes``.
    """

    code = "result-too-large"

    def __init__(self, task: str, *, size_bytes: int, limit_bytes: int) -> None:
        self.task = task
        self.size_bytes = size_bytes
        self.limit_bytes = limit_bytes
        super().__init__(
            f"task {task!r} returned a result of {size_bytes} bytes of JSON, over the "
            f"{limit_bytes}-byte limit (setting result_max_bytes); store large outputs "
            "elsewhere and return a reference"
        )


class ResultTimeout(OutboxError, TimeoutError):
    """The run did not finish within the wait given to ``results.get_result``.

    Attributes:
        run_id: The run waited for. status: Its status when the wait ended.
        waited_seconds: How long the call waited.
    """

    code = "result-timeout"

    def __init__(self, run_id: uuid.UUID, *, status: str, waited_seconds: float) -> None:
        self.run_id = run_id
        self.status = status
        self.waited_seconds = waited_seconds
        OutboxError.__init__(self, f"run {run_id} is still {status} after waiting {waited_seconds:.3g} s")


class InvalidFlowControl(OutboxError):
    """A pause, resume, weight or rate limit names no valid target or value (exactly one
    of task, tenant or queue; a known queue name; a weight within 1..1000; a rate limit
    >= 0). Raised before anything is written."""

    code = "invalid-flow-control"
