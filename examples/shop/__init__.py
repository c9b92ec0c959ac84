"""A small multi-tenant shop that uses sqla_outbox the way an application would.

* ``models.py`` — its own tables (tenants, products, orders, and what handlers write).
* ``app.py`` — use cases: placing an order commits the order, dispatches a receipt and
  publishes ``order.placed`` in the same transaction.
* ``tasks.py`` — the handlers the worker loads (``--imports examples.shop.tasks``).
* ``tasks.json`` — the catalog the API side reads, generated from ``tasks.py``.
* ``alembic.ini`` + ``migrations/`` — its own Alembic environment, with sqla_outbox's
  migrations beside its own (the recipe in ``docs/alembic.md``).
"""
