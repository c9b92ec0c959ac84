"""The docs tell the truth about themselves, and speak to users.

Links: every relative link in README.md, CHANGELOG.md, docs/ (with docs/decisions/) and
benchmarks/README.md names a file that exists, and every ``#anchor`` (on the same page or in
``file.md#anchor``) names a heading of that page, by GitHub's rule for heading ids (lowercase,
punctuation dropped, each space a ``-``, the second and later headings of the same text suffixed
``-1``, ``-2``, ...), or an ``<a id=...>`` / ``<a name=...>`` of it. Links inside fenced code
blocks and inline code, and absolute ``http(s):`` / ``mailto:`` links, are not checked; nor are
setext headings (underlined with ``===`` / ``---``), which these docs do not use.

Paths: a ``docs/...md`` page named by its path (in pyproject.toml's comments, in the code's
docstrings, comments, help texts and messages, in scripts, and in the docs' own prose and code
blocks) must exist too, with its ``#anchor``, and the section a quote after it names must begin
one of its headings: ``--help`` and error messages send users there.

Words: the user docs (README.md and docs/, but not docs/decisions/, the engineering records,
nor CHANGELOG.md) and what the CLI and the errors say (sqla_outbox/cli/, sqla_outbox/errors.py)
hold none of the words that only make sense inside the project: citations of its specification
("SPEC") or of its internal source documents ("reference 001", "BullMQ (001)", "the reference
design"), its own tracker's issues ("issue 13", "#12 of ours"), review rounds ("round 2") and
trials. A rule is stated, with its public source (an SQS limit, a PostgreSQL behaviour, an ADR
in docs/decisions/); a peer's public issue is cited as ``owner/repo#N``, which is allowed.
"""

from __future__ import annotations

import re
import urllib.parse
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

#: The pages whose links are checked.
PAGES = sorted(
    [
        ROOT / "README.md",
        ROOT / "CHANGELOG.md",
        ROOT / "benchmarks" / "README.md",
        *(ROOT / "docs").rglob("*.md"),
    ]
)

#: Files outside the docs that name docs pages: configuration, scripts and the code (its
#: docstrings, comments, help texts and messages).
CODE = sorted(
    [
        ROOT / "pyproject.toml",
        ROOT / "alembic.ini",
        *(ROOT / ".ci").glob("*"),
        *(ROOT / "scripts").glob("*"),
        *(
            path
            for folder in ("sqla_outbox", "benchmarks", "examples", "tests", "alembic")
            for path in (ROOT / folder).rglob("*")
            if path.suffix in {".py", ".toml", ".ini", ".sh"} and "__pycache__" not in path.parts
        ),
    ]
)

#: Broken links kept for now, as ``(page, target)``, each with why. An entry that no longer
#: breaks fails the test, so the list only shrinks.
KNOWN_BROKEN: dict[tuple[str, str], str] = {}

#: The user docs, whose words are checked, and the code whose texts users read.
USER_DOCS = sorted(
    [ROOT / "README.md", *(path for path in (ROOT / "docs").rglob("*.md") if "decisions" not in path.parts)]
)
USER_CODE = sorted([ROOT / "sqla_outbox" / "errors.py", *(ROOT / "sqla_outbox" / "cli").rglob("*.py")])

#: Words only the project understands (case-insensitive), each with what to write instead.
INTERNAL_WORDS = {
    r"(?-i:\bSPEC\b)(?:\.md)?": "state the rule itself, with its public source",
    r"(?<![\w/])issues? #?\d+": "say what changed or why; the project's tracker is not the user's",
    r"#\d+ of ours": "say what changed or why",
    r"\breference (?:design|\d{3})\b|\(0\d\d\)|shared/reference": "name the public design, or none",
    r"\bround \d+\b": "say what the review found, not which round",
    r"\btrials?\b": "say what was found, not how",
}
INTERNAL = [(re.compile(pattern, re.IGNORECASE), advice) for pattern, advice in INTERNAL_WORDS.items()]

#: Pages whose words are kept for now, each with why. An entry whose page no longer has any
#: fails the test, so the list only shrinks.
WORDS_PENDING: dict[str, str] = {}

#: Link schemes that point outside the repository; everything else must resolve inside it.
ABSOLUTE = re.compile(r"^(?:https?:|mailto:)", re.IGNORECASE)
FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})")
FENCE_END = re.compile(r"^ {0,3}(`{3,}|~{3,})[ \t]*$")
HEADING = re.compile(r"^ {0,3}(#{1,6})(?:[ \t]+(.*?))?(?:[ \t]+#+)?[ \t]*$")
CODE_SPAN = re.compile(r"(`+)(.+?)(?<!`)\1(?!`)")
HTML_TAG = re.compile(r"<[^>]*>")
EXPLICIT_ID = re.compile(r"<a\s[^>]*?\b(?:id|name)\s*=\s*[\"']([^\"']+)[\"']", re.IGNORECASE)
# [text](target "title"), ![alt](target): the text may hold one level of [brackets]
INLINE_LINK = re.compile(
    r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*(<[^>]*>|[^\s()]*(?:\([^\s()]*\)[^\s()]*)*)"
    r"(?:\s+(?:\"[^\"]*\"|'[^']*'|\([^)]*\)))?\s*\)"
)
REFERENCE_DEFINITION = re.compile(r"^ {0,3}\[[^\]]+\]:\s*(<[^>]*>|\S+)")
HTML_LINK = re.compile(r"<(?:a|img)\s[^>]*?\b(?:href|src)\s*=\s*[\"']([^\"']+)[\"']", re.IGNORECASE)
# a docs page named by its path: docs/x.md, docs/decisions/0001-y.md#anchor
CODE_DOCS_PATH = re.compile(r"(?<![\w/.-])(docs/[\w-][\w./-]*?\.md)(#[\w-]+)?")
# and the section a quote after it names: docs/x.md ("Title"), docs/x.md, "Title"
QUOTED_SECTION = re.compile(r"`*,? ?\(?\"([^\"]+)\"")


def _relative(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def _lines_outside_fences(text: str) -> Iterator[tuple[int, str]]:
    """Each line (1-based number, text) that is not inside a fenced code block."""
    fence: str | None = None
    for number, line in enumerate(text.splitlines(), start=1):
        if fence is None:
            if opening := FENCE.match(line):
                fence = opening.group(1)
            else:
                yield number, line
        elif (closing := FENCE_END.match(line)) and closing.group(1).startswith(fence):
            fence = None


def _without_code_spans(line: str) -> str:
    """The line with each inline code span blanked (same length), so links in code are skipped."""
    return CODE_SPAN.sub(lambda match: " " * len(match.group(0)), line)


def slug(heading: str) -> str:
    """GitHub's id for a heading's text (github-slugger's rule, before deduplication).

    The rendered text counts: code spans keep their content (``<database>`` included), HTML tags
    and link targets are dropped; then lowercase, drop what is neither a letter, a digit, ``_``,
    ``-`` nor a space, and turn each space into ``-``.
    """
    parts: list[str] = []
    position = 0
    for match in CODE_SPAN.finditer(heading):
        parts.append(_rendered(heading[position : match.start()]))
        code = match.group(2)
        # CommonMark drops one space each side of a code span when both are there
        parts.append(code[1:-1] if code.startswith(" ") and code.endswith(" ") and code.strip() else code)
        position = match.end()
    parts.append(_rendered(heading[position:]))
    text = "".join(parts).strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def _rendered(markdown: str) -> str:
    """The visible text of inline Markdown outside code spans: links by their text, no HTML tags,
    no emphasis markers (``*``, and ``_`` around words)."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", markdown)
    text = HTML_TAG.sub("", text)
    text = re.sub(r"(?<!\w)_+|_+(?!\w)", "", text)
    return text.replace("\\", "")


def anchors(text: str) -> set[str]:
    """Every id a page offers: its headings' slugs, deduplicated as GitHub does, and the ids and
    names of its ``<a>`` tags."""
    found: set[str] = set()
    occurrences: dict[str, int] = {}
    for _, line in _lines_outside_fences(text):
        found.update(EXPLICIT_ID.findall(_without_code_spans(line)))
        match = HEADING.match(line)
        if not match:
            continue
        original = result = slug(match.group(2) or "")
        while result in occurrences:
            occurrences[original] += 1
            result = f"{original}-{occurrences[original]}"
        occurrences[result] = 0
        found.add(result)
    return found


def _anchors_of(path: Path, cache: dict[Path, set[str]]) -> set[str]:
    if path not in cache:
        cache[path] = anchors(path.read_text(encoding="utf-8"))
    return cache[path]


def _titles_of(path: Path, cache: dict[Path, list[str]]) -> list[str]:
    """The headings' visible text of a page."""
    if path not in cache:
        text = path.read_text(encoding="utf-8")
        cache[path] = [
            match.group(2) or "" for _, line in _lines_outside_fences(text) if (match := HEADING.match(line))
        ]
    return cache[path]


def _plain(title: str) -> str:
    """A heading's text to compare with a quoted one: no section number, no backticks, lowercase."""
    return re.sub(r"^\d+(?:\.\d+)*\.?\s+", "", title.replace("`", "")).lower()


def links(text: str) -> Iterator[tuple[int, str]]:
    """Each link target of a page (line number, target), outside fenced code and code spans."""
    for number, line in _lines_outside_fences(text):
        visible = _without_code_spans(line)
        for pattern in (INLINE_LINK, REFERENCE_DEFINITION, HTML_LINK):
            for match in pattern.finditer(visible):
                target = match.group(1)
                if target.startswith("<") and target.endswith(">"):
                    target = target[1:-1]
                yield number, target


def _broken(source: Path, target: str, cache: dict[Path, set[str]], *, base: Path | None = None) -> bool:
    """Whether a relative ``target`` written in ``source`` (resolved from ``base``, by default the
    source's folder) names no file, or an anchor its Markdown page does not have."""
    if not target or ABSOLUTE.match(target):
        return False
    path_part, _, fragment = target.partition("#")
    path_part = urllib.parse.unquote(path_part.split("?", 1)[0])
    if path_part.startswith("/"):
        resolved = ROOT / path_part.lstrip("/")
    elif path_part:
        resolved = (base or source.parent) / path_part
    else:
        resolved = source
    resolved = resolved.resolve()
    if not resolved.is_relative_to(ROOT) or not resolved.exists():
        return True
    if fragment and resolved.suffix == ".md" and resolved.is_file():
        return urllib.parse.unquote(fragment) not in _anchors_of(resolved, cache)
    return False


def test_every_relative_link_and_anchor_resolves() -> None:
    cache: dict[Path, set[str]] = {}
    broken = [
        (_relative(page), number, target)
        for page in PAGES
        for number, target in links(page.read_text(encoding="utf-8"))
        if _broken(page, target, cache)
    ]
    unexpected = [
        f"{page}:{number}: {target}" for page, number, target in broken if (page, target) not in KNOWN_BROKEN
    ]
    assert not unexpected, "broken links and anchors:\n" + "\n".join(unexpected)
    fixed = sorted(set(KNOWN_BROKEN) - {(page, target) for page, _, target in broken})
    assert not fixed, "no longer broken, remove from KNOWN_BROKEN: " + ", ".join(map(str, fixed))


def test_every_docs_page_named_by_path_exists() -> None:
    """``docs/...md`` written as a path (from the repository's root) in code, configuration or
    the docs' prose and code blocks: the page exists, its ``#anchor`` too, and a section named
    after it in quotes (``docs/deployment.md ("Connections")``) begins one of its headings."""
    cache: dict[Path, set[str]] = {}
    titles: dict[Path, list[str]] = {}
    here = Path(__file__).resolve()
    broken = []
    for path in [*PAGES, *CODE]:
        if path.resolve() == here:
            continue
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
            for match in CODE_DOCS_PATH.finditer(line):
                target = match.group(1) + (match.group(2) or "")
                if _broken(path, target, cache, base=ROOT):
                    broken.append(f"{_relative(path)}:{number}: {target}")
                    continue
                section = QUOTED_SECTION.match(line, match.end())
                page = ROOT / match.group(1)
                if section and not any(
                    _plain(title).startswith(_plain(section.group(1))) for title in _titles_of(page, titles)
                ):
                    broken.append(f'{_relative(path)}:{number}: {target} "{section.group(1)}"')
    assert not broken, "docs pages named by path that do not exist:\n" + "\n".join(broken)


def internal_words(text: str) -> Iterator[tuple[int, str, str]]:
    """Each internal word of a text (line number, the word as written, what to write instead),
    in reading order."""
    for number, line in enumerate(text.splitlines(), start=1):
        found = [
            (match.start(), match.group(0), advice)
            for pattern, advice in INTERNAL
            for match in pattern.finditer(line)
        ]
        for _, word, advice in sorted(found):
            yield number, word, advice


def test_user_docs_and_messages_say_no_internal_words() -> None:
    found = [
        (_relative(path), number, word, advice)
        for path in [*USER_DOCS, *USER_CODE]
        for number, word, advice in internal_words(path.read_text(encoding="utf-8"))
    ]
    unexpected = [
        f"{path}:{number}: {word} ({advice})"
        for path, number, word, advice in found
        if path not in WORDS_PENDING
    ]
    assert not unexpected, "internal words in user docs and messages:\n" + "\n".join(unexpected)
    clean = sorted(set(WORDS_PENDING) - {path for path, *_ in found})
    assert not clean, "no internal words left, remove from WORDS_PENDING: " + ", ".join(clean)


# --- the checker itself ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("heading", "expected"),
    [
        ("The wake", "the-wake"),
        ("Step 2: run the relay (optional)", "step-2-run-the-relay-optional"),
        ("`Dispatch(task, payload={}, *, ...)`", "dispatchtask-payload--"),
        (
            "`error: the outbox tables are missing in <database>: ...`",
            "error-the-outbox-tables-are-missing-in-database-",
        ),
        ("If your `target_metadata` does not hold ours", "if-your-target_metadata-does-not-hold-ours"),
        ("A [linked](other.md) *word*", "a-linked-word"),
        ("Café — naïve", "café--naïve"),
    ],
)
def test_slug_follows_github(heading: str, expected: str) -> None:
    assert slug(heading) == expected


def test_anchors_deduplicate_and_skip_code() -> None:
    page = '# Notes\n## Notes\n## Notes\n```bash\n# Notes\n```\n<a id="here"></a>\n## Notes 1\n'
    assert anchors(page) == {"notes", "notes-1", "notes-2", "here", "notes-1-1"}


def test_docs_paths_and_quoted_sections() -> None:
    line = 'see docs/decisions/0009-webhook-deliveries.md#context ("Context"), not mydocs/x.md'
    [match] = CODE_DOCS_PATH.finditer(line)
    assert match.groups() == ("docs/decisions/0009-webhook-deliveries.md", "#context")
    section = QUOTED_SECTION.match(line, match.end())
    assert section is not None and section.group(1) == "Context"
    assert _plain("12. `Dashboard` pages").startswith(_plain("Dashboard pages"))


def test_links_skip_code_and_read_every_form() -> None:
    page = (
        'See [a](a.md#x) and ![img](images/b.png "title") and `[c](c.md)`.\n'
        "```\n[d](d.md)\n```\n"
        "[ref]: e.md#y\n"
        '<a href="f.md">f</a> [g [h]](<g h.md>) [i](https://example.com/i.md)\n'
    )
    assert list(links(page)) == [
        (1, "a.md#x"),
        (1, "images/b.png"),
        (5, "e.md#y"),
        (6, "g h.md"),
        (6, "https://example.com/i.md"),
        (6, "f.md"),
    ]


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ("Keep the SPEC values (SPEC.md)", ["SPEC", "SPEC.md"]),
        (
            "priority (issue 13; design in ADR 0013), issues 11 and #12 of ours",
            ["issue 13", "issues 11", "#12 of ours"],
        ),
        ("BullMQ (001), reference 001, the reference design", ["(001)", "reference 001", "reference design"]),
        ("found in round 2 of a trial", ["round 2", "trial"]),
        ("riverqueue/river#551, a second round, TaskSpec, 403 (401), spec-compliant", []),
    ],
)
def test_internal_words_are_found(text: str, words: list[str]) -> None:
    assert [word for _, word, _ in internal_words(text)] == words
