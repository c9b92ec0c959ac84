"""The README's first command: the demo runs end to end and every committed run ends as expected."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid

import pytest

pytestmark = pytest.mark.e2e


def test_demo_runs_the_shop_end_to_end(pg_url: str, redis_url: str) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SQLA_OUTBOX_", "AWS_"))}
    env.update({"DATABASE_URL": pg_url, "REDIS_URL": redis_url})
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "sqla_outbox",
            "demo",
            "--orders",
            "14",
            "--json",
            "--database-name",
            f"demo_{uuid.uuid4().hex[:10]}",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    summary = json.loads(result.stdout)
    assert summary["ok"] is True
    # 14 orders x 4 runs, plus 3 welcome runs from the shop's data migration
    assert summary["runs_found"] == summary["runs_expected"] == 14 * 4 + 3
    # orders 6 and 13 use invalid.example addresses: their loyalty runs fail permanently
    assert summary["runs_by_status"] == {"failed": 2, "succeeded": 57}
    assert summary["unexpected"] == []
    assert summary["handler_effects"] == 57  # one effect per succeeded run, none twice
    assert (
        sorted((d["task"], d["reason"]) for d in summary["dlq"]) == [("award_loyalty", "permanent-error")] * 2
    )
    assert summary["latency_ms"]["count"] > 0 and summary["latency_ms"]["p99"] is not None
    assert summary["delayed_lateness_ms"]["count"] == 14
