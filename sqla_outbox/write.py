"""Writing prepared runs: the ``task_runs`` rows and their outbox rows in one statement.

One flush's dispatches and publishes become a single ``INSERT ... SELECT`` statement
reading its rows from one JSON parameter (``json_to_recordset``; a flush with a single run
uses the same statement shape with scalar parameters, which is cheaper) whose
data-modifying CTEs insert the runs (``ON CONFLICT DO NOTHING`` for idempotency keys and
caller-chosen run ids) and, for the runs actually inserted, the outbox rows in
``outbox_messages`` or ``platform_outbox_messages``. The statement text is the same for
any number of rows, so drivers that prepare statements reuse one plan, and a flush costs
one round trip whatever it holds.

``available_at`` is computed on the database clock (``clock_timestamp() + delay``), so a
skewed application clock or a long transaction never shifts it, and the run row and the
outbox row get the same value.

A flush that publishes a webhook event uses a variant of the statement whose input also
holds that event's deliveries, one per subscribed, enabled endpoint of the tenant, found
by a join on ``webhook_endpoints`` (:mod:`sqla_outbox.webhook_fanout`); other flushes
never read that table.

With the PostgreSQL wake on (``wake_mode``), the statement also ends with one
``pg_notify`` when it inserted a run, delivered to the relay only if the transaction commits.

A run that did not insert resolved to an existing run: for an idempotency key, the
unfinished run with the same task + tenant + key (looked up in a second statement, which
sees runs committed while this one waited on the unique index); for a caller-chosen
``run_id``, that run.
"""

from __future__ import annotations

import datetime as dt
import json
import uuid
from collections.abc import Sequence
from typing import Any

from sqlalchemy import BigInteger, DateTime, Integer, Interval, SmallInteger, Text, bindparam, text
from sqlalchemy.dialects.postgresql import ARRAY, UUID
from sqlalchemy.engine import Connection
from sqlalchemy.sql.elements import BindParameter

from sqla_outbox import driver_sql, errors, webhook_fanout
from sqla_outbox.dispatch import Prepared, PreparedGroup, PreparedRun
from sqla_outbox.types import UNFINISHED_STATUSES, WAKE_CHANNEL
from sqla_outbox.webhook_fanout import PreparedFanout

_WAKE_CTE = f"""
wake AS (SELECT pg_notify('{WAKE_CHANNEL}', '') FROM runs LIMIT 1)"""
"""The PostgreSQL wake, riding on the write statement: one ``pg_notify`` when the statement
inserted at least one run. PostgreSQL delivers a notification only when its transaction
commits (and folds identical ones of one transaction into one), so a rolled-back dispatch
wakes nobody and a transaction of many flushes wakes the relay once. The function is
volatile, so the CTE is not inlined; the final ``SELECT`` references it, so it runs."""


def _finish(ctes: str, final_select: str, notify: bool) -> str:
    """``ctes`` (``WITH ...`` up to and including the writing CTEs, no final SELECT)
    completed with ``final_select`` (which reads ``runs``), plus the wake when ``notify``."""
    if notify:
        return f"{ctes.rstrip()},{_WAKE_CTE}\n{final_select} LEFT JOIN wake ON true\n"
    return f"{ctes.rstrip()}\n{final_select}\n"


_RUN_ROWS = """ROWS FROM (json_to_recordset(CAST(:rows AS json)) AS (
        run_id uuid, task text, event text, queue text, tenant_id bigint, idempotency_key text,
        delay interval, available_at timestamptz, envelope text, priority smallint
    )) WITH ORDINALITY AS t(run_id, task, event, queue, tenant_id, idempotency_key,
                           delay, available_at, envelope, priority, ord)"""
"""The flush's runs, from one JSON parameter (:func:`_rows_json`): one array of objects,
encoded by ``json.dumps`` in C, where ten PostgreSQL arrays cost psycopg's Python array
dumper (quoting and escaping every envelope) several times the statement itself."""

_WRITES = """
runs AS (
    INSERT INTO task_runs (run_id, task, event, queue, tenant_id, idempotency_key,
                           available_at, priority)
    SELECT run_id, task, event, queue, tenant_id, idempotency_key,
           COALESCE(available_at, clock_timestamp() + delay), priority
    FROM input ORDER BY ord
    ON CONFLICT DO NOTHING
    RETURNING run_id, available_at
),
tenant_rows AS (
    INSERT INTO outbox_messages (tenant_id, run_id, queue, envelope, available_at, priority)
    SELECT i.tenant_id, i.run_id, i.queue, CAST(i.envelope AS jsonb), r.available_at, i.priority
    FROM input AS i JOIN runs AS r ON r.run_id = i.run_id
    WHERE i.tenant_id IS NOT NULL
    ORDER BY i.ord
),
platform_rows AS (
    INSERT INTO platform_outbox_messages (run_id, queue, envelope, available_at, priority)
    SELECT i.run_id, i.queue, CAST(i.envelope AS jsonb), r.available_at, i.priority
    FROM input AS i JOIN runs AS r ON r.run_id = i.run_id
    WHERE i.tenant_id IS NULL
    ORDER BY i.ord
)
"""

_RUN_BINDPARAMS = (bindparam("rows", type_=Text),)

_INSERT = {
    notify: text(
        _finish(
            f"WITH input AS (SELECT * FROM {_RUN_ROWS}),{_WRITES}", "SELECT runs.run_id FROM runs", notify
        )
    ).bindparams(*_RUN_BINDPARAMS)
    for notify in (False, True)
}

# A flush holding a webhook event: the same writes, with the event's deliveries (one per
# subscribed, enabled endpoint of the tenant, found by a join) added to the input.
_INSERT_WITH_WEBHOOKS = {
    notify: text(
        _finish(
            f"WITH {webhook_fanout.FANOUT_CTES} input AS ("
            "SELECT t.*, CAST(NULL AS bigint) AS endpoint_id, CAST(NULL AS bigint) AS fan_ord"
            f" FROM {_RUN_ROWS}"
            f" UNION ALL {webhook_fanout.FANOUT_INPUT}),{_WRITES}",
            "SELECT r.run_id, i.endpoint_id, i.fan_ord FROM runs AS r JOIN input AS i USING (run_id)",
            notify,
        )
    ).bindparams(*_RUN_BINDPARAMS, *webhook_fanout.BINDPARAMS)
    for notify in (False, True)
}


def _insert_one(table: str, notify: bool, plain: bool) -> Any:
    """The single-run variant: scalar parameters instead of the JSON rows (about a third
    cheaper for the common one-dispatch flush: no encoding, no ``json_to_recordset``).

    ``plain``: the run has no event, no idempotency key, no ``available_at`` and no delay
    (the usual dispatch), so those four parameters are left out and ``available_at`` is
    ``clock_timestamp()``: the same row, six parameters to bind instead of ten.

    Without the PostgreSQL wake the statement returns no rows: it is the outbox row's
    ``INSERT`` (from the run the ``runs`` CTE inserted, if any), and its row count, 1 or 0,
    says whether the run was new.
    """
    tenant_column = "tenant_id, " if table == "outbox_messages" else ""
    tenant_value = ":tenant_id, " if table == "outbox_messages" else ""
    if plain:
        run_insert = """INSERT INTO task_runs (run_id, task, queue, tenant_id, available_at, priority)
    VALUES (:run_id, :task, :queue, :tenant_id, clock_timestamp(), :priority)"""
    else:
        run_insert = """INSERT INTO task_runs (run_id, task, event, queue, tenant_id, idempotency_key,
                           available_at, priority)
    VALUES (:run_id, :task, :event, :queue, :tenant_id, :key,
            COALESCE(CAST(:available_at AS timestamptz), clock_timestamp() + CAST(:delay AS interval)),
            :priority)"""
    runs = f"""
WITH runs AS (
    {run_insert}
    ON CONFLICT DO NOTHING
    RETURNING run_id, available_at
)"""
    outbox_insert = f"""INSERT INTO {table} ({tenant_column}run_id, queue, envelope, available_at, priority)
    SELECT {tenant_value}run_id, :queue, CAST(:envelope AS jsonb), available_at, :priority FROM runs"""
    binds: list[BindParameter[Any]] = [
        bindparam("run_id", type_=UUID(as_uuid=True)),
        bindparam("tenant_id", type_=BigInteger),
        bindparam("envelope", type_=Text),
        bindparam("priority", type_=SmallInteger),
    ]
    if not plain:
        binds += [
            bindparam("delay", type_=Interval),
            bindparam("available_at", type_=DateTime(timezone=True)),
        ]
    if notify:  # the wake's CTE needs a final SELECT that reads it
        sql = _finish(f"{runs},\nrows AS (\n    {outbox_insert}\n)", "SELECT runs.run_id FROM runs", notify)
    else:  # the outbox INSERT is the statement: its row count says whether the run was new
        sql = f"{runs}\n{outbox_insert}\n"
    return text(sql).bindparams(*binds)


_INSERT_ONE = {
    (table, notify, plain): _insert_one(table, notify, plain)
    for table in ("outbox_messages", "platform_outbox_messages")
    for notify in (False, True)
    for plain in (False, True)
}

_UNFINISHED = ", ".join(f"'{s}'" for s in UNFINISHED_STATUSES)
_FIND_BY_KEY = text(
    f"""
SELECT run_id, task, tenant_id, idempotency_key FROM task_runs
WHERE idempotency_key = ANY(CAST(:keys AS text[]))
  AND task = ANY(CAST(:tasks AS text[]))
  AND status IN ({_UNFINISHED})
"""
).bindparams(
    bindparam("keys", type_=ARRAY(Text)),
    bindparam("tasks", type_=ARRAY(Text)),
)

_FIND_BY_ID = text("SELECT run_id, task, tenant_id FROM task_runs WHERE run_id = ANY(:run_ids)").bindparams(
    bindparam("run_ids", type_=ARRAY(UUID(as_uuid=True)))
)

_Key = tuple[str, int | None, str]

_INSERT_ATTEMPTS = 3
"""INSERTs a flush tries for a keyed run whose rival finishes between the INSERT and the
lookup that resolves it; after that, :class:`~sqla_outbox.errors.IdempotencyKeyContended`."""


def write_runs(connection: Connection, prepared: Sequence[Prepared], *, notify: bool = False) -> int:
    """Insert the prepared runs and their outbox rows; set each run's ``resolved_run_id``.

    Args:
        connection: The flushing session's connection (inside its transaction).
        prepared: Prepared runs in dispatch order, and the fan-outs of webhook events
            (:class:`~sqla_outbox.webhook_fanout.PreparedFanout`), whose delivery runs are
            written by the same statement.
        notify: Also ``NOTIFY`` the relay (the PostgreSQL wake, ``settings.wake_notify``),
            in the same statement when it inserts a run; delivered only if the transaction
            commits.

    Returns:
        Number of outbox rows written (runs that did not resolve to an existing run,
        webhook deliveries included).

    Raises:
        sqlalchemy.exc.DBAPIError: From the database, e.g. a tenant foreign key
            violation; the session's transaction is then rolled back by SQLAlchemy.
        InvalidDispatch: A caller-chosen ``run_id`` belongs to another task's or tenant's
            run (in the database, or twice in this flush).
        IdempotencyKeyContended: A keyed run's rival kept finishing while it was resolved.
            For either, nothing of the flush remains written: what the call inserted before
            it found the problem is deleted again (:func:`_take_back`), so a caller that
            catches the error and commits writes none of it.
    """
    if len(prepared) == 1 and type(prepared[0]) is PreparedRun:
        return _write_single(connection, prepared[0], notify)
    runs: list[PreparedRun] = []
    fanouts: list[PreparedFanout] = []
    groups: list[PreparedGroup] = []
    for item in prepared:
        if isinstance(item, PreparedRun):
            runs.append(item)
        elif isinstance(item, PreparedFanout):
            fanouts.append(item)
        else:
            groups.append(item)
    unique: list[PreparedRun] = []
    twins: list[tuple[PreparedRun, PreparedRun]] = []
    first_by_key: dict[_Key, PreparedRun] = {}
    first_by_id: dict[uuid.UUID, PreparedRun] = {}
    for run in runs:
        key = _key(run)
        earlier = first_by_key.get(key) if key else None
        earlier = earlier or first_by_id.get(run.run_id)
        if earlier is not None:  # same key or run id twice in one flush
            if key is None or _key(earlier) != key:
                _check_same_run(run, earlier.task, earlier.tenant_id)
            twins.append((run, earlier))
            continue
        if key:
            first_by_key[key] = run
        first_by_id[run.run_id] = run
        unique.append(run)

    if groups:
        _write_groups(connection, groups)
    written = 0
    inserted_ids: list[uuid.UUID] = []  # taken back if this call fails after writing
    pending = unique
    try:
        for _ in range(_INSERT_ATTEMPTS):
            if not pending and not fanouts:
                break
            inserted = set()
            for run_id, endpoint_id, fan_ord in _execute(connection, pending, fanouts, notify):
                inserted_ids.append(run_id)
                if endpoint_id is None:
                    inserted.add(run_id)
                else:  # a webhook delivery (deduplicated ones are simply not inserted)
                    assert fan_ord is not None
                    fanouts[fan_ord - 1].run_ids[endpoint_id] = run_id
                    written += 1
            fanouts = []  # written once; only ordinary runs may need another try
            written += len(inserted)
            missing = []
            for run in pending:
                if run.run_id in inserted:
                    run.resolved_run_id = run.run_id
                    run.deduplicated = False
                else:
                    run.deduplicated = True
                    missing.append(run)
            pending = _resolve_existing(connection, missing)
        if pending:
            raise _contended(pending[0])
        for run, earlier in twins:
            run.resolved_run_id = earlier.resolved_run_id
            run.deduplicated = True
        for group in groups:
            driver_sql.execute(
                connection, _JOIN_GROUP, {"group_id": group.group_id, "run_ids": group.member_run_ids}
            )
    except BaseException as exc:
        if isinstance(exc, errors.DispatchError):
            _take_back(connection, inserted_ids, [group.group_id for group in groups])
        forget(prepared)
        raise
    return written


def _write_single(connection: Connection, run: PreparedRun, notify: bool) -> int:
    """:func:`write_runs` for a flush of one run, the usual flush: the same statements and
    outcome, without the bookkeeping only several runs, fan-outs or groups need (twins in one
    flush, per-run sets and lists: about 20,000 instructions of a one-dispatch transaction's
    450,000: ADR 0017, item 11; ``docs/benchmarks.md``)."""
    pending = [run]
    try:
        for _ in range(_INSERT_ATTEMPTS):  # as write_runs
            if _execute(connection, pending, (), notify):
                run.resolved_run_id = run.run_id
                run.deduplicated = False
                return 1
            run.deduplicated = True
            pending = _resolve_existing(connection, pending)
            if not pending:
                return 0
        raise _contended(run)
    except BaseException:
        forget([run])
        raise


def forget(prepared: Sequence[Prepared]) -> None:
    """Undo what a write set on its prepared items, so that the objects of a flush that
    failed read as never written (``resolved_run_id`` None, ``deduplicated`` False, no
    webhook deliveries), as their rows are gone (:func:`_take_back`, or the failed
    transaction's rollback). Called by :func:`write_runs` when it fails, and by the flush
    when a later statement of the same flush fails."""
    for item in prepared:
        if isinstance(item, PreparedRun):
            item.resolved_run_id = None
            item.deduplicated = False
        elif isinstance(item, PreparedFanout):
            item.run_ids.clear()


_TAKE_BACK = text(
    """
WITH runs AS (DELETE FROM task_runs WHERE run_id = ANY(:run_ids)),
tenant_rows AS (DELETE FROM outbox_messages WHERE run_id = ANY(:run_ids)),
platform_rows AS (DELETE FROM platform_outbox_messages WHERE run_id = ANY(:run_ids))
DELETE FROM task_groups WHERE id = ANY(:group_ids)
"""
).bindparams(
    bindparam("run_ids", type_=ARRAY(UUID(as_uuid=True))),
    bindparam("group_ids", type_=ARRAY(UUID(as_uuid=True))),
)


def _take_back(connection: Connection, run_ids: list[uuid.UUID], group_ids: list[uuid.UUID]) -> None:
    """Delete what a failing :func:`write_runs` inserted before it found the problem (the
    runs of its first statement, their outbox rows, the flush's groups).

    A flush whose objects are all outbox objects writes from ``before_flush``, where
    SQLAlchemy does not roll the transaction back on an error, so an application that
    catches the error and commits would otherwise commit part of the flush. The rows are
    this transaction's own (no other transaction sees them), so the delete meets no lock;
    a wake the statement carried (``NOTIFY``) only makes the relay look.
    """
    if run_ids or group_ids:
        driver_sql.execute(connection, _TAKE_BACK, {"run_ids": run_ids, "group_ids": group_ids})


def _contended(run: PreparedRun) -> errors.IdempotencyKeyContended:
    return errors.IdempotencyKeyContended(
        run.task,
        "the run holding this idempotency key finished between the INSERT and the lookup "
        f"{_INSERT_ATTEMPTS} times in a row (another process keeps dispatching and finishing it); "
        "nothing of this flush was written: retry the transaction",
    )


def _execute(
    connection: Connection, runs: Sequence[PreparedRun], fanouts: Sequence[PreparedFanout], notify: bool
) -> list[tuple[uuid.UUID, int | None, int | None]]:
    """Run the flush's statement; return ``(run_id, endpoint_id, fan_ord)`` per inserted run
    (the last two set for webhook deliveries only)."""
    if fanouts:
        params = {**_params(runs), **webhook_fanout.params(fanouts, first_ord=len(runs))}
        return [
            (r[0], r[1], r[2]) for r in driver_sql.execute(connection, _INSERT_WITH_WEBHOOKS[notify], params)
        ]
    if len(runs) == 1:
        run = runs[0]
        table = "platform_outbox_messages" if run.tenant_id is None else "outbox_messages"
        one: dict[str, Any] = {
            "run_id": run.run_id,
            "task": run.task,
            "queue": run.queue,
            "tenant_id": run.tenant_id,
            "envelope": run.envelope_json,
            "priority": run.priority,
        }
        plain = (
            run.event is None and run.idempotency_key is None and run.available_at is None and not run.delay
        )
        if not plain:  # the statement that also binds the event, key and when it is due
            one.update(
                event=run.event, key=run.idempotency_key, delay=run.delay, available_at=run.available_at
            )
        result = driver_sql.execute(connection, _INSERT_ONE[table, notify, plain], one)
        if not notify:
            return [(run.run_id, None, None)] if result.rowcount == 1 else []
    else:
        result = driver_sql.execute(connection, _INSERT[notify], _params(runs))
    return [(r[0], None, None) for r in result]


def _key(run: PreparedRun) -> _Key | None:
    if run.idempotency_key is None:
        return None
    return (run.task, run.tenant_id, run.idempotency_key)


def _resolve_existing(connection: Connection, missing: list[PreparedRun]) -> list[PreparedRun]:
    """Point runs that lost an ON CONFLICT at the existing run; return those still unresolved.

    A keyed run whose rival finished between the two statements is returned for another
    insert attempt (its key is free again).
    """
    if not missing:  # every run was new: the usual flush
        return []
    keyed = [run for run in missing if run.idempotency_key is not None]
    found: dict[_Key, uuid.UUID] = {}
    if keyed:
        rows = driver_sql.execute(
            connection,
            _FIND_BY_KEY,
            {
                "keys": sorted({run.idempotency_key for run in keyed if run.idempotency_key}),
                "tasks": sorted({run.task for run in keyed}),
            },
        )
        found = {(row.task, row.tenant_id, row.idempotency_key): row.run_id for row in rows}
    by_id = [run.run_id for run in missing if _key(run) is None or _key(run) not in found]
    existing = {}
    if by_id:  # lost on the run_id itself: a caller-chosen run_id that already exists
        existing = {
            row.run_id: row for row in driver_sql.execute(connection, _FIND_BY_ID, {"run_ids": by_id})
        }
    retry = []
    for run in missing:
        key = _key(run)
        other = existing.get(run.run_id)
        if key is not None and key in found:
            run.resolved_run_id = found[key]
        elif other is not None:
            _check_same_run(run, other.task, other.tenant_id)
            run.resolved_run_id = run.run_id
        elif key is None:  # (it existed a moment ago and was purged since: nothing to join)
            run.resolved_run_id = run.run_id
        else:
            retry.append(run)  # the keyed rival finished between the two statements
    return retry


def _check_same_run(run: PreparedRun, task: str, tenant_id: int | None) -> None:
    """A caller-chosen ``run_id`` resolves quietly only to a run of the same task and tenant.

    Raises:
        InvalidDispatch: The run_id belongs to another task's or tenant's run: resolving to
            it would silently drop this dispatch.
    """
    if (task, tenant_id) != (run.task, run.tenant_id):
        raise errors.InvalidDispatch(
            run.task,
            f"run_id {run.run_id} already belongs to a run of task {task!r} (tenant {tenant_id}); "
            f"a run_id chosen by the caller must name the same task and tenant "
            f"(this dispatch: task {run.task!r}, tenant {run.tenant_id})",
        )


def _params(runs: Sequence[PreparedRun]) -> dict[str, Any]:
    return {"rows": _rows_json(runs)}


def _rows_json(runs: Sequence[PreparedRun]) -> str:
    """The runs as the JSON array :data:`_RUN_ROWS` reads: one object per run, in order.

    Every value is text PostgreSQL's input functions read exactly: the UUID's canonical
    form, the delay as days, seconds and microseconds, ``available_at`` in ISO 8601 with its
    offset. The envelope goes as the JSON text already encoded (a JSON string here, so the
    statement stores the very text :meth:`PreparedRun.envelope_json` holds).
    """
    return json.dumps(
        [
            {
                "run_id": str(r.run_id),
                "task": r.task,
                "event": r.event,
                "queue": r.queue,
                "tenant_id": r.tenant_id,
                "idempotency_key": r.idempotency_key,
                "delay": _interval(r.delay),
                "available_at": None if r.available_at is None else _timestamptz(r.available_at),
                "envelope": r.envelope_json,
                "priority": r.priority,
            }
            for r in runs
        ],
        ensure_ascii=False,
        separators=(",", ":"),
    )


def _interval(delay: dt.timedelta) -> str:
    """``delay`` as PostgreSQL interval input, exact to the microsecond."""
    if not delay:
        return "0"
    return f"{delay.days} days {delay.seconds} seconds {delay.microseconds} microseconds"


def _timestamptz(value: dt.datetime) -> str:
    """A timezone-aware ``value`` as PostgreSQL timestamptz input (ISO 8601 with offset)."""
    offset = value.utcoffset()
    if offset is not None and offset.microseconds:  # an offset PostgreSQL cannot read
        value = value.astimezone(dt.UTC)
    return value.isoformat()


_INSERT_GROUPS = text(
    """
INSERT INTO task_groups (id, tenant_id, total, remaining, completion_run_id, completion_task,
                         completion_queue, completion_envelope, completion_delay)
SELECT id, tenant_id, total, total, completion_run_id, completion_task, completion_queue,
       CAST(envelope AS jsonb), delay
FROM unnest(CAST(:ids AS uuid[]), CAST(:tenant_ids AS bigint[]), CAST(:totals AS integer[]),
            CAST(:completion_run_ids AS uuid[]), CAST(:tasks AS text[]), CAST(:queues AS text[]),
            CAST(:envelopes AS text[]), CAST(:delays AS interval[]))
     AS g(id, tenant_id, total, completion_run_id, completion_task, completion_queue, envelope, delay)
"""
).bindparams(
    bindparam("ids", type_=ARRAY(UUID(as_uuid=True))),
    bindparam("tenant_ids", type_=ARRAY(BigInteger)),
    bindparam("totals", type_=ARRAY(Integer)),
    bindparam("completion_run_ids", type_=ARRAY(UUID(as_uuid=True))),
    bindparam("tasks", type_=ARRAY(Text)),
    bindparam("queues", type_=ARRAY(Text)),
    bindparam("envelopes", type_=ARRAY(Text)),
    bindparam("delays", type_=ARRAY(Interval)),
)

_JOIN_GROUP = text("UPDATE task_runs SET group_id = :group_id WHERE run_id = ANY(:run_ids)").bindparams(
    bindparam("group_id", type_=UUID(as_uuid=True)),
    bindparam("run_ids", type_=ARRAY(UUID(as_uuid=True))),
)
"""Members join their group after their runs are written (the statement sets no status, so
the group trigger, ``AFTER UPDATE OF status``, does not fire)."""


def _write_groups(connection: Connection, groups: Sequence[PreparedGroup]) -> None:
    """Insert the ``task_groups`` rows (before their members exist; no foreign key ties them)."""
    driver_sql.execute(
        connection,
        _INSERT_GROUPS,
        {
            "ids": [g.group_id for g in groups],
            "tenant_ids": [g.completion.tenant_id for g in groups],
            "totals": [len(g.member_run_ids) for g in groups],
            "completion_run_ids": [g.completion.run_id for g in groups],
            "tasks": [g.completion.task for g in groups],
            "queues": [g.completion.queue for g in groups],
            "envelopes": [g.completion.envelope_json for g in groups],
            "delays": [g.completion.delay for g in groups],
        },
    )
