"""A moto SQS server for development, tests and the demo, with one race fixed.

moto (5.x) appends sent messages under the queue's lock but rebuilds the message list
in ``Queue.delete_message`` without it, so a message sent while another is being deleted
can vanish (seen about 1 run in 1,000 under concurrent send/delete). Real SQS never does
that, and a lost message would look like our bug, so every moto server this repository
starts runs with :func:`patch_moto` applied.

    python -m sqla_outbox.moto_server -H 127.0.0.1 -p 5000

moto is a development dependency (``pip install 'sqla-outbox[dev]'``), never needed in
production.
"""

from __future__ import annotations

import functools
import sys
from typing import Any


def patch_moto() -> None:
    """Make moto's ``Queue.delete_message`` hold the queue's message lock (idempotent)."""
    from moto.sqs import models

    original = models.Queue.delete_message
    if getattr(original, "_sqla_outbox_locked", False):
        return

    @functools.wraps(original)
    def delete_message(self: Any, receipt_handle: str) -> None:
        with self._messages_lock:  # a threading.Condition over an RLock: re-entrant
            original(self, receipt_handle)

    delete_message._sqla_outbox_locked = True  # type: ignore[attr-defined]
    models.Queue.delete_message = delete_message  # type: ignore[method-assign]


def main(argv: list[str] | None = None) -> None:
    """Run ``moto.server`` (same arguments) with the patch applied."""
    patch_moto()
    from moto.server import main as moto_main

    moto_main(sys.argv[1:] if argv is None else argv)


if __name__ == "__main__":
    main()
