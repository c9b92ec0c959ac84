"""Deprecated alias of :mod:`sqla_outbox.lifecycle.attempts` (moved in 0.2.0; removed in 0.3.0).

Every statement that changes a run now lives in :mod:`sqla_outbox.lifecycle`. Reading a
name here still works for this release and warns with a ``DeprecationWarning``.
"""

from __future__ import annotations

import warnings
from typing import Any

from sqla_outbox.lifecycle import attempts as _attempts


def __getattr__(name: str) -> Any:
    value = getattr(_attempts, name)  # AttributeError for names that never existed
    warnings.warn(
        f"sqla_outbox.worker.runs.{name} moved to sqla_outbox.lifecycle.attempts.{name}; "
        "the old name goes in 0.3.0",
        DeprecationWarning,
        stacklevel=2,
    )
    return value
