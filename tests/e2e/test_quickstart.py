"""docs/quickstart.md works as pasted: its blocks, in order, in a new folder, against the wheel.

Each fenced block of the page is preceded by a ``<!-- check: KIND ... -->`` comment that says
what this test does with it, and a block without one fails the test (a new block is never
left unchecked by accident):

* ``file``: a file whose first line is ``# <path>``, written to that path;
* ``env``: ``export NAME=...`` lines for the reader's services; each NAME must be a setting's
  variable (``SQLA_OUTBOX_<field>``) or an AWS one, and the test's own services stand in;
* ``run``: a bash script (``set -euo pipefail``) that must exit 0; ``<run_id>`` is replaced
  by a run of the page's dispatches;
* ``start``: one long-running process per line (the relay, the worker); before the next
  block, the test waits until every run the page dispatched has succeeded;
* ``skip``: not run (the comment says why).

The processes run with the wheel's virtualenv first on ``PATH`` (so ``python`` is its
interpreter) and the test environment's site-packages on ``PYTHONPATH`` for the
dependencies; sqla_outbox itself is the wheel's copy. The relay and the worker must log no
warning on the way.
"""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import uuid
from pathlib import Path
from typing import Any

import psycopg
import pytest

from sqla_outbox.config import OutboxSettings
from tests import support
from tests.support import ServiceProcess, wait_for

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "quickstart.md"
AWS_VARIABLES = {
    "AWS_REGION",
    "AWS_DEFAULT_REGION",
    "AWS_PROFILE",
    "AWS_ACCESS_KEY_ID",
    "AWS_SECRET_ACCESS_KEY",
}
SETTING_VARIABLES = {f"SQLA_OUTBOX_{field.name.upper()}" for field in dataclasses.fields(OutboxSettings)}


@dataclasses.dataclass(frozen=True)
class Block:
    kind: str
    note: str
    language: str
    text: str
    line: int


def blocks(page: str) -> list[Block]:
    """The page's fenced blocks with the check comment before each.

    Raises:
        AssertionError: A block has no ``<!-- check: ... -->`` line right before it.
    """
    found = []
    lines = page.splitlines()
    index = 0
    while index < len(lines):
        opening = re.match(r"^```(\w*)$", lines[index])
        if not opening:
            index += 1
            continue
        marker = re.match(r"^<!-- check: (\w+)(.*?) -->$", lines[index - 1] if index else "")
        assert marker, (
            f"quickstart.md line {index + 1}: a block without a `<!-- check: ... -->` line before it"
        )
        end = lines.index("```", index + 1)
        found.append(
            Block(
                marker.group(1),
                marker.group(2).strip(),
                opening.group(1),
                "\n".join(lines[index + 1 : end]) + "\n",
                index + 1,
            )
        )
        index = end + 1
    return found


def test_every_block_of_the_quickstart_is_classified() -> None:
    kinds = [block.kind for block in blocks(PAGE.read_text(encoding="utf-8"))]
    assert set(kinds) <= {"file", "env", "run", "start", "skip"}, kinds
    assert {"file", "env", "run", "start"} <= set(kinds)


def test_the_quickstart_works_as_pasted(
    tmp_path: Path, empty_db: str, redis_url: str, moto_endpoint: str
) -> None:
    support.reset_moto(moto_endpoint)
    wheel = support.wheel_environment(tmp_path / "wheel")
    app = tmp_path / "app"
    app.mkdir()
    services = {
        "SQLA_OUTBOX_DATABASE_URL": empty_db.replace("postgresql://", "postgresql+psycopg://", 1),
        "SQLA_OUTBOX_VALKEY_URL": redis_url,
        "SQLA_OUTBOX_QUEUE_PREFIX": f"q{uuid.uuid4().hex[:8]}-",
        "SQLA_OUTBOX_WAKE_KEY": f"quickstart:{uuid.uuid4().hex}",
        "SQLA_OUTBOX_SQS_ENDPOINT_URL": moto_endpoint,
        **support.AWS_ENV,
    }
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SQLA_OUTBOX_", "AWS_", "VIRTUAL_ENV"))}
    env.update(PATH=f"{wheel.bin}{os.pathsep}{env['PATH']}", PYTHONPATH=wheel.dependencies)
    started: list[ServiceProcess] = []
    exported: set[str] = set()
    run_ids: list[uuid.UUID] = []
    try:
        for block in blocks(PAGE.read_text(encoding="utf-8")):
            where = f"quickstart.md line {block.line}"
            if block.kind == "file":
                first, _, _rest = block.text.partition("\n")
                assert first.startswith("# "), f"{where}: a file block starts with `# <path>`"
                path = app / first[2:].strip()
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(block.text, encoding="utf-8")
            elif block.kind == "env":
                names = re.findall(r"^export (\w+)=", block.text, re.M)
                unknown = [n for n in names if n not in SETTING_VARIABLES | AWS_VARIABLES]
                assert names and not unknown, f"{where}: not a setting's variable: {unknown}"
                exported.update(names)
                env.update(services)
            elif block.kind == "run":
                script = block.text.replace("<run_id>", str(run_ids[0]) if run_ids else "<run_id>")
                done = subprocess.run(
                    ["bash", "-c", "set -euo pipefail\n" + script],
                    cwd=app,
                    env=env,
                    capture_output=True,
                    text=True,
                    timeout=240,
                )
                assert done.returncode == 0, (
                    f"{where} exited {done.returncode}:\n{done.stdout}\n{done.stderr}"
                )
            elif block.kind == "start":
                for line in block.text.splitlines():
                    if line.strip():
                        started.append(
                            ServiceProcess(["bash", "-c", line], env, line.split()[2], cwd=str(app))
                        )
                run_ids = wait_for(lambda: _all_succeeded(empty_db, started), timeout=120, interval=0.5)
        assert {"SQLA_OUTBOX_DATABASE_URL", "SQLA_OUTBOX_VALKEY_URL", "SQLA_OUTBOX_QUEUE_PREFIX"} <= exported
        assert run_ids, "the page never started a relay and a worker"
        with psycopg.connect(empty_db) as conn:
            welcomed = conn.execute("SELECT email, welcomed FROM users").fetchall()
            finished = dict(
                conn.execute("SELECT task, status FROM task_runs WHERE task <> 'maintenance.purge'")
            )
        assert welcomed == [("ada@example.com", True)]
        assert finished == {"send_welcome": "succeeded", "index_user": "succeeded"}
    finally:
        for process in started:
            process.terminate(timeout=60)
    for process in started:
        warnings = [
            line
            for line in process.raw
            if re.search(r'\b(WARNING|ERROR)\b|"level": "(warning|error|critical)"|Traceback', line)
        ]
        assert warnings == [], f"{process.name} warned:\n{''.join(warnings)}"


def _all_succeeded(database: str, started: list[ServiceProcess]) -> list[Any] | None:
    """The page's runs (not the built-in purge) once all have succeeded, else None."""
    for process in started:
        assert process.process.poll() is None, f"{process.name} exited:\n{process.output()[-4000:]}"
    with psycopg.connect(database) as conn:
        rows = conn.execute(
            "SELECT run_id, status FROM task_runs WHERE task <> 'maintenance.purge' ORDER BY created_at"
        ).fetchall()
    if len(rows) < 2 or any(status != "succeeded" for _, status in rows):
        return None
    return [run_id for run_id, _ in rows]
