"""The run life cycle: who may change a run, and by which rule. One home for it.

Every statement that changes a run after it was dispatched lives in this package: the
``task_runs`` row (its status, lease, attempts, verdict), its ``task_run_trail`` rows, and
its outbox row once written (sent, failed to send, parked, held, deferred, rescheduled,
cancelled, requeued, purged). The worker, the relay, the operator commands, the inline test
runner and the application's ``Cancel``/``Reschedule`` call these modules; nothing else
writes those tables (``tests/unit/test_lifecycle_rules.py`` fails when something does).
Creating a run is :mod:`sqla_outbox.write`'s, in the application's flush.

* :mod:`~sqla_outbox.lifecycle.states` — the states and the declared transitions (from,
  to, who, which function), generated into ``docs/lifecycle.md``.
* :mod:`~sqla_outbox.lifecycle.verdict` — the pure verdict on an attempt (succeed, retry
  after N seconds, fail), used by the worker and the inline runner alike.
* :mod:`~sqla_outbox.lifecycle.retry` — the retry rules: tries, backoff and jitter,
  ``Retry(...)`` and ``Retry-After``, send backoff, deferral delays.
* :mod:`~sqla_outbox.lifecycle.columns` — one column list per table for the statements that
  write an outbox row or a trail row.
* Statements, by who runs them: :mod:`~sqla_outbox.lifecycle.attempts` (the worker's lease
  and verdicts), :mod:`~sqla_outbox.lifecycle.deferral` (a worker handing a run back to the
  outbox), :mod:`~sqla_outbox.lifecycle.sending` (the relay), :mod:`~sqla_outbox.lifecycle.
  controls` (``Cancel``/``Reschedule``), :mod:`~sqla_outbox.lifecycle.operator` (requeue,
  unpark, re-send), :mod:`~sqla_outbox.lifecycle.retention` (the purge).

Imports only the package's foundation and :mod:`sqla_outbox.controls` (the application's
control objects): never the relay, the worker or SQS, so the application side may use it.
"""
