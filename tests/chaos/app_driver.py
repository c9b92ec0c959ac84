"""The application process of the chaos run: commits a steady stream of transactions.

Each transaction dispatches one to three runs (some delayed, some a Publish fanning out to two
subscribers); about one in ten is rolled back on purpose. Every transaction's outcome is
appended to a JSON-lines file: ``committed``, ``rolled_back``, ``not_committed`` (an error
before COMMIT was sent: nothing can exist) or ``uncertain`` (the connection broke during
COMMIT: all of its runs exist or none do). SIGTERM ends the stream after the transaction in
progress.

    python -m tests.chaos.app_driver --out outcomes.jsonl --rate 20
"""

from __future__ import annotations

import argparse
import json
import random
import signal
import time
from typing import Any

import sqlalchemy as sa
from sqlalchemy.orm import sessionmaker

import sqla_outbox
from sqla_outbox import Dispatch, OutboxSettings, Publish

TASKS = ["chaos.critical", "chaos.default", "chaos.bulk", "chaos.maintenance"]


class RolledBack(Exception):
    pass


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--rate", type=float, default=20.0, help="transactions per second")
    parser.add_argument("--seed", type=int, default=7)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    stop = {"now": False}
    signal.signal(signal.SIGTERM, lambda *_: stop.update(now=True))

    settings = OutboxSettings.from_env()
    engine = sa.create_engine(
        settings.sqlalchemy_url, pool_pre_ping=True, connect_args={"connect_timeout": 3}
    )
    maker = sessionmaker(engine)
    sqla_outbox.install(maker, settings)
    interval = 1.0 / args.rate
    n = 0
    with open(args.out, "a", encoding="utf-8") as out:
        while not stop["now"]:
            started = time.monotonic()
            n += 1
            record = one_transaction(maker, rng, n)
            out.write(json.dumps(record) + "\n")
            out.flush()
            time.sleep(max(0.0, interval - (time.monotonic() - started)))
    engine.dispose()


def one_transaction(maker: Any, rng: random.Random, n: int) -> dict[str, Any]:
    expect: dict[str, str] = {}
    roll_back = rng.random() < 0.1
    phase = "before_commit"
    try:
        with maker() as session:
            with session.begin():
                for _ in range(rng.randint(1, 2)):
                    payload = {
                        "tx": n,
                        "doomed": rng.random() < 0.05,
                        "flaky": rng.random() < 0.15,
                        "text": rng.random() < 0.5,
                        "work_ms": rng.choice([0, 0, 20, 150]),
                    }
                    delay = rng.choice([0, 0, 0, 0.5, 2.0])
                    tenant = rng.choice([None, 1, 2, 3, 4, 5])
                    item = Dispatch(rng.choice(TASKS), payload, delay=delay, tenant_id=tenant)
                    session.add(item)
                    expect[str(item.run_id)] = "failed" if payload["doomed"] else "succeeded"
                if rng.random() < 0.3:
                    event = Publish(
                        "chaos.happened",
                        {"tx": n, "flaky": rng.random() < 0.2, "text": rng.random() < 0.5, "work_ms": 20},
                        tenant_id=rng.choice([None, 2]),
                    )
                    session.add(event)
                    expect.update({str(run_id): "succeeded" for run_id in event.runs.values()})
                session.flush()
                if roll_back:
                    raise RolledBack
                phase = "commit"
        return {"tx": n, "outcome": "committed", "expect": expect}
    except RolledBack:
        return {"tx": n, "outcome": "rolled_back", "expect": expect}
    except sa.exc.DBAPIError as exc:
        time.sleep(0.2)
        outcome = "uncertain" if phase == "commit" else "not_committed"
        return {"tx": n, "outcome": outcome, "expect": expect, "error": type(exc.orig).__name__}


if __name__ == "__main__":
    main()
