"""A task module whose import takes ``SLOW_IMPORT_SECONDS`` (the worker's start-up window
in which a SIGTERM used to end the process by its default action)."""

from __future__ import annotations

import os
import time

time.sleep(float(os.environ.get("SLOW_IMPORT_SECONDS", "0")))
