"""Light modules stay light: importing them does not load the AWS SDK.

``status`` and ``health`` read relay partitions (:mod:`sqla_outbox.relay.partitions`) and
the worker builds its engine (:mod:`sqla_outbox.worker.engine`) without talking to SQS;
boto3 and botocore (about 110 ms and 210 modules here) load only with what sends or receives
(:class:`sqla_outbox.relay.Relay`, :mod:`sqla_outbox.sqs.client`). Each import runs in a
fresh interpreter, since this one has long since loaded everything.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
HEAVY = ("boto3", "botocore")


def _loaded_after(statement: str) -> list[str]:
    """Run ``statement`` in a fresh interpreter and return which of :data:`HEAVY` it loaded."""
    probe = f"import json, sys; {statement}; print(json.dumps([m for m in {HEAVY!r} if m in sys.modules]))"
    result = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, cwd=ROOT, timeout=120
    )
    assert result.returncode == 0, result.stderr
    loaded: list[str] = json.loads(result.stdout)
    return loaded


@pytest.mark.parametrize(
    "statement",
    [
        "import sqla_outbox.relay.partitions",
        "import sqla_outbox.worker.engine",
        "import sqla_outbox.engines",
        "import sqla_outbox.relay",
        "from sqla_outbox.relay import make_engine, ENGINE_CONNECT_ARGS",
    ],
)
def test_a_light_import_does_not_load_boto3(statement: str) -> None:
    assert _loaded_after(statement) == []


def test_the_relay_class_still_loads_it() -> None:
    """The control: the probe sees boto3 when something does load it."""
    assert _loaded_after("from sqla_outbox.relay import Relay") == list(HEAVY)


def test_the_relay_package_still_exports_its_names() -> None:
    """Every name ``sqla_outbox.relay`` exported before the split, from where it lives now."""
    import sqla_outbox.relay
    from sqla_outbox import engines
    from sqla_outbox.relay import passes, process

    homes = {
        "Relay": process,
        "WAKE_HOLD_SECONDS": process,
        "scheduling_catalog": process,
        "PassResult": passes,
        "RelayCounters": passes,
        "make_engine": engines,
        "ENGINE_CONNECT_ARGS": engines,
    }
    assert set(sqla_outbox.relay.__all__) == set(homes)
    for name, home in homes.items():
        assert getattr(sqla_outbox.relay, name) is getattr(home, name), name
    assert set(homes) <= set(dir(sqla_outbox.relay))
    with pytest.raises(AttributeError, match="has no attribute 'Nothing'"):
        sqla_outbox.relay.Nothing  # noqa: B018
