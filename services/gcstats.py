"""The garbage collector in a serving process: its pauses measured, and startup's objects set aside.

CPython's cyclic collector stops the whole process while it runs. Measured in the sim mesh under the
`chat-multiturn` load (this 2-core box, 35 s): every service ran ~4-5 young collections a second and
one middle-generation collection every 2-3 s, and the one full collection each took 24 ms (router),
48 ms (engine) and 157 ms (tokenizer), most of it walking the objects that startup made (imports, the
tokenizer, the model, settings) and that live as long as the process.

`settle()`, called once a service is ready to serve: collects once, then moves everything alive
into the permanent generation (`gc.freeze()`), so later collections, the full ones included, walk only
what serving allocated since. `install()` adds the pause histogram
``tokenrelay_gc_pause_seconds{generation}`` (one callback per collection: two clock reads) so a
latency tail can be checked against the collector in production.
"""

from __future__ import annotations

import gc
import time
from typing import Any

from prometheus_client import Histogram

from services.metrics import FAST_BUCKETS

GC_PAUSE = Histogram("tokenrelay_gc_pause_seconds", "Time the cyclic garbage collector held the process, per "
                     "collection, by generation", ["generation"], buckets=FAST_BUCKETS)
_started = [0.0]
_children = [GC_PAUSE.labels(str(g)) for g in range(3)]


def _on_gc(phase: str, info: dict[str, Any]) -> None:
    if phase == "start":
        _started[0] = time.perf_counter()
    else:
        _children[info["generation"]].observe(time.perf_counter() - _started[0])


def install() -> None:
    """Measure every collection (idempotent)."""
    if _on_gc not in gc.callbacks:
        gc.callbacks.append(_on_gc)


def settle() -> int:
    """Collect once, then freeze what is alive (startup's objects); returns how many were frozen."""
    install()
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()
