"""Webhook fan-out cost: what publishing a webhook event adds to the application's transaction.

One process, ONE connection (pool of one), no wake (``valkey_url=None``); each side once per
round in rotating order, ``--rounds`` rounds of ``--txns`` transactions; the figure is the
median over rounds of transactions per second. Every transaction writes one application ORM
row (``bench_orders``) plus:

``publish``
    ``Publish("order.plain", tenant_id=t)``: an ordinary event with one subscriber (the
    baseline: one run, the ordinary statement).
``publish+webhook(0)``
    ``Publish("order.paid", tenant_id=t)``: the same subscriber, and the event is a webhook
    event, but the tenant has no endpoint (the statement variant with the endpoint join,
    finding nothing).
``publish+webhook(1)`` / ``(3)``
    the same for a tenant with 1 / 3 enabled, subscribed endpoints: 2 / 4 runs by the same
    one statement.

Other tenants hold 20 endpoints each, so the join reads through an index with other rows
in it. Reported: txn/s and the ratio to ``publish`` (paired within each round).
"""

from __future__ import annotations

import json
import time
from typing import Any

import _common as common
import sqlalchemy as sa
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, sessionmaker


class _Base(DeclarativeBase):
    pass


class Order(_Base):
    __tablename__ = "bench_orders"
    id: Mapped[int] = mapped_column(sa.BigInteger, sa.Identity(always=True), primary_key=True)
    tenant_id: Mapped[int] = mapped_column(sa.BigInteger)
    customer: Mapped[str] = mapped_column(sa.Text)
    amount: Mapped[float] = mapped_column(sa.Numeric(12, 2))


CATALOG: dict[str, Any] = {
    "version": 1,
    "tasks": {
        common.TENANT_TASK: {"queue": "default", "scope": "tenant"},
        "webhooks.deliver": {"scope": "tenant"},
    },
    "events": {
        "order.plain": {"subscribers": [common.TENANT_TASK]},
        "order.paid": {"subscribers": [common.TENANT_TASK, "webhooks.deliver"]},
    },
}
TENANT_WITH = {0: 1, 1: 2, 3: 3}  # endpoints → the tenant that has that many


def main() -> None:
    args = common.parser(__doc__, rounds=9).parse_args()
    txns = 200
    import sqla_outbox
    from sqla_outbox import Publish, webhooks
    from sqla_outbox.catalog import Catalog

    with common.bench_database(args, "sqla_outbox_bench_webhooks") as db:
        engine = sa.create_engine(db.sa_url, pool_size=1, max_overflow=0)
        maker = sessionmaker(engine)
        settings = common.settings(db, None)
        sqla_outbox.install(maker, settings, catalog=Catalog.from_dict(CATALOG))
        with maker() as session, session.begin():
            for count, tenant in TENANT_WITH.items():
                for _ in range(count):
                    session.add(
                        webhooks.new_endpoint(
                            tenant_id=tenant, url="https://a.example/in", events=["order.paid"]
                        )
                    )
            for tenant in range(4, 21):
                for _ in range(20):
                    session.add(
                        webhooks.new_endpoint(
                            tenant_id=tenant, url="https://b.example/in", events=["order.paid"]
                        )
                    )

        def side(event: str, tenant: int) -> Any:
            def run() -> float:
                common.truncate_outbox(db.url)
                started = time.perf_counter()
                for _ in range(txns):
                    with maker() as session, session.begin():
                        session.add(Order(tenant_id=tenant, customer="c", amount=1))
                        session.add(Publish(event, common.PAYLOAD, tenant_id=tenant))
                return txns / (time.perf_counter() - started)

            return run

        sides = {"publish": side("order.plain", 1)}
        sides.update({f"publish+webhook({n})": side("order.paid", t) for n, t in TENANT_WITH.items()})
        results = common.alternate(args.rounds, sides, log=False)
        print(f"{'side':<22} {'txn/s (median)':>15} {'vs publish':>11}")
        figures = {}
        for name in sides:
            ratio = common.paired_ratio(results, name, "publish")
            figures[name] = {
                "txn_per_s": round(common.median(results[name]), 1),
                "vs_publish": round(ratio, 3),
            }
            print(f"{name:<22} {figures[name]['txn_per_s']:>15,.1f} {ratio:>11.3f}")
        if args.json:
            with open(args.json, "w") as out:
                json.dump(figures, out, indent=2)
        engine.dispose()


if __name__ == "__main__":
    main()
