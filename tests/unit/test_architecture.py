"""The import contracts of pyproject.toml ([tool.importlinter]) hold, and would catch a break.

docs/architecture.md draws the layers; docs/decisions/0007-layers.md says why. The check is
import-linter's ``lint-imports``: these tests run it on the package as it is, and on a copy
with a deliberately added cycle and a deliberately forbidden import, which must fail.
"""

from __future__ import annotations

import os
import pkgutil
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

import sqla_outbox

ROOT = Path(__file__).resolve().parents[2]
LINT_IMPORTS = str(Path(sys.executable).with_name("lint-imports"))


def _lint(package_parent: Path, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(package_parent)}
    return subprocess.run(
        [LINT_IMPORTS, "--no-cache", "--no-logo"],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def _copy(tmp_path: Path) -> Path:
    shutil.copytree(
        ROOT / "sqla_outbox", tmp_path / "sqla_outbox", ignore=shutil.ignore_patterns("__pycache__")
    )
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    return tmp_path / "sqla_outbox"


def test_every_contract_is_kept() -> None:
    result = _lint(ROOT, ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 broken" in result.stdout


@pytest.mark.parametrize(
    ("module", "added", "broken"),
    [
        # a cycle: the foundation reaching up into the commands
        ("errors.py", "from sqla_outbox.cli import options as _cycle", "No import cycles anywhere"),
        # the application side reaching into worker code
        ("write.py", "from sqla_outbox.worker import handle as _worker", "never imports relay or worker"),
        # Valkey outside the wake module
        ("relay/claim.py", "import redis as _redis", "Only the wake module"),
        # a terminal library below the commands
        ("ops/status.py", "import rich as _rich", "Nothing below the commands"),
        # an HTTP client outside the worker (webhook deliveries are worker-side only)
        ("relay/send.py", "import httpx as _httpx", "Only the worker (sqla_outbox.worker) imports httpx"),
        # a module nobody has listed yet is covered by the owner contracts all the same
        ("brand_new.py", "import boto3 as _boto3", "Only the SQS layer"),
        # the dashboard rendering for a terminal, or reaching up into the commands
        ("dashboard/app.py", "import click as _click", "Nothing below the commands"),
        ("dashboard/views.py", "from sqla_outbox.cli import options as _up", "Layers"),
    ],
)
def test_a_deliberate_break_fails_the_check(tmp_path: Path, module: str, added: str, broken: str) -> None:
    package = _copy(tmp_path)
    with (package / module).open("a", encoding="utf-8") as source:
        source.write(f"\n{added}  # deliberate break (tests/unit/test_architecture.py)\n")
    result = _lint(tmp_path, tmp_path)
    assert result.returncode != 0, result.stdout
    assert f"{broken}" in result.stdout
    assert "BROKEN" in result.stdout


def test_every_top_level_module_is_in_a_layer() -> None:
    """A new top-level module must be placed in a layer (the owner contracts need no list:
    they are ``protected`` contracts, so a new module is covered by them at once)."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    top_level = {f"sqla_outbox.{m.name}" for m in pkgutil.iter_modules(sqla_outbox.__path__)}
    contracts = {c["id"]: c for c in config["contracts"]}
    layered = {
        f"sqla_outbox.{name.strip()}"
        for layer in contracts["layers"]["layers"]
        for name in layer.replace(":", "|").split("|")
    }
    assert layered == top_level, f"not in a layer: {sorted(top_level - layered)}"
