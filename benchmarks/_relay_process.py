"""One relay process for ``bench_scaling.py --relays``: the real ``Relay.run()`` on the fake SQS.

Settings come from the environment (``SQLA_OUTBOX_*``, as for ``python -m
sqla_outbox.relay``); ``--latency-ms`` is the fake SQS's latency per call. SIGTERM stops it.
"""

from __future__ import annotations

import argparse
import signal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_scaling import FakeSqs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--latency-ms", type=float, default=20.0)
    parser.add_argument("--name", default="bench-relay")
    args = parser.parse_args()

    from sqla_outbox.config import OutboxSettings
    from sqla_outbox.relay import Relay
    from sqla_outbox.relay.send import SqsSender
    from sqla_outbox.sqs.client import QueueDirectory

    settings = OutboxSettings.from_env()
    client = FakeSqs(args.latency_ms / 1000)
    relay = Relay(
        settings, sender=SqsSender(client, QueueDirectory(client, settings), settings), name=args.name
    )
    signal.signal(signal.SIGTERM, lambda *_: relay.stop())
    print("ready", flush=True)
    relay.run()


if __name__ == "__main__":
    main()
