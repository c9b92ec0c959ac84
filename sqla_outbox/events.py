"""Session listeners: turn pending ``Dispatch``/``Publish`` objects into rows, wake after commit.

``Cancel``/``Reschedule`` objects (:mod:`sqla_outbox.controls`) go the same way: checked
at ``session.add``, taken out of the session at flush, applied as one statement each
(:mod:`sqla_outbox.control_write`) after the flush's dispatches, in the order added. A
reschedule that moved a row counts as a written row (the commit wakes the relay).

:func:`install` attaches the listeners to a session class, ``sessionmaker``,
``scoped_session``, ``AsyncSession``/``async_sessionmaker`` or a single session. It is
explicit (nothing happens at import) and idempotent: installing on the same target again
updates its settings and catalog but never adds a second set of listeners, and a
``Dispatch`` is turned into rows at most once even when overlapping installs (say, on
``Session`` and on a ``sessionmaker``) both see it.

What each hook does, and what it may do:

``before_attach`` (``session.add``)
    Checks the object against the catalog and computes its rows (task/event known, queue,
    tenant scope, message size). Raising here keeps the object out of the session.
``after_attach``
    During a flush only (a ``Dispatch`` added by the application's own ``before_flush``
    listener, the audit pattern): takes it out of the session at once and defers its rows
    to this flush's ``after_flush`` (or the commit), since the flush plan no longer passes
    through ``before_flush``.
``before_flush``
    Takes the pending objects out of the session (they are never INSERTed as themselves;
    ``make_transient``, which is ``session.expunge`` without the cascade walk: the mapped
    classes have no relationships).
    When the flush holds nothing else, writes their rows at once; otherwise leaves them
    for ``after_flush``, so rows the same flush inserts (a new tenant the outbox row
    references) exist first.
``after_flush``
    Writes the rows left by ``before_flush``: one statement per flush
    (``sqla_outbox.write``; with the PostgreSQL wake it also carries the ``NOTIFY``, which
    PostgreSQL delivers only if the transaction commits). Still inside the flush's
    transaction; SQL is allowed.
``before_commit``
    Safety net: writes rows whose flush ended early, so nothing is lost.
``after_commit``
    The transaction is over and no SQL may be emitted. For the root transaction, if any
    outbox row survived (rows of rolled-back savepoints do not count), schedules one
    Valkey wake (the waker's thread does the LPUSH; the commit never waits for Valkey).
    A savepoint release (``after_commit`` also fires for it) only carries its count to the
    parent. Wake failures are logged and counted, never raised.
``after_transaction_end`` / ``after_soft_rollback``
    Drop the counts of rolled-back savepoints and the state of finished transactions.

The same path serves a plain ``Session``, ``AsyncSession`` (its ``sync_session``; the
event loop is never blocked by the wake), ``begin_nested()``
savepoints, sessions joined to an outer transaction (test fixtures,
``Session(bind=op.get_bind())`` in an Alembic migration; there the wake is sent when the
session commits and the sweep covers an outer commit that comes later).
"""

from __future__ import annotations

import logging
import weakref
from typing import Any

from sqlalchemy import event
from sqlalchemy import inspect as _instance_state
from sqlalchemy.orm import Session, make_transient, scoped_session, sessionmaker
from sqlalchemy.orm.session import SessionTransaction
from sqlalchemy.orm.state import InstanceState

from sqla_outbox import errors
from sqla_outbox.catalog import Catalog
from sqla_outbox.config import OutboxSettings
from sqla_outbox.control_write import apply_controls
from sqla_outbox.controls import Control
from sqla_outbox.dispatch import Prepared, scheduled_types
from sqla_outbox.logging import log_extra
from sqla_outbox.wakeup import Waker
from sqla_outbox.write import forget, write_runs

SCHEDULED = scheduled_types()
_TAKEN = (*SCHEDULED, Control)
"""What the listeners take out of the session at flush."""

logger = logging.getLogger(__name__)

_STATE_KEY = "sqla_outbox.state"
_HOOKS = (
    "before_attach",
    "after_attach",
    "before_flush",
    "after_flush",
    "before_commit",
    "after_commit",
    "after_transaction_end",
    "after_soft_rollback",
)
_HOOK_OPTIONS: dict[str, dict[str, Any]] = {"before_attach": {"raw": True}, "after_attach": {"raw": True}}
"""The attach hooks fire for every object a session adds, the application's own included:
``raw=True`` passes the ``InstanceState`` as it is, without SQLAlchemy's per-object wrapper
that looks up the instance (the hooks look at ``state.class_`` first)."""


class _SessionState:
    """Per-session bookkeeping kept in ``session.info`` (made by the first dispatching flush).

    Attributes:
        deferred: Prepared rows waiting for this flush's ``after_flush`` (or the commit).
        controls: Cancel/Reschedule objects waiting likewise, in the order added.
        written: Outbox rows written per open transaction (root or savepoint).
        released: Savepoints released, whose count moves to the parent when they end.
    """

    __slots__ = ("controls", "deferred", "released", "written")

    def __init__(self) -> None:
        self.deferred: list[Prepared] = []
        self.controls: list[Control] = []
        self.written: dict[SessionTransaction, int] = {}
        self.released: set[SessionTransaction] = set()


def _state(session: Session) -> _SessionState:
    state = session.info.get(_STATE_KEY)
    if state is None:
        state = session.info[_STATE_KEY] = _SessionState()
    assert isinstance(state, _SessionState)
    return state


class Installation:
    """The listeners attached to one target, with the settings and catalog they use.

    Attributes:
        settings: The :class:`OutboxSettings` in force.
        catalog: The :class:`Catalog` dispatches are checked against.
        waker: The :class:`~sqla_outbox.wakeup.Waker` (its ``stats`` count wakes).
    """

    def __init__(self, target: Any, settings: OutboxSettings, catalog: Catalog) -> None:
        self.target = target
        self.settings = settings
        self.catalog = catalog
        self.waker = Waker(settings)

    def attach(self) -> None:
        for name in _HOOKS:
            event.listen(self.target, name, getattr(self, "_" + name), **_HOOK_OPTIONS.get(name, {}))

    def detach(self) -> None:
        for name in _HOOKS:
            if event.contains(self.target, name, getattr(self, "_" + name)):
                event.remove(self.target, name, getattr(self, "_" + name))
        self.waker.close()

    # --- hooks ---------------------------------------------------------------------------
    def _before_attach(self, session: Session, state: InstanceState[Any]) -> None:
        if not issubclass(state.class_, _TAKEN):  # the application's own objects
            return
        instance = state.obj()
        if isinstance(instance, SCHEDULED):
            if "_prepared" not in vars(instance):  # made by the ORM (merge), not by __init__
                kind = type(instance).__name__
                raise TypeError(f"session.merge() of a {kind} is not supported: add it with session.add()")
            instance._prepared = instance.prepare(
                self.catalog, max_message_bytes=self.settings.max_message_bytes
            )
        elif isinstance(instance, Control):
            if "selection" not in vars(instance):
                kind = type(instance).__name__
                raise TypeError(f"session.merge() of a {kind} is not supported: add it with session.add()")
            instance.check(self.catalog)

    def _after_attach(self, session: Session, state: InstanceState[Any]) -> None:
        # A Dispatch added while the session flushes (the application's own before_flush
        # listener, an audit pattern, or a mapper event) would otherwise be INSERTed as
        # itself by this flush, whose plan no longer passes through _before_flush: take it
        # out now; after_flush (or before_commit, or the next flush) writes its rows.
        if not issubclass(state.class_, _TAKEN) or not getattr(session, "_flushing", False):
            return
        instance = state.obj()
        if isinstance(instance, SCHEDULED):
            make_transient(instance)
            assert instance._prepared is not None
            _state(session).deferred.extend(instance._prepared)
        elif isinstance(instance, Control):
            make_transient(instance)
            _state(session).controls.append(instance)

    def _before_flush(self, session: Session, flush_context: Any, instances: Any) -> None:
        new = session.new
        scheduled = [obj for obj in new if isinstance(obj, _TAKEN)]
        known = session.info.get(_STATE_KEY)
        if not scheduled and (known is None or not (known.deferred or known.controls)):
            return
        state = _state(session)
        for obj in _in_add_order(session, scheduled):
            make_transient(obj)
            if isinstance(obj, Control):
                state.controls.append(obj)
                continue
            if obj._prepared is None:  # added before the listeners existed
                self._before_attach(session, _instance_state(obj))
            assert obj._prepared is not None
            state.deferred.extend(obj._prepared)
        if len(new) > len(scheduled) or session.deleted:
            return  # after_flush writes them, after this flush's own INSERTs
        self._write_deferred(session, state)

    def _after_flush(self, session: Session, flush_context: Any = None) -> None:
        state = session.info.get(_STATE_KEY)
        if state is not None and (state.deferred or state.controls):
            self._write_deferred(session, state)

    _before_commit = _after_flush  # the safety net: rows whose flush ended early

    def _after_commit(self, session: Session) -> None:
        state = session.info.get(_STATE_KEY)
        if state is None:
            return
        nested = session.get_nested_transaction()
        if nested is not None:  # a savepoint was released; its count moves up on end
            state.released.add(nested)
            return
        root = session.get_transaction()
        total = state.written.pop(root, 0) if root is not None else 0
        state.written.clear()
        state.released.clear()
        if total:
            self._wake()

    def _after_transaction_end(self, session: Session, transaction: SessionTransaction) -> None:
        state = session.info.get(_STATE_KEY)
        if state is None:
            return
        if transaction.parent is None:
            state.written.clear()
            state.released.clear()
            state.deferred.clear()
            state.controls.clear()
            return
        if not transaction.nested:
            return
        count = state.written.pop(transaction, 0)
        if transaction in state.released:
            state.released.discard(transaction)
            parent = _owning_transaction(transaction.parent)
            if count and parent is not None:
                state.written[parent] = state.written.get(parent, 0) + count

    def _after_soft_rollback(self, session: Session, previous: SessionTransaction) -> None:
        state = session.info.get(_STATE_KEY)
        if state is not None:
            state.deferred.clear()
            state.controls.clear()

    # --- helpers -------------------------------------------------------------------------
    def _write_deferred(self, session: Session, state: _SessionState) -> None:
        runs, state.deferred = state.deferred, []
        controls, state.controls = state.controls, []
        connection = session.connection()
        written = write_runs(connection, runs, notify=self.settings.wake_notify) if runs else 0
        if controls:  # after the dispatches of the same flush, in the order added
            try:
                written += apply_controls(connection, controls, notify=self.settings.wake_notify)
            except BaseException:
                forget(runs)  # the flush failed: its runs go with its transaction
                raise
        owner = session.get_nested_transaction() or session.get_transaction()
        if owner is not None and written:
            state.written[owner] = state.written.get(owner, 0) + written
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug(
                "outbox rows written",
                extra=log_extra(action="dispatch.written", runs=len(runs), rows=written),
            )

    def _wake(self) -> None:
        self.waker.wake()  # hands the LPUSH to the waker's thread; never blocks, never raises


def _in_add_order(session: Session, objects: list[Any]) -> list[Any]:
    """``objects`` in the order they were added (``session.new`` is a set-like view)."""
    if len(objects) < 2:
        return objects
    return sorted(objects, key=lambda obj: getattr(_instance_state(obj), "insert_order", 0) or 0)


def _owning_transaction(transaction: SessionTransaction | None) -> SessionTransaction | None:
    """The nearest savepoint or root at or above ``transaction``."""
    while transaction is not None and not transaction.nested and transaction.parent is not None:
        transaction = transaction.parent
    return transaction


_installations: weakref.WeakKeyDictionary[Any, Installation] = weakref.WeakKeyDictionary()


def _event_target(target: Any) -> Any:
    if isinstance(target, scoped_session):
        return _event_target(target.session_factory)
    async_target = _async_event_target(target)
    if async_target is not None:
        return async_target
    if isinstance(target, (sessionmaker, Session)):
        return target
    if isinstance(target, type) and issubclass(target, Session):
        return target
    raise errors.ConfigurationError(
        f"cannot install on {target!r}: pass a Session class or instance, a sessionmaker, "
        "a scoped_session, an AsyncSession or an async_sessionmaker",
        option="install(target)",
    )


def _async_event_target(target: Any) -> Any:
    """The sync session class or instance behind an asyncio session target, else None."""
    module = getattr(target if isinstance(target, type) else type(target), "__module__", "")
    if not module.startswith("sqlalchemy.ext.asyncio") and not (
        isinstance(target, type)
        and any(c.__module__.startswith("sqlalchemy.ext.asyncio") for c in target.__mro__)
    ):
        return None
    from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

    if isinstance(target, async_sessionmaker):
        sync_class = target.kw.get("sync_session_class") or Session
        if sync_class is Session:  # give this factory a class of its own
            sync_class = type("OutboxSyncSession", (Session,), {})
            target.kw["sync_session_class"] = sync_class
        return sync_class
    if isinstance(target, AsyncSession):
        return target.sync_session
    if isinstance(target, type) and issubclass(target, AsyncSession):
        return target.sync_session_class
    return None


def install(
    target: Any,
    settings: OutboxSettings | None = None,
    *,
    catalog: Catalog | None = None,
) -> Installation:
    """Attach the sqla_outbox listeners to ``target``.

    Args:
        target: ``Session`` (or a subclass: every session of that class), a
            ``sessionmaker``, a ``scoped_session``, an ``async_sessionmaker``, an
            ``AsyncSession`` class or instance, or one ``Session`` instance.
        settings: Defaults to :meth:`OutboxSettings.from_env`.
        catalog: Defaults to the file at ``settings.catalog_path``.

    Returns:
        The :class:`Installation` (the same object when ``target`` was installed before;
        its settings and catalog are then replaced).

    Raises:
        ConfigurationError: ``target`` is not something sessions come from.
        CatalogError: The catalog file is missing or invalid.
    """
    event_target = _event_target(target)
    settings = settings or OutboxSettings.from_env()
    catalog = catalog or Catalog.load(settings.catalog_path)
    existing = _installations.get(event_target)
    if existing is not None:
        if existing.settings != settings:
            existing.waker.close()
            existing.waker = Waker(settings)
        existing.settings = settings
        existing.catalog = catalog
        return existing
    installation = Installation(event_target, settings, catalog)
    installation.attach()
    _installations[event_target] = installation
    return installation


def uninstall(target: Any) -> None:
    """Remove the listeners :func:`install` attached to ``target`` (no-op if none)."""
    event_target = _event_target(target)
    installation = _installations.pop(event_target, None)
    if installation is not None:
        installation.detach()


def installation_for(target: Any) -> Installation | None:
    """The :class:`Installation` on ``target``, if any."""
    return _installations.get(_event_target(target))
