"""The run life cycle has one home: the rules hold, and nothing else writes a run.

* Every ``UPDATE task_runs`` that sets a status, in every statement of
  :mod:`sqla_outbox.lifecycle`, moves a run between states that
  :data:`sqla_outbox.lifecycle.states.TRANSITIONS` declares; every declaration is made by
  some statement, and names a function that exists.
* No module outside :mod:`sqla_outbox.lifecycle` writes ``task_runs``, ``task_run_trail``
  or an outbox row, except the creation of runs in :mod:`sqla_outbox.write` (listed below,
  statement by statement) and the migrations' frozen history.
* Every statement that writes an outbox row or a trail row writes every column of
  :mod:`sqla_outbox.lifecycle.columns` (a new column cannot be forgotten in one of them).
* ``docs/lifecycle.md``'s generated part equals the declaration.
* The verdict (a pure function) behaves as documented; the retry rules: test_retry.py.
"""

from __future__ import annotations

import ast
import importlib
import pkgutil
import random
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy.sql.elements import TextClause

from sqla_outbox import errors, lifecycle, write
from sqla_outbox.lifecycle import columns, controls, retry, states, verdict

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "sqla_outbox"
RUN_TABLES = r"(task_runs|task_run_trail|outbox_messages|platform_outbox_messages)"
WRITE = re.compile(
    rf"\b(?:UPDATE\s+{RUN_TABLES}\b|INSERT\s+INTO\s+{RUN_TABLES}\b|DELETE\s+FROM\s+{RUN_TABLES}\b"
    r"|UPDATE\s+\{|INSERT\s+INTO\s+\{|DELETE\s+FROM\s+\{)",
    re.IGNORECASE,
)
ORM_WRITE = re.compile(
    r"\b(?:update|insert|delete)\(\s*(?:models\.)?(?:TaskRun|TaskRunTrail|OutboxMessage|PlatformOutboxMessage"
    r"|task_runs|task_run_trail|outbox_messages|platform_outbox_messages)\b"
)

CREATION = {
    ("write.py", "INSERT INTO task_runs"): "a dispatch creates its run",
    ("write.py", "INSERT INTO outbox_messages"): "... and its outbox row",
    ("write.py", "INSERT INTO platform_outbox_messages"): "... and its outbox row",
    ("write.py", "INSERT INTO {"): "the one-run variant, per outbox table",
    ("write.py", "DELETE FROM task_runs"): "a refused flush takes back what it wrote",
    ("write.py", "DELETE FROM outbox_messages"): "... in the same transaction",
    ("write.py", "DELETE FROM platform_outbox_messages"): "... in the same transaction",
    ("write.py", "UPDATE task_runs"): "group members join their group in the flush that creates them",
}
"""Writes outside the package, each the creation of a run in the application's flush."""


def _strings(source: str) -> Iterator[tuple[int, str]]:
    """Every string literal of a module, f-strings with their placeholders as ``{``."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.JoinedStr):
            yield node.lineno, "".join(v.value if isinstance(v, ast.Constant) else "{" for v in node.values)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            yield node.lineno, node.value


def writes_outside(package: Path) -> list[str]:
    """``file:line: statement`` for each write of a run table outside the lifecycle package."""
    found = []
    for path in sorted(package.rglob("*.py")):
        rel = path.relative_to(package).as_posix()
        if rel.startswith(("lifecycle/", "migrations/versions/")):
            continue
        source = path.read_text(encoding="utf-8")
        for line, text in _strings(source):
            for match in WRITE.finditer(text):
                statement = " ".join(match.group(0).split())
                if (rel, statement) not in CREATION:
                    found.append(f"{rel}:{line}: {statement}")
        for match in ORM_WRITE.finditer(source):
            found.append(f"{rel}: ORM {match.group(0)}")
    return found


def test_nothing_outside_the_package_writes_a_run() -> None:
    assert writes_outside(PACKAGE) == [], "write these through sqla_outbox.lifecycle"


def test_the_scan_finds_a_write_outside_the_package(tmp_path: Path) -> None:
    (tmp_path / "relay").mkdir()
    (tmp_path / "relay" / "rogue.py").write_text(
        "from sqlalchemy import text\nX = text(\"UPDATE task_runs SET status = 'failed'\")\n"
        'def f(table):\n    return f"UPDATE {table} SET sent_at = NULL"\n'
        "Y = 'INSERT INTO task_run_trail (run_id) VALUES (1)'\n"
        "def g(s):\n    return s.execute(update(models.TaskRun).values(status='queued'))\n"
    )
    (tmp_path / "lifecycle").mkdir()
    (tmp_path / "lifecycle" / "fine.py").write_text("X = 'UPDATE task_runs SET status = 1'\n")
    found = writes_outside(tmp_path)
    assert sorted(line.split(": ", 1)[1] for line in found) == [
        "INSERT INTO task_run_trail",
        "ORM update(models.TaskRun",
        "UPDATE task_runs",
        "UPDATE {",
    ]


# --- transitions ----------------------------------------------------------------------------
def _clauses(value: Any) -> Iterator[str]:
    if isinstance(value, TextClause):
        yield value.text
    elif isinstance(value, dict):
        for item in value.values():
            yield from _clauses(item)
    elif isinstance(value, list | tuple):
        for item in value:
            yield from _clauses(item)


def lifecycle_statements() -> list[str]:
    """The SQL text of every statement the package defines (module-level statements, and
    every shape of the per-shape builders)."""
    found: list[str] = []
    for info in pkgutil.iter_modules(lifecycle.__path__):
        module = importlib.import_module(f"sqla_outbox.lifecycle.{info.name}")
        for value in vars(module).values():
            found.extend(_clauses(value))
    shapes = [
        (a, b, c, d)
        for a in (False, True)
        for b in (False, True)
        for c in (False, True)
        for d in (False, True)
    ]
    for shape in shapes:
        found.append(controls.cancel_statement(shape).text)
        for notify in (False, True):
            found.append(controls.reschedule_statement(shape, notify).text)
    return found


_UPDATE = re.compile(r"\bUPDATE\s+task_runs\b", re.IGNORECASE)
_SET_STATUS = re.compile(r"\bstatus\s*=\s*'(\w+)'", re.IGNORECASE)
_GUARD_EQ = re.compile(r"\b(?:\w+\.)?status\s*=\s*'(\w+)'", re.IGNORECASE)
_GUARD_IN = re.compile(r"\b(?:\w+\.)?status\s+IN\s*\(([^)]*)\)", re.IGNORECASE)


def _update_segments(sql: str) -> Iterator[str]:
    """Each ``UPDATE task_runs ...`` statement of ``sql``, up to its end (``RETURNING``, the
    parenthesis closing its CTE, or the end of the text)."""
    for match in _UPDATE.finditer(sql):
        depth, end = 0, len(sql)
        for i in range(match.end(), len(sql)):
            char = sql[i]
            if char == "(":
                depth += 1
            elif char == ")":
                if depth == 0:
                    end = i
                    break
                depth -= 1
        segment = sql[match.start() : end]
        yield re.split(r"\bRETURNING\b", segment, flags=re.IGNORECASE)[0]


def moves_of(sql: str) -> set[tuple[str, str]]:
    """``(from, to)`` status moves the ``UPDATE task_runs`` statements of ``sql`` make.

    Raises:
        AssertionError: A status-setting update has no status guard.
    """
    moves: set[tuple[str, str]] = set()
    for segment in _update_segments(sql):
        head, _, where = [*re.split(r"\b(WHERE)\b", segment, maxsplit=1, flags=re.IGNORECASE), "", ""][:3]
        set_part = re.split(r"\bFROM\b", head, maxsplit=1, flags=re.IGNORECASE)[0]
        targets = set(_SET_STATUS.findall(set_part))
        if not targets:
            continue
        sources = set(_GUARD_EQ.findall(where))
        for listed in _GUARD_IN.findall(where):
            sources |= set(re.findall(r"'(\w+)'", listed))
        assert sources, f"a status change without a status guard:\n{segment}"
        moves |= {(source, target) for source in sources for target in targets}
    return moves


def test_every_status_change_is_a_declared_transition() -> None:
    made: set[tuple[str, str]] = set()
    for sql in lifecycle_statements():
        made |= moves_of(sql)
    declared = {(t.source, t.target) for t in states.TRANSITIONS}
    assert made - declared == set(), "status changes no transition declares"
    assert declared - made == set(), "declared transitions no statement makes"


def test_the_transition_check_catches_an_undeclared_move() -> None:
    rogue = (
        "WITH x AS (UPDATE task_runs SET status = 'succeeded' WHERE status = 'failed' RETURNING 1) SELECT 1"
    )
    assert moves_of(rogue) == {("failed", "succeeded")}
    assert not states.declared("failed", "succeeded")
    with pytest.raises(AssertionError, match="without a status guard"):
        moves_of("UPDATE task_runs SET status = 'queued' WHERE run_id = :run_id")
    assert moves_of("UPDATE task_runs SET lease_expires_at = now() WHERE status = 'running'") == set()


def test_every_declared_transition_names_a_function_that_exists() -> None:
    for transition in states.TRANSITIONS:
        module, function = transition.function.split(".")
        assert callable(getattr(importlib.import_module(f"sqla_outbox.lifecycle.{module}"), function)), (
            transition
        )
        assert transition.source in states.RUN_STATUSES and transition.target in states.RUN_STATUSES


# --- one column list per table ---------------------------------------------------------------
_INSERT_COLUMNS = re.compile(
    r"INSERT\s+INTO\s+(outbox_messages|platform_outbox_messages|task_run_trail)\s*\(([^)]*)\)", re.IGNORECASE
)


def _inserted(sql: str) -> list[tuple[str, tuple[str, ...]]]:
    return [
        (table, tuple(c.strip() for c in cols.split(","))) for table, cols in _INSERT_COLUMNS.findall(sql)
    ]


def test_every_outbox_and_trail_insert_writes_the_declared_columns() -> None:
    creation = [clause.text for clause in [*write._INSERT.values(), *write._INSERT_WITH_WEBHOOKS.values()]]
    creation += [
        write._insert_one(table, notify, plain).text
        for table in columns.OUTBOX_TABLES
        for notify in (False, True)
        for plain in (False, True)
    ]
    seen = 0
    for sql in [*lifecycle_statements(), *creation]:
        for table, written in _inserted(sql):
            expected = columns.TRAIL_COLUMNS if table == "task_run_trail" else columns.outbox_columns(table)
            assert written == expected, f"{table}: {written} != {expected}"
            seen += 1
    assert seen > 20  # every writer was looked at


def test_a_rebuilt_outbox_row_takes_every_column_from_its_run() -> None:
    sql = columns.outbox_from_run("outbox_messages", where="r.run_id = :run_id", envelope=":e")
    assert "r.priority" in sql and "r.queue" in sql and "r.tenant_id" in sql
    assert "tenant_id" not in columns.outbox_columns("platform_outbox_messages")
    with pytest.raises(ValueError, match="needs a value"):
        columns.outbox_from_run("outbox_messages", where="true")
    with pytest.raises(ValueError, match="not columns"):
        columns.outbox_from_run("platform_outbox_messages", where="true", envelope=":e", tenant_id="1")


def test_the_lifecycle_page_is_generated_from_the_declaration() -> None:
    page = (ROOT / "docs" / "lifecycle.md").read_text(encoding="utf-8")
    generated = states.reference_markdown()
    assert generated in page, (
        "docs/lifecycle.md is stale: paste sqla_outbox.lifecycle.states.reference_markdown() "
        "between its generated markers"
    )


# --- the verdict ---------------------------------------------------------------------------
RULES = retry.RetryRules(
    max_receives=5, backoff_base_seconds=4.0, backoff_max_seconds=100.0, permanent=(KeyError,)
)


def _decide(error: BaseException | None, receive: int = 1, attempt: int = 1, **kw: Any) -> verdict.Verdict:
    return verdict.decide(error, RULES, receive_count=receive, attempt=attempt, rng=random.Random(7), **kw)


def test_a_returned_attempt_succeeds() -> None:
    assert _decide(None) == verdict.Verdict(verdict.Kind.SUCCEED)


@pytest.mark.parametrize("error", [errors.PermanentError("no"), KeyError("k")])
def test_permanent_errors_fail_at_once_and_count_for_no_breaker(error: BaseException) -> None:
    decided = _decide(error)
    assert (decided.kind, decided.reason, decided.breaker_outcome) == (
        verdict.Kind.FAIL,
        "permanent-error",
        "neutral",
    )


def test_a_transient_failure_retries_after_the_jittered_backoff_until_the_last_try() -> None:
    for spent in range(1, 5):
        decided = _decide(ValueError("x"), receive=spent)
        low, high = retry.backoff_bounds(spent, RULES)  # the backoff itself: test_retry.py
        assert decided.kind is verdict.Kind.RETRY and decided.breaker_outcome == "failure"
        assert low <= decided.delay_seconds <= high
    last = _decide(ValueError("x"), receive=5)
    assert (last.kind, last.reason) == (verdict.Kind.FAIL, "retries-exhausted")


def test_tries_count_the_attempts_too_so_a_deferral_cannot_reset_them() -> None:
    # a deferral sends a fresh message: receive count 1 again, attempts go on
    assert _decide(ValueError("x"), receive=1, attempt=5).reason == "retries-exhausted"


def test_retry_replaces_the_backoff_and_retry_after_only_lengthens_it() -> None:
    assert _decide(errors.Retry(3)).delay_seconds == 3
    assert _decide(errors.AttemptTimeout(2)).kind is verdict.Kind.RETRY
    long = _decide(errors.WebhookFailed("rate-limited", "slow down", retry_after_seconds=60))
    assert long.delay_seconds == 60
    short = _decide(errors.WebhookFailed("rate-limited", "slow down", retry_after_seconds=0.5))
    low, high = retry.backoff_bounds(1, RULES)
    assert low <= short.delay_seconds <= high and high > 0.5  # the backoff of the first try


def test_a_delay_longer_than_the_visibility_left_retries_through_the_outbox() -> None:
    """At SQS's 12-hour ceiling (or near it) the message cannot stay hidden for the delay:
    the retry goes through the outbox with its whole delay, never visibility 0."""
    near_cap = _decide(errors.Retry(43_200), visibility_left_seconds=600)
    assert (near_cap.kind, near_cap.via, near_cap.delay_seconds) == (
        verdict.Kind.RETRY,
        verdict.Via.OUTBOX,
        43_200,
    )
    at_cap = _decide(errors.Retry(0), visibility_left_seconds=0)
    assert at_cap.via is verdict.Via.OUTBOX
    long_retry_after = _decide(
        errors.WebhookFailed("rate-limited", "later", retry_after_seconds=7200), visibility_left_seconds=3600
    )
    assert (long_retry_after.via, long_retry_after.delay_seconds) == (verdict.Via.OUTBOX, 7200)


def test_a_delay_within_the_visibility_left_hides_the_message() -> None:
    assert _decide(errors.Retry(20), visibility_left_seconds=30).via is verdict.Via.VISIBILITY


def test_a_delivery_received_more_often_than_the_run_has_tries_fails_before_it_runs() -> None:
    assert verdict.before_attempt(5, RULES) is None
    refused = verdict.before_attempt(6, RULES)
    assert refused is not None and (refused.kind, refused.reason) == (verdict.Kind.FAIL, "receive-limit")
    assert refused.breaker_outcome == "refund"


# --- a breaker's outage and the run's tries (verdict.ride_out) ------------------------------
def _breaker(state: str, outage: float | None, admits_in: float = 12.0, horizon: float = 600.0) -> Any:
    return verdict.BreakerView(
        state=state, outage_seconds=outage, admits_in_seconds=admits_in, max_outage_seconds=horizon
    )


@pytest.mark.parametrize("state", ["open", "half_open"])
def test_a_failure_that_finds_the_breaker_open_is_deferred_uncounted_within_the_horizon(state: str) -> None:
    for decided in (_decide(ValueError("x"), receive=2), _decide(ValueError("x"), attempt=5)):
        ridden = verdict.ride_out(decided, _breaker(state, outage=599.0))
        assert (ridden.kind, ridden.reason) == (verdict.Kind.DEFER, verdict.OUTAGE_DEFERRAL)
        assert ridden.delay_seconds == 12.0  # to when the breaker admits runs again
        assert ridden.error is decided.error and ridden.breaker_outcome == "failure"


def test_past_the_horizon_failures_count_again_and_the_last_try_fails() -> None:
    retrying = _decide(ValueError("x"), receive=2)
    assert verdict.ride_out(retrying, _breaker("open", outage=600.0)) is retrying
    last = _decide(ValueError("x"), attempt=5)
    assert verdict.ride_out(last, _breaker("open", outage=601.0)).reason == "retries-exhausted"
    assert verdict.ride_out(retrying, _breaker("open", outage=0.0, horizon=0.0)) is retrying  # turned off


def test_failures_while_the_breaker_is_closed_count_as_without_a_breaker() -> None:
    decided = _decide(ValueError("x"), receive=3)
    assert verdict.ride_out(decided, _breaker("closed", outage=None)) is decided
    assert verdict.ride_out(decided, None) is decided


@pytest.mark.parametrize(
    "decided",
    [
        _decide(None),
        _decide(errors.PermanentError("bad input")),
        verdict.before_attempt(6, RULES),
    ],
)
def test_only_transient_failures_ride_out_an_outage(decided: verdict.Verdict) -> None:
    assert verdict.ride_out(decided, _breaker("open", outage=1.0)) is decided


def test_an_outage_deferral_never_waits_past_the_ceiling() -> None:
    decided = _decide(ValueError("x"))
    assert verdict.ride_out(decided, _breaker("open", 1.0, admits_in=10**6)).delay_seconds == 43_200
