"""The web dashboard: ``python -m sqla_outbox dashboard``, or an ASGI app to mount.

Pages: **Overview** (pending outbox rows and their age by queue and by tenant, runs by
status, the last hour per minute: dispatched, finished, failed, commit → finish latency;
refreshed live), **Runs** (filters, keyset pagination, a run's envelope, attempts and
trail), **DLQ** (dead-lettered messages with reason and error; requeue), **Schedules**
(each scheduled task's latest and next slot) and **Controls** (actions to come).

Read-only unless ``SQLA_OUTBOX_DASHBOARD_ACTIONS`` is on; authentication by token or
basic auth from the settings, or the mounting application's; CSRF on every action.
Needs the ``dashboard`` extra (``pip install 'sqla-outbox[dashboard]'``: Starlette,
Jinja2, uvicorn, python-multipart). See ``docs/dashboard.md``.

Layer: above :mod:`sqla_outbox.ops` (it reuses the DLQ listing and requeue), below
:mod:`sqla_outbox.cli` (which serves it); it never imports click or rich.
"""

from __future__ import annotations

from sqla_outbox.dashboard.actions import Action, ActionContext, ActionRegistry, ActionReport, default_actions
from sqla_outbox.dashboard.app import Dashboard, create_app

__all__ = [
    "Action",
    "ActionContext",
    "ActionRegistry",
    "ActionReport",
    "Dashboard",
    "create_app",
    "default_actions",
]
