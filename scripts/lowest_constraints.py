"""Print pip constraints pinning every runtime dependency to the floor pyproject.toml declares.

``./scripts/test --lowest`` installs the package with these constraints in a venv of its
own, so the suite runs against the oldest versions the ranges admit. Covered: the
``dependencies`` list and the extras an application installs (``EXTRAS`` below); the
``dev`` tools (pytest, moto, ...) stay at their newest, since users never run them.
A requirement without a ``>=`` floor is reported and fails the script.
"""

from __future__ import annotations

import re
import sys
import tomllib
from pathlib import Path

EXTRAS = ("otel", "embedded", "dashboard")
_REQUIREMENT = re.compile(r"^\s*([A-Za-z0-9_.-]+)(\[[^\]]*\])?\s*(.*)$")


def floors(pyproject: Path) -> list[str]:
    project = tomllib.loads(pyproject.read_text())["project"]
    requirements = list(project["dependencies"])
    for extra in EXTRAS:
        requirements += project["optional-dependencies"][extra]
    pins, missing = [], []
    for requirement in requirements:
        match = _REQUIREMENT.match(requirement.split(";")[0])
        assert match, requirement
        name, specifiers = match.group(1), match.group(3)
        floor = re.search(r">=\s*([0-9][^,\s]*)", specifiers)
        if floor is None:
            missing.append(requirement)
            continue
        pins.append(f"{name}=={floor.group(1)}")
    if missing:
        sys.exit(f"no >= floor declared for: {', '.join(missing)}")
    return pins


if __name__ == "__main__":
    root = Path(__file__).resolve().parent.parent
    print("\n".join(floors(root / "pyproject.toml")))
