"""A task module whose import takes ``SLOW_IMPORT_SECONDS`` (the worker's start-up window
in which a SIGTERM used to end the process by its default action).

With ``SLOW_IMPORT_MARKER`` set, the import first creates that file, so a test knows the
worker has reached its task imports (its stop signals are installed by then) instead of
guessing from a sleep how long the interpreter takes to start."""

from __future__ import annotations

import os
import time
from pathlib import Path

if marker := os.environ.get("SLOW_IMPORT_MARKER"):
    Path(marker).touch()
time.sleep(float(os.environ.get("SLOW_IMPORT_SECONDS", "0")))
