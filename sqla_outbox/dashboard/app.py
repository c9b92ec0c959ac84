"""The dashboard as an ASGI application (Starlette): pages, actions, authentication, CSRF.

:func:`create_app` builds it; ``python -m sqla_outbox dashboard`` serves it with uvicorn,
and an application mounts the same object inside its own (``docs/dashboard.md``).

Pages are rendered on the server (Jinja2, autoescaped, every printed string passed
through :func:`sqla_outbox.dashboard.untrusted.visible`); the overview refreshes itself
with htmx (``static/htmx.min.js``, vendored). Reads use their own engine whose sessions
are read-only (``default_transaction_read_only``) and bounded
(``statement_timeout``); the overview's readings run in parallel, one connection each.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import http
import json
import logging
import threading
import uuid
import warnings
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import urlencode, urlsplit

import jinja2
import sqlalchemy as sa
from markupsafe import Markup
from sqlalchemy.engine import Connection, Engine
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.trustedhost import TrustedHostMiddleware
from starlette.requests import Request
from starlette.responses import PlainTextResponse, RedirectResponse, Response
from starlette.routing import Mount, Route, Router
from starlette.staticfiles import StaticFiles
from starlette.templating import Jinja2Templates

from sqla_outbox import errors, flow, groups, migrations, presence
from sqla_outbox.catalog import Catalog
from sqla_outbox.config import OutboxSettings, redact_url
from sqla_outbox.dashboard import queries, views
from sqla_outbox.dashboard.actions import (
    Action,
    ActionContext,
    ActionInputError,
    ActionRegistry,
    default_actions,
)
from sqla_outbox.dashboard.auth import IDENTITY_KEY, Auth, Forbidden, Identify, Identity, Unauthenticated
from sqla_outbox.dashboard.untrusted import visible
from sqla_outbox.logging import log_extra
from sqla_outbox.ops import dlq, requeue, runs, status
from sqla_outbox.relay import scheduling_catalog
from sqla_outbox.types import QUEUE_NAMES, RUN_STATUSES
from sqla_outbox.wakeup import Waker
from sqla_outbox.worker import gate

logger = logging.getLogger(__name__)

HERE = Path(__file__).resolve().parent
STATEMENT_TIMEOUT_MS = 10_000
DLQ_LIST_LIMIT = 200
GROUPS_SHOWN = 20
"""Groups in progress listed on the Liveness page (the newest)."""

T = TypeVar("T")


class Dashboard:
    """The resources the requests of one dashboard application share, created on first use
    (a mounted application gets no lifespan events, so nothing is opened at start).

    Args:
        settings: The database, SQS, Valkey and dashboard settings.
        engine: The application's own engine for the outbox database; None: the
            dashboard creates a read-only one for pages and one for actions.
        actions: The actions offered.
        auth: Authentication and CSRF rules.
    """

    def __init__(
        self, settings: OutboxSettings, *, engine: Engine | None, actions: ActionRegistry, auth: Auth
    ) -> None:
        self.settings = settings
        self.actions = actions
        self.auth = auth
        self._given_engine = engine
        self._read_engine: Engine | None = None
        self._write_engine: Engine | None = None
        self._sqs: Any = None
        self._waker: Waker | None = None
        self._lock = threading.Lock()
        self.activity_cache = queries.ActivityCache()
        catalog = None  # none, or a broken one: the four queues, no task suggestions
        if Path(settings.catalog_path).exists():
            with contextlib.suppress(errors.CatalogError):
                catalog = Catalog.load(settings.catalog_path)
        # the four, plus the queues the catalog declares; its tasks suggested by the task filters
        self.queue_names = catalog.queue_names() if catalog is not None else QUEUE_NAMES
        self.task_names: tuple[str, ...] = tuple(sorted(catalog.tasks)) if catalog is not None else ()

    # --- resources -----------------------------------------------------------------------
    def _engine(self, *, read_only: bool) -> Engine:
        options = f"-c statement_timeout={STATEMENT_TIMEOUT_MS}"
        if read_only:
            options += " -c default_transaction_read_only=on"
        return sa.create_engine(
            self.settings.sqlalchemy_url,
            pool_size=5 if read_only else 1,
            max_overflow=5 if read_only else 2,
            pool_pre_ping=True,
            connect_args={
                "connect_timeout": 10,
                "application_name": "sqla_outbox-dashboard",
                "options": options,
            },
        )

    def read_engine(self) -> Engine:
        if self._given_engine is not None:
            return self._given_engine
        with self._lock:
            if self._read_engine is None:
                self._read_engine = self._engine(read_only=True)
            return self._read_engine

    def write_engine(self) -> Engine:
        if self._given_engine is not None:
            return self._given_engine
        with self._lock:
            if self._write_engine is None:
                self._write_engine = self._engine(read_only=False)
            return self._write_engine

    def sqs(self) -> Any:
        """The boto3 SQS client (short timeouts, one retry: an operator is waiting)."""
        with self._lock:
            if self._sqs is None:
                from sqla_outbox.sqs.client import make_client

                self._sqs = make_client(
                    self.settings, max_pool_connections=8, read_timeout_seconds=15, max_attempts=2
                )
            return self._sqs

    def waker(self) -> Waker | None:
        """The Valkey waker when that wake is in force (a requeue NOTIFYs by itself)."""
        if self.settings.wake_valkey_url is None:
            return None
        with self._lock:
            if self._waker is None:
                self._waker = Waker(self.settings)
            return self._waker

    def read(self, reading: Callable[[Connection], T]) -> T:
        """Run ``reading`` on a pooled read-only connection (blocking: call it in a thread)."""
        with self.read_engine().connect() as connection:
            return reading(connection)

    def close(self) -> None:
        """Dispose of the engines the dashboard created, close its SQS client, stop its waker."""
        with self._lock:
            for engine in (self._read_engine, self._write_engine):
                if engine is not None:
                    engine.dispose()
            self._read_engine = self._write_engine = None
            if self._waker is not None:
                self._waker.close()
                self._waker = None
            if self._sqs is not None:
                self._sqs.close()
                self._sqs = None


def _finalize(value: Any) -> Any:
    if value is None:
        return ""
    if isinstance(value, str) and not isinstance(value, Markup):
        return visible(value)
    return value


def _templates() -> Jinja2Templates:
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(HERE / "templates"),
        autoescape=True,
        finalize=_finalize,
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
    )
    env.filters.update(
        when=views.when,
        age=views.age,
        count=views.count,
        pretty_json=views.pretty_json,
        short_id=views.short_id,
    )
    return Jinja2Templates(env=env)


def _form_values(form: Iterable[tuple[str, Any]]) -> dict[str, list[str]]:
    values: dict[str, list[str]] = {}
    for key, value in form:
        if isinstance(value, str):
            values.setdefault(key, []).append(value)
    return values


def _safe_next(target: str | None, default: str) -> str:
    """A redirect target that stays on this site: a path, never ``//host`` or a URL."""
    if not target or not target.startswith("/") or target.startswith("//") or "\\" in target:
        return default
    parts = urlsplit(target)
    return target if not parts.scheme and not parts.netloc else default


class Pages:
    """The endpoints, bound to one :class:`Dashboard`."""

    def __init__(self, dashboard: Dashboard) -> None:
        self.dashboard = dashboard
        self.settings = dashboard.settings
        self.auth = dashboard.auth
        self.templates = _templates()
        self.router: Router | None = None

    # --- rendering -------------------------------------------------------------------------
    def path(self, request: Request, route: str, /, **params: Any) -> str:
        """The path of the dashboard's ``route``, under the prefix it is mounted at
        (``root_path``). Resolved in the dashboard's own routes, so a mounting
        application's routes of the same name never shadow them."""
        assert self.router is not None
        root = str(request.scope.get("root_path", "")).rstrip("/")
        return root + str(self.router.url_path_for(route, **params))

    def render(
        self, request: Request, template: str, identity: Identity, status_code: int = 200, **context: Any
    ) -> Response:
        def url(route: str, query: dict[str, Any] | None = None, /, **path: Any) -> str:
            base = self.path(request, route, **path)
            kept = {k: v for k, v in (query or {}).items() if v not in (None, "")}
            return f"{base}?{urlencode(kept)}" if kept else base

        context.setdefault("csrf_token", self.auth.csrf_token(request))
        context.update(
            request=request,
            identity=identity,
            url=url,
            actions_enabled=self.settings.dashboard_actions,
            can_act=self.settings.dashboard_actions and identity.can_act,
            login_page=self.auth.uses_login_page,
            refresh_seconds=self.settings.dashboard_refresh_seconds,
            show_payloads=identity.sees_payloads(self.settings),
            run_statuses=RUN_STATUSES,
            queue_names=self.dashboard.queue_names,
            task_names=self.dashboard.task_names,
        )
        context.setdefault("page", template.removesuffix(".html").lstrip("_"))
        response = self.templates.TemplateResponse(request, template, context, status_code=status_code)
        response.headers["Cache-Control"] = "no-store"
        return response

    # --- overview --------------------------------------------------------------------------
    async def _overview(self) -> dict[str, Any]:
        read = self.dashboard.read
        (pending, tenants), statuses, now = await asyncio.gather(
            run_in_threadpool(read, queries.backlog),
            run_in_threadpool(read, queries.status_counts),
            run_in_threadpool(read, queries.database_now),
        )
        return {"pending": pending, "tenants": tenants, "statuses": statuses, "now": now}

    async def overview(self, request: Request) -> Response:
        """The overview: the numbers now; the charts follow as a fragment (``overview_charts``)
        that the page loads at once, so the backlog shows without waiting for the hour's
        history. An operator restricted to tenants is sent to the Runs page (the overview
        counts every tenant's work)."""
        identity = self.auth.identity(request)
        if identity.tenants is not None:
            return RedirectResponse(self.path(request, "runs"), status_code=303)
        return self.render(request, "overview.html", identity, **await self._overview())

    async def overview_live(self, request: Request) -> Response:
        identity = self.auth.identity(request)
        return self.render(request, "_overview_live.html", identity, **await self._overview())

    async def overview_charts(self, request: Request) -> Response:
        identity = self.auth.identity(request)
        cache = self.dashboard.activity_cache
        activity = await run_in_threadpool(self.dashboard.read, lambda c: queries.activity(c, cache=cache))
        throughput, latency = views.activity_charts(activity)
        return self.render(
            request,
            "_overview_charts.html",
            identity,
            activity=activity,
            throughput=throughput,
            latency=latency,
            page="overview",
        )

    # --- runs --------------------------------------------------------------------------------
    async def runs_list(self, request: Request) -> Response:
        identity = self.auth.identity(request)
        size = views.RUNS_PAGE_SIZE
        # on every answer, a refused filter's too: the template reads it in both modes
        list_actions = _offered(self.dashboard.actions.in_place("runs"), identity)
        try:
            query = views.runs_query(
                dict(request.query_params), limit=size + 1, queues=self.dashboard.queue_names
            )
        except views.FilterError as exc:
            return self.render(
                request,
                "runs.html",
                identity,
                400,
                error=str(exc),
                values=_raw_filters(request),
                rows=[],
                list_actions=list_actions,
                refreshing=False,
                **_no_pages(),
            )
        filters = query.filters
        if identity.tenants is not None:  # only their tenants' runs, whatever the filters say
            filters = dataclasses.replace(filters, tenant_ids=identity.tenants)
        found = await run_in_threadpool(self.dashboard.read, lambda c: runs.list_runs(c, filters))
        if len(query.values["run"].replace("-", "")) == 32 and len(found) == 1:  # a whole id: its page
            return RedirectResponse(self.path(request, "run", run_id=str(found[0].run_id)), status_code=303)
        more = len(found) > size
        if query.filters.after is not None:  # going back: the extra row is the newest one
            rows, has_newer, has_older = (found[1:] if more else found), more, True
        else:
            rows, has_newer, has_older = found[:size], query.filters.before is not None, more
        newer = rows[0] if rows and has_newer else None
        older = rows[-1] if rows and has_older else None
        return self.render(
            request,
            "runs.html",
            identity,
            values=query.values,
            rows=rows,
            error=None,
            list_actions=list_actions,
            refreshing=query.filters.before is None and query.filters.after is None,
            newer=None if newer is None else runs.RunCursor(newer.created_at, newer.run_id).encode(),
            older=None if older is None else runs.RunCursor(older.created_at, older.run_id).encode(),
        )

    async def run_page(self, request: Request) -> Response:
        identity = self.auth.identity(request)
        try:
            run_id = uuid.UUID(str(request.path_params["run_id"]))
        except ValueError:
            raise HTTPException(404, "no such run") from None

        default_rate = self.settings.tenant_rate_limit_per_minute

        def reading(connection: Connection) -> tuple[Any, ...]:
            detail = runs.get_run(connection, run_id, with_traceback=True)
            tenant_rate = None
            if detail.run.tenant_id is not None and detail.run.status in ("queued", "retrying"):
                tenant_rate = flow.tenant_rate_use(connection, detail.run.tenant_id, default_rate)
            return (
                detail,
                queries.outbox_row(connection, run_id),
                flow.current(connection),
                presence.Coverage.of(presence.live_workers(connection)),
                queries.database_now(connection),
                tenant_rate,
            )

        try:
            detail, outbox, pauses, coverage, now, tenant_rate = await run_in_threadpool(
                self.dashboard.read, reading
            )
        except errors.RunNotFound:
            raise HTTPException(404, f"no run {run_id}") from None
        if not identity.allows_tenant(detail.run.tenant_id):
            raise HTTPException(404, f"no run {run_id}")  # not theirs: as if it did not exist
        envelope = outbox.envelope if outbox is not None else {}
        flow_state = None  # the task's limits and breaker, from Valkey, for a run that waits
        if detail.run.status in ("queued", "retrying"):
            flow_state = await run_in_threadpool(gate.snapshot, self.settings)
        payloads = identity.sees_payloads(self.settings)
        result = detail.run.result  # shown only with payloads (the template checks)
        return self.render(
            request,
            "run.html",
            identity,
            run=detail.run,
            trail=detail.trail if payloads else views.without_answers(detail.trail),
            attempts=views.attempts(detail.trail),
            outbox=outbox,
            envelope=views.envelope_metadata(envelope),
            payload=views.payload_text(envelope) if payloads else None,
            result=None if result is None else views.pretty_json(result),
            run_actions=_offered(self.dashboard.actions.for_run(detail.run, pauses), identity),
            waiting=views.waiting_reasons(
                detail.run, outbox, pauses, coverage, now, flow_state=flow_state, tenant_rate=tenant_rate
            ),
        )

    # --- DLQ ----------------------------------------------------------------------------------
    async def dlq_page(self, request: Request) -> Response:
        identity = self.auth.identity(request)
        try:
            query = views.dlq_query(dict(request.query_params), queues=self.dashboard.queue_names)
        except views.FilterError as exc:
            return self.render(
                request,
                "dlq.html",
                identity,
                400,
                error=str(exc),
                values=_raw_filters(request),
                listing=None,
                rows=[],
                sqs_error=None,
                action=self.dashboard.actions.get("dlq-requeue"),
                include_unverified=False,
                signing=bool(self.settings.signing_keys),
            )
        filters = dlq.DeadLetterFilter(
            tasks=query.tasks,
            queues=query.queues,
            older_than=query.older_than,
            known=self.dashboard.queue_names,
        )
        if query.values["messages"] != "yes":
            return await self._ledger_page(request, identity, query, filters)
        sqs_error = None
        listing = None
        run_errors: dict[uuid.UUID, queries.RunError] = {}
        try:
            listing = await self._dead_letters(filters)
            ids = [x.run_id for x in listing.letters if x.run_id is not None]
            run_errors = await run_in_threadpool(self.dashboard.read, lambda c: queries.errors_of(c, ids))
        except sa.exc.DBAPIError:
            raise
        except Exception as exc:  # SQS (or its configuration): shown on the page, filters kept
            from sqla_outbox.sqs.client import error_code

            sqs_error = _sqs_error_text(exc)
            logger.warning(
                "dashboard could not read the DLQs",
                extra=log_extra(action="dashboard.dlq_failed", error_code=error_code(exc)),
            )
        include_unverified = query.values.get("include_unverified") == "yes"
        if listing is not None and identity.tenants is not None:  # only their tenants' runs
            listing.letters = [
                x for x in listing.letters if x.run_status and identity.allows_tenant(x.tenant_id)
            ]
        rows = [
            {
                "letter": letter,
                "error": run_errors.get(letter.run_id) if letter.run_id else None,
                "requeueable": letter.run_id is not None
                and letter.run_status == "failed"
                and not requeue.is_foreign(letter),
                "vouched": requeue.vouched_for(letter, self.settings),
            }
            for letter in (listing.letters if listing is not None else [])
        ]
        return self.render(
            request,
            "dlq.html",
            identity,
            values=query.values,
            listing=listing,
            rows=rows,
            sqs_error=sqs_error,
            error=None,
            action=self.dashboard.actions.get("dlq-requeue"),
            include_unverified=include_unverified and not self.settings.signing_keys,
            signing=bool(self.settings.signing_keys),
        )

    async def _ledger_page(
        self,
        request: Request,
        identity: Any,
        query: views.DlqQuery,
        filters: dlq.DeadLetterFilter,
    ) -> Response:
        """The DLQ page from the ledger: the dead-lettered runs (``task_runs``), grouped by
        queue, task and error type, beside each DLQ's depth as SQS counts it. Nothing is
        received, so every reader sees the same page and no requeue misses what a page load
        hid (receiving hides a message from every other reader: SQS ReceiveMessage)."""
        if identity.tenants is not None:
            filters = dataclasses.replace(filters, tenant_ids=identity.tenants)

        def read(connection: Connection) -> tuple[list[dlq.LedgerLetter], list[dlq.LedgerGroup]]:
            return (
                dlq.dead_lettered_runs(connection, filters, limit=DLQ_LIST_LIMIT),
                dlq.dead_lettered_groups(connection, filters),
            )

        letters, groups = await run_in_threadpool(self.dashboard.read, read)
        depths: dict[str, int | None] = {}
        sqs_error = None
        try:
            sqs = await run_in_threadpool(self.dashboard.sqs)
            depths = await run_in_threadpool(dlq.dlq_depths, sqs, self.settings, filters.scanned_queues())
        except Exception as exc:  # SQS (or its configuration): shown on the page
            sqs_error = _sqs_error_text(exc)
        in_ledger: dict[str, int] = {}
        for group in groups:
            in_ledger[group.queue] = in_ledger.get(group.queue, 0) + group.runs
        unfiltered = not (query.tasks or query.older_than or identity.tenants is not None)
        return self.render(
            request,
            "dlq_ledger.html",
            identity,
            values=query.values,
            letters=letters,
            groups=groups,
            total=sum(in_ledger.values()),
            depths=[
                (queue, depth, in_ledger.get(queue, 0))
                for queue, depth in (
                    depths.items() if depths else ((q, None) for q in filters.scanned_queues())
                )
            ],
            compare_depths=unfiltered,
            truncated=len(letters) >= DLQ_LIST_LIMIT,
            sqs_error=sqs_error,
            error=None,
            action=self.dashboard.actions.get("dlq-requeue"),
            include_unverified=query.values.get("include_unverified") == "yes"
            and not self.settings.signing_keys,
            signing=bool(self.settings.signing_keys),
        )

    async def _dead_letters(self, filters: dlq.DeadLetterFilter) -> dlq.DeadLetterListing:
        """:func:`sqla_outbox.ops.dlq.list_dead_letters`, the DLQs scanned at once (one thread
        each: the page waits for the slowest queue, not for the sum of them), then every
        message checked against the database (:func:`sqla_outbox.ops.dlq.resolve`): the
        filters match each run's own row, never the messages' attributes."""
        sqs = await run_in_threadpool(self.dashboard.sqs)
        parts = await asyncio.gather(
            *(
                run_in_threadpool(
                    dlq.list_dead_letters,
                    sqs,
                    self.settings,
                    dlq.DeadLetterFilter(queues=(queue,), known=filters.known),
                )
                for queue in filters.scanned_queues()
            )
        )
        listing = dlq.DeadLetterListing(letters=[], scanned={}, missing_queues=[])
        for part in parts:
            listing.letters += part.letters
            listing.scanned.update(part.scanned)
            listing.missing_queues += part.missing_queues
            listing.truncated = listing.truncated or part.truncated

        def finish(connection: Connection) -> dlq.DeadLetterListing:
            return dlq.finish(
                listing,
                filters,
                connection=connection,
                limit=DLQ_LIST_LIMIT,
                max_bytes=self.settings.max_message_bytes,
            )

        return await run_in_threadpool(self.dashboard.read, finish)

    # --- schedules, controls -----------------------------------------------------------------
    async def schedules_page(self, request: Request) -> Response:
        identity = self.auth.identity(request)
        catalog_error = None
        # the file's name only: where it lives on the server is not the viewers' business
        catalog_name = Path(self.settings.catalog_path).name
        try:
            catalog = await run_in_threadpool(scheduling_catalog, self.settings, warn=False)
        except errors.CatalogError as exc:
            catalog_error = str(exc)
            for spelled in {str(self.settings.catalog_path), str(Path(self.settings.catalog_path).resolve())}:
                catalog_error = catalog_error.replace(spelled, catalog_name)
            catalog = Catalog.from_dict({"version": 1, "tasks": {}, "events": {}})
        now, states = await run_in_threadpool(self.dashboard.read, lambda c: queries.schedules(c, catalog))
        return self.render(
            request,
            "schedules.html",
            identity,
            now=now,
            schedules=states,
            catalog_error=catalog_error,
            catalog_name=catalog_name,
        )

    async def liveness_page(self, request: Request) -> Response:
        """What ``python -m sqla_outbox status`` knows about liveness: the relays (which is
        active, the partitions each owns, their due rows), the live workers (heartbeat,
        queues, tasks served), due runs no live worker implements, ``running`` runs whose
        lease expired long ago, runs without a live copy, and every queue's and DLQ's
        depth."""
        identity = self.auth.identity(request)
        registry = Catalog.queue_registry_at(self.settings.catalog_path)
        try:
            client = await run_in_threadpool(self.dashboard.sqs)
        except Exception:  # no SQS configuration: the page shows the database's part
            client = None

        def read(connection: Connection) -> tuple[status.StatusReport, list[groups.GroupState]]:
            report = status.collect(
                connection,
                self.settings,
                client=client,
                with_valkey=False,
                queues=self.dashboard.queue_names,
                registry=registry,
            )
            return report, groups.list_groups(connection, unfinished_only=True, limit=GROUPS_SHOWN)

        report, in_progress = await run_in_threadpool(self.dashboard.read, read)
        return self.render(
            request, "liveness.html", identity, report=report, groups=in_progress, groups_shown=GROUPS_SHOWN
        )

    async def controls_page(self, request: Request) -> Response:
        identity = self.auth.identity(request)
        flow_state = await run_in_threadpool(gate.snapshot, self.settings)  # read-only, from Valkey
        default_limit = self.settings.tenant_rate_limit_per_minute

        def read(connection: Any) -> tuple[list[flow.Pause], list[flow.ThrottledTenant], bool]:
            limits = default_limit is not None or any(
                t.rate_limit_per_minute for t in flow.tenants(connection).values()
            )
            return flow.list_pauses(connection), flow.throttled_tenants(connection, default_limit), limits

        pauses, throttled, limits = await run_in_threadpool(self.dashboard.read, read)
        return self.render(
            request,
            "controls.html",
            identity,
            controls=self.dashboard.actions.in_place("controls"),
            flow=flow_state,
            pauses=pauses,
            throttled=throttled,
            rate_limits=limits,
        )

    # --- login --------------------------------------------------------------------------------
    async def login(self, request: Request) -> Response:
        """The login page: a token (an operator's own, or the shared one) opens a session."""
        home = self.path(request, "overview")
        if not self.auth.uses_login_page:
            return RedirectResponse(home, status_code=303)
        target = _safe_next(request.query_params.get("next"), home)
        error = None
        status_code = 200
        if request.method == "POST":
            form = _form_values((await request.form()).multi_items())
            self.auth.check_login_csrf(request, next(iter(form.get("csrf_token", [])), None))
            token = (form.get("token") or [""])[0]
            target = _safe_next(next(iter(form.get("next", [])), None), home)
            signed_in = await run_in_threadpool(self.auth.log_in, token)
            if signed_in is not None and signed_in.session_key is not None:
                logger.info(
                    "dashboard login",
                    extra=log_extra(
                        action="dashboard.login", operator=signed_in.actor, method=signed_in.method
                    ),
                )
                redirect = RedirectResponse(target, status_code=303)
                self.auth.set_session_cookie(redirect, request, signed_in.session_key)
                return redirect
            logger.warning("dashboard login refused", extra=log_extra(action="dashboard.login_refused"))
            error, status_code = "That token does not open the dashboard.", 401
        form_token = self.auth.prepare_login_csrf(request)
        anonymous = Identity("anonymous", "anonymous", role="viewer")
        response = self.render(
            request, "login.html", anonymous, status_code, error=error, next=target, csrf_token=form_token
        )
        self.auth.login_csrf(request, response)
        return response

    async def logout(self, request: Request) -> Response:
        """End the session (its row is deleted: the cookie opens nothing any more)."""
        form = _form_values((await request.form()).multi_items())
        self.auth.check_csrf(request, next(iter(form.get("csrf_token", [])), None))
        identity = self.auth.identity(request)
        await run_in_threadpool(self.auth.log_out, identity)
        logger.info("dashboard logout", extra=log_extra(action="dashboard.logout", operator=identity.actor))
        response = RedirectResponse(self.path(request, "login"), status_code=303)
        self.auth.clear_session_cookie(response, request)
        return response

    # --- actions ------------------------------------------------------------------------------
    async def _action_request(self, request: Request) -> tuple[Identity, Action, dict[str, list[str]], Any]:
        action = self.dashboard.actions.get(str(request.path_params["name"]))
        if action is None:
            raise HTTPException(404, "no such action")
        if not self.settings.dashboard_actions:
            raise Forbidden(
                "actions are disabled: the dashboard is read-only (SQLA_OUTBOX_DASHBOARD_ACTIONS)"
            )
        identity = self.auth.identity(request)
        if not identity.authenticated:
            raise Forbidden("actions need an authenticated operator; sign in first")
        if not identity.can_act:
            raise Forbidden(f"{identity.name} is a {identity.role}: viewers read, operators act")
        if identity.tenants is not None and not action.tenant_scoped:
            raise Forbidden(
                f"{action.title} acts on every tenant; an operator restricted to tenants may not use it"
            )
        form = _form_values((await request.form()).multi_items())
        self.auth.check_csrf(request, next(iter(form.get("csrf_token", [])), None))
        fields = {k: v for k, v in form.items() if k not in ("csrf_token", "confirmed")}
        return identity, action, fields, action.parse(fields)

    def _context(self, identity: Identity) -> ActionContext:
        return ActionContext(
            settings=self.settings,
            engine=self.dashboard.write_engine(),
            identity=identity,
            sqs=self.dashboard.sqs,
            waker=self.dashboard.waker,
        )

    async def action_preview(self, request: Request) -> Response:
        try:
            identity, action, fields, params = await self._action_request(request)
        except ActionInputError as exc:
            return self._input_error(request, exc)
        try:
            report = await run_in_threadpool(action.preview, self._context(identity), params)
        except ActionInputError as exc:  # what only the action can check (the operator's tenants)
            return self._input_error(request, exc)
        return self.render(
            request,
            "action_confirm.html",
            identity,
            action=action,
            report=report,
            fields=fields if report.pinned is None else report.pinned.form_fields(),
            page="action",
        )

    async def action_perform(self, request: Request) -> Response:
        try:
            identity, action, fields, params = await self._action_request(request)
        except ActionInputError as exc:
            return self._input_error(request, exc)
        form = await request.form()
        if form.get("confirmed") != "yes":
            return self._input_error(request, ActionInputError("confirm the action on its confirmation page"))
        try:
            report = await run_in_threadpool(action.perform, self._context(identity), params)
        except ActionInputError as exc:
            return self._input_error(request, exc)
        logger.info(
            "dashboard action",
            extra=log_extra(
                action="dashboard.action",
                name=action.name,
                operator=identity.actor,
                changed=report.changed,
                summary=report.summary,
                fields=json.dumps(fields, sort_keys=True)[:500],
            ),
        )
        return self.render(
            request, "action_result.html", identity, action=action, report=report, page="action"
        )

    def _input_error(self, request: Request, exc: ActionInputError) -> Response:
        identity = self.auth.identity(request)
        return self.render(
            request, "error.html", identity, 400, title="Cannot do that", message=str(exc), page="action"
        )

    # --- errors -------------------------------------------------------------------------------
    async def unauthenticated(self, request: Request, exc: Exception) -> Response:
        htmx = request.headers.get("hx-request") == "true"
        presented = bool(request.headers.get("authorization"))  # a script's wrong credentials: 401
        if self.auth.uses_login_page and request.method == "GET" and not htmx and not presented:
            login = self.path(request, "login")
            target = request.url.path + (f"?{request.url.query}" if request.url.query else "")
            return RedirectResponse(f"{login}?{urlencode({'next': target})}", status_code=303)
        headers = {"WWW-Authenticate": 'Basic realm="sqla_outbox dashboard"'} if self.auth.basic else {}
        if htmx and self.auth.uses_login_page:
            headers["HX-Redirect"] = self.path(request, "login")
        return PlainTextResponse("authentication required\n", status_code=401, headers=headers)

    def _known_identity(self, request: Request) -> Identity | None:
        """The request's identity for an error page, or None when it has none usable
        (unauthenticated, restricted from this page, or the session table unreadable)."""
        try:
            return self.auth.identity(request)
        except (Unauthenticated, Forbidden, sa.exc.DBAPIError):
            return None

    async def forbidden(self, request: Request, exc: Exception) -> Response:
        assert isinstance(exc, Forbidden)
        identity = self._known_identity(request)
        if identity is None:
            return PlainTextResponse(f"forbidden: {exc.reason}\n", status_code=403)
        return self.render(
            request, "error.html", identity, 403, title="Refused", message=exc.reason, page="error"
        )

    async def http_error(self, request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        identity = self._known_identity(request)
        if identity is None:
            return PlainTextResponse(f"{exc.detail}\n", status_code=exc.status_code)
        return self.render(
            request,
            "error.html",
            identity,
            exc.status_code,
            title=_status_phrase(exc.status_code),
            message=str(exc.detail),
            page="error",
        )

    async def database_error(self, request: Request, exc: Exception) -> Response:
        if migrations.is_missing_outbox_table(exc):
            message = migrations.missing_tables_message(redact_url(self.settings.database_url))
        else:
            cause = getattr(exc, "orig", None) or exc
            first = next((line.strip() for line in str(cause).splitlines() if line.strip()), "")
            message = redact_url(f"cannot read the outbox database: {type(cause).__name__}: {first}"[:400])
        logger.warning("dashboard database error", extra=log_extra(action="dashboard.database_error"))
        identity = self._known_identity(request)
        if identity is None:
            return PlainTextResponse("database unavailable\n", status_code=503)
        return self.render(
            request, "error.html", identity, 503, title="Database unavailable", message=message, page="error"
        )


def _offered(actions: list[Action], identity: Identity) -> list[Action]:
    """The actions a page offers ``identity``: an operator restricted to tenants is offered
    only those that apply the restriction (the others would answer 403)."""
    return [a for a in actions if identity.tenants is None or a.tenant_scoped]


def _sqs_error_text(exc: BaseException) -> str:
    """An SQS failure as a page shows it: its error code and first line, passwords masked,
    at most 400 characters."""
    from sqla_outbox.sqs.client import error_code

    first = next((line for line in str(exc).splitlines() if line.strip()), "")
    return redact_url(f"{error_code(exc)}: {first}"[:400])


def _status_phrase(status_code: int) -> str:
    """An error page's title: the HTTP reason phrase ("Not Found", "Method Not Allowed")."""
    try:
        return http.HTTPStatus(status_code).phrase
    except ValueError:
        return f"Error {status_code}"


def _raw_filters(request: Request) -> dict[str, str]:
    return {k: v[:200] for k, v in request.query_params.items()}


def _no_pages() -> dict[str, Any]:
    return {"newer": None, "older": None}


def create_app(
    settings: OutboxSettings | None = None,
    *,
    engine: Engine | None = None,
    identify: Identify | None = None,
    secret_key: str | None = None,
    actions: ActionRegistry | None = None,
    https_only: bool = False,
) -> Starlette:
    """The dashboard as an ASGI application.

    Args:
        settings: Database, SQS, Valkey and ``dashboard_*`` settings; default
            :meth:`OutboxSettings.from_env`.
        engine: An engine of the application's for the outbox database; default: the
            dashboard's own (read-only for pages, with a 10 s statement timeout; sessions
            and actions write through a second, small one).
        identify: For an application that mounts the dashboard behind its own
            authentication: returns the operator for a request (a name, with the role
            ``operator``, or a :class:`~sqla_outbox.operators.Operator` with a role and
            tenants), or None to refuse it (401). Used only when the settings configure no
            authentication of the dashboard's own.
        secret_key: Deprecated and unused: sessions are kept in PostgreSQL
            (``dashboard_sessions``) and their cookie holds a random key, so there is
            nothing to sign. Passing it warns.
        actions: The actions offered (default :func:`default_actions`); register new
            controls here.
        https_only: Mark the cookies ``Secure`` (as ``dashboard_secure_cookies`` does).

    Returns:
        A Starlette application; ``app.state.dashboard`` is its :class:`Dashboard`
        (call ``close()`` on shutdown to release its connections).

    Raises:
        ConfigurationError: A proxy user header without the proxy's addresses.
    """
    if secret_key is not None:
        warnings.warn(
            "create_app(secret_key=...) is no longer used: dashboard sessions are kept in "
            "PostgreSQL and their cookie carries only a random key; drop the argument",
            DeprecationWarning,
            stacklevel=2,
        )
    settings = settings if settings is not None else OutboxSettings.from_env()
    auth = Auth(settings, identify=identify, secure_cookies=https_only)
    queues, tasks = QUEUE_NAMES, None  # no catalog (or a broken one): nothing to check against
    if Path(settings.catalog_path).exists():
        with contextlib.suppress(errors.CatalogError):
            catalog = Catalog.load(settings.catalog_path)
            queues, tasks = catalog.queue_names(), frozenset(catalog.tasks)
    dashboard = Dashboard(
        settings, engine=engine, actions=actions or default_actions(queues, tasks), auth=auth
    )
    auth.bind(read=dashboard.read_engine, write=dashboard.write_engine)
    pages = Pages(dashboard)
    # pages that apply an identity's tenant restriction themselves; every other page
    # refuses an operator restricted to tenants (Auth.identity)
    auth.allow_tenant_scoped(
        pages.overview,  # redirects them to their runs
        pages.runs_list,
        pages.run_page,
        pages.dlq_page,
        pages.login,
        pages.logout,
        pages.action_preview,
        pages.action_perform,
    )
    routes = [
        Route("/", pages.overview, name="overview"),
        Route("/overview/live", pages.overview_live, name="overview_live"),
        Route("/overview/charts", pages.overview_charts, name="overview_charts"),
        Route("/runs", pages.runs_list, name="runs"),
        Route("/runs/{run_id}", pages.run_page, name="run"),
        Route("/dlq", pages.dlq_page, name="dlq"),
        Route("/schedules", pages.schedules_page, name="schedules"),
        Route("/liveness", pages.liveness_page, name="liveness"),
        Route("/controls", pages.controls_page, name="controls"),
        Route("/login", pages.login, methods=["GET", "POST"], name="login"),
        Route("/logout", pages.logout, methods=["POST"], name="logout"),
        Route("/actions/{name}/preview", pages.action_preview, methods=["POST"], name="action_preview"),
        Route("/actions/{name}", pages.action_perform, methods=["POST"], name="action"),
        Mount("/static", app=StaticFiles(directory=HERE / "static"), name="static"),
    ]
    middleware = []
    if settings.dashboard_allowed_hosts:  # DNS rebinding: only the configured names
        middleware.append(
            Middleware(
                TrustedHostMiddleware,
                allowed_hosts=list(settings.dashboard_allowed_hosts),
                www_redirect=False,
            )
        )
    middleware += [Middleware(_Access, auth=auth), Middleware(_SecurityHeaders)]
    app = Starlette(
        routes=routes,
        middleware=middleware,
        exception_handlers={
            Unauthenticated: pages.unauthenticated,
            Forbidden: pages.forbidden,
            HTTPException: pages.http_error,
            sa.exc.DBAPIError: pages.database_error,
        },
    )
    app.state.dashboard = dashboard
    pages.router = app.router
    return app


class _Access:
    """The access middleware: every request but a static file is authenticated here, once,
    before any page or action runs (:meth:`Auth.resolve`, in a thread: it may read the
    session table). The identity, or why there is none, is left in the scope for
    :meth:`Auth.identity`, which every page and action calls: a page added later is
    covered without doing anything. A browser authenticated per request (basic auth, a
    proxy, the host application) gets its session here on its first page (a ``GET``),
    for its CSRF token."""

    def __init__(self, app: Any, auth: Auth) -> None:
        self.app = app
        self.auth = auth

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or _is_static(scope):
            await self.app(scope, receive, send)
            return
        request = Request(scope)
        identity: Identity | BaseException
        started: str | None = None
        try:
            identity = await run_in_threadpool(self.auth.resolve, request)
            if self.auth.needs_session(identity) and scope.get("method") in ("GET", "HEAD"):
                identity = await run_in_threadpool(self.auth.start_session, identity)
                started = identity.session_key
        except (Unauthenticated, sa.exc.DBAPIError) as exc:
            identity = exc
        scope[IDENTITY_KEY] = identity
        if started is None:
            await self.app(scope, receive, send)
            return
        cookie = Response()
        self.auth.set_session_cookie(cookie, request, started)
        header = next(v for k, v in cookie.raw_headers if k == b"set-cookie")

        async def sending(message: Any) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []), (b"set-cookie", header)]
            await send(message)

        await self.app(scope, receive, sending)


def _is_static(scope: Any) -> bool:
    root = str(scope.get("root_path", "")).rstrip("/")
    path = str(scope.get("path", ""))
    return path.startswith(root + "/static/") or path.startswith("/static/")


class _SecurityHeaders:
    """Headers on every response: no framing, no sniffing, scripts only from the dashboard
    itself (``Content-Security-Policy``), no referrer leaking run ids."""

    HEADERS = (
        (b"x-frame-options", b"DENY"),
        (b"x-content-type-options", b"nosniff"),
        (b"referrer-policy", b"same-origin"),
        (
            b"content-security-policy",
            b"default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
            b"object-src 'none'; base-uri 'none'; frame-ancestors 'none'; form-action 'self'",
        ),
    )

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def sending(message: Any) -> None:
            if message["type"] == "http.response.start":
                headers = list(message.get("headers", []))
                present = {name.lower() for name, _ in headers}
                headers += [(k, v) for k, v in self.HEADERS if k not in present]
                message["headers"] = headers
            await send(message)

        await self.app(scope, receive, sending)
