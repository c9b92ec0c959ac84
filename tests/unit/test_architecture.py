"""The import contracts of pyproject.toml ([tool.importlinter]) hold, and would catch a break.

docs/architecture.md draws the layers; docs/decisions/0007-layers.md says why. The check is
import-linter's ``lint-imports``: these tests run it on the package as it is, and on a copy
with a deliberately added cycle and a deliberately forbidden import, which must fail.
"""

from __future__ import annotations

import os
import pkgutil
import re
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
        # a module nobody has listed yet is covered by the owner contracts all the same, and
        # the exhaustive layers contract refuses it until it is placed in a layer
        ("brand_new.py", "import boto3 as _boto3", "Only the SQS layer"),
        ("brand_new.py", "X = 1", "marked as 'exhaustive'"),
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


def _contracts() -> dict[str, dict[str, object]]:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    return {c["id"]: c for c in config["contracts"]}


def _page_tables() -> tuple[list[str], list[str]]:
    """docs/architecture.md: the modules column of the layers table, and the contract names."""
    page = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    layers_part = page.split("## The layers, top to bottom", 1)[1].split("##", 1)[0]
    contracts_part = page.split("## The rules, as contracts", 1)[1].split("##", 1)[0]

    def rows(part: str) -> list[list[str]]:
        cells = []
        for line in part.splitlines():
            if line.startswith("|") and not line.startswith("|---"):
                cells.append([c.strip() for c in re.split(r"(?<!\\)\|", line.strip("|"))])
        return cells[1:]  # the header

    modules = [r[1].strip("`").replace("\\|", "|") for r in rows(layers_part)]
    names = [r[0] for r in rows(contracts_part)]
    return modules, names


def test_the_architecture_page_equals_the_contracts() -> None:
    contracts = _contracts()
    modules, names = _page_tables()
    assert modules == contracts["layers"]["layers"], (
        "docs/architecture.md's layers differ from pyproject.toml"
    )
    assert names == [c["name"] for c in contracts.values()], "docs/architecture.md's contracts differ"


def test_every_top_level_module_is_in_a_layer() -> None:
    """The layers contract is exhaustive (import-linter fails a module in no layer); the
    page lists the same modules."""
    contracts = _contracts()
    assert contracts["layers"]["exhaustive"] is True
    top_level = {f"sqla_outbox.{m.name}" for m in pkgutil.iter_modules(sqla_outbox.__path__)}
    layered = {
        f"sqla_outbox.{name.strip()}"
        for layer in contracts["layers"]["layers"]
        for name in layer.replace(":", "|").split("|")
    }
    assert layered == top_level, f"not in a layer: {sorted(top_level - layered)}"


def test_imports_by_name_are_the_listed_ones() -> None:
    """``importlib.import_module`` / ``__import__`` escape import-linter: each use is listed
    on docs/architecture.md ("Imports by name")."""
    listed = {"lazy.py", "worker/consumer.py"}
    found = set()
    for path in (ROOT / "sqla_outbox").rglob("*.py"):
        if re.search(r"\bimport_module\(|__import__\(", path.read_text(encoding="utf-8")):
            found.add(path.relative_to(ROOT / "sqla_outbox").as_posix())
    assert found == listed
    page = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    assert all(f"`{module}`" in page for module in ("lazy", "worker/consumer.py"))
