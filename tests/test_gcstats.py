"""services/gcstats.py: a settled process's full collections skip startup's objects, and every
collection is measured (run in a child process: freezing the test process would keep its garbage)."""

from __future__ import annotations

import subprocess
import sys

CHILD = r"""
import gc, time
import router_svc.app, tokenizer_svc.app  # what a service has imported by the time it serves
from prometheus_client import REGISTRY
from services import gcstats

def full_ms():
    start = time.perf_counter(); gc.collect(); return (time.perf_counter() - start) * 1000

before = min(full_ms() for _ in range(3))
frozen = gcstats.settle()
after = min(full_ms() for _ in range(3))
count = REGISTRY.get_sample_value("tokenrelay_gc_pause_seconds_count", {"generation": "2"})
print(frozen, before, after, count)
"""


def test_settle_freezes_startup_objects_and_pauses_are_counted() -> None:
    out = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, check=True, timeout=120)
    frozen, before, after, count = out.stdout.split()
    assert int(frozen) > 10_000                   # imports alone leave tens of thousands of objects
    assert float(after) < float(before) / 5       # a full collection no longer walks them
    assert float(count) >= 4                      # settle's own collection and the three after it
