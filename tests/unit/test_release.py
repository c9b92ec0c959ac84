"""A release says what it is: one version everywhere, a dated changelog section with upgrade
notes, and every migration named by the release that brings it (docs/releasing.md)."""

from __future__ import annotations

import importlib.metadata
import re
import subprocess
import sys
from pathlib import Path

import sqla_outbox

ROOT = Path(__file__).resolve().parents[2]
CHANGELOG = (ROOT / "CHANGELOG.md").read_text(encoding="utf-8")
SEMVER = r"(\d+)\.(\d+)\.(\d+)"
RELEASES = re.findall(rf"^## \[({SEMVER})\] - (\d{{4}}-\d{{2}}-\d{{2}})$", CHANGELOG, re.M)


def _sections() -> dict[str, str]:
    """``{version: its section's text}`` for every released version."""
    parts = re.split(r"^## \[", CHANGELOG, flags=re.M)[1:]
    return {part.split("]", 1)[0]: part for part in parts}


def test_the_version_is_semver_and_the_same_everywhere() -> None:
    assert re.fullmatch(SEMVER, sqla_outbox.__version__)
    assert importlib.metadata.version("sqla-outbox") == sqla_outbox.__version__
    printed = subprocess.run(
        [sys.executable, "-m", "sqla_outbox", "--version"],
        capture_output=True,
        text=True,
        check=True,
        cwd=ROOT,
    )
    assert printed.stdout.strip().endswith(f"version {sqla_outbox.__version__}")


def test_the_changelog_has_unreleased_then_dated_releases_newest_first() -> None:
    assert CHANGELOG.index("## [Unreleased]") < CHANGELOG.index(f"## [{sqla_outbox.__version__}] - ")
    versions = [tuple(int(n) for n in release[1:4]) for release in RELEASES]
    assert versions == sorted(versions, reverse=True) and len(set(versions)) == len(versions)
    assert RELEASES[0][0] == sqla_outbox.__version__
    dates = [release[4] for release in RELEASES]
    assert dates == sorted(dates, reverse=True)


def test_every_release_after_the_first_has_upgrade_notes() -> None:
    sections = _sections()
    for version, _major, _minor, _patch, _date in RELEASES[:-1]:
        previous = RELEASES[[r[0] for r in RELEASES].index(version) + 1][0]
        assert f"### Upgrading from {previous}" in sections[version], version


def test_every_migration_is_named_by_a_release() -> None:
    """Each ``sqlaob_NNNN`` revision appears in a released section (or under Unreleased while
    it is new): an upgrade note that leaves out a migration leaves a deploy step out."""
    revisions = sorted(
        re.search(r'^revision = "(sqlaob_\d{4})"', path.read_text(encoding="utf-8"), re.M).group(1)  # type: ignore[union-attr]
        for path in (ROOT / "sqla_outbox" / "migrations" / "versions").glob("sqlaob_*.py")
    )
    assert revisions
    named = set(re.findall(r"sqlaob_\d{4}", CHANGELOG))
    ranges = re.findall(r"`sqlaob_(\d{4})` to `sqlaob_(\d{4})`", CHANGELOG)
    for low, high in ranges:
        named.update(f"sqlaob_{n:04d}" for n in range(int(low), int(high) + 1))
    assert [r for r in revisions if r not in named] == []
