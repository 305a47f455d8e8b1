"""The cyclic garbage collector of a long-running process (serve, worker, consume).

Most of what a command allocates is freed by reference counting; the cyclic
collector only has to find cycles. With CPython's default thresholds it ran a
young collection every 700 net allocations and, every few thousand commands,
a full one over every object in the process — the ~160,000 that importing
FastAPI, SQLAlchemy, gRPC and the rest left behind included. Measured
ASGI-direct on this project's machine (100 rooms, 6,000 joins): 641 ms of
collections, ~100 µs a command, three full collections taking 436 ms of it
(docs/benchmarks.md, "Garbage collector").

So once a process has started: everything alive then is moved to the
permanent generation (:func:`gc.freeze`: never scanned again; it lives as long
as the process anyway), and a young collection waits for
``YOUNG_THRESHOLD`` net allocations. Cycles are still collected, a little
later; the older generations keep CPython's thresholds.
"""

from __future__ import annotations

import gc
from typing import Final

YOUNG_THRESHOLD: Final = 20_000  # CPython's default is 700


def settle_after_start() -> None:
    """Call once the process is serving: what start-up built is frozen, young collections are rarer."""
    gc.collect()  # start-up's own garbage is not frozen with the rest
    gc.freeze()
    _, middle, old = gc.get_threshold()
    gc.set_threshold(YOUNG_THRESHOLD, middle, old)
