"""Debian's Chromium driven by Playwright, for the dashboard's browser tests.

Playwright's own browser download is not used (nor reachable in CI): the system browser
is launched by its path (``/usr/bin/chromium``, the ``chromium`` package; ``scripts/install-browser``
installs it), headless, with a fresh user-data directory per test. Screenshots go to
``tests/artifacts/dashboard/`` (git-ignored), kept after the run as test artifacts.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

CHROMIUM = os.environ.get("SQLA_OUTBOX_CHROMIUM", "/usr/bin/chromium")
FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
ARTIFACTS = Path(__file__).resolve().parents[1] / "artifacts" / "dashboard"


@contextlib.contextmanager
def chromium(user_data_dir: Path) -> Iterator[Any]:
    """A persistent browser context of the system Chromium (fails loudly when missing)."""
    if shutil.which(CHROMIUM) is None:
        pytest.fail(
            f"Chromium not found at {CHROMIUM}: apt-get install chromium chromium-driver "
            "(./scripts/test does it through scripts/install-browser), or set SQLA_OUTBOX_CHROMIUM",
            pytrace=False,
        )
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        context = playwright.chromium.launch_persistent_context(
            str(user_data_dir),
            executable_path=CHROMIUM,
            headless=True,
            args=FLAGS,
            viewport={"width": 1280, "height": 860},
        )
        context.set_default_timeout(30_000)
        try:
            yield context
        finally:
            context.close()


def screenshot(page: Any, name: str) -> Path:
    """Save the whole page as ``tests/artifacts/dashboard/<name>.png``."""
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    path = ARTIFACTS / f"{name}.png"
    page.screenshot(path=str(path), full_page=True)
    return path
