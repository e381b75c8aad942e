"""How requests reach the `hf` backend's generation thread, and how a benchmark phase ends (issue 13).

- transformers' batching thread does not poll for work: `add_request` sets the event the idle
  thread waits on (its 0.1 s timeout only bounds an idle wait), so a request sent to an engine idle
  for longer than that is in its scheduler within milliseconds. Guarded here with the pickup timed
  inside the generation thread (bench/hf_wave.py's probe), not through step times.
- bench/gpu/mesh_bench.py's in-process phase, cut short by its time limit, must abort what it
  leaves: it did not (cancelling the waiting task cancels the future it tested), and on the H200
  the 256-stream in-process phase left 256 requests running into the mesh phase after it.

Real model: stories260K (tests/artefacts.py).
"""

from __future__ import annotations

import asyncio
import pathlib
import statistics
import sys
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from engine_svc.backends.hf import HfBackend, HfConfig
from engine_svc.engine import Engine
from tests import artefacts
from tests.engine.engine_testkit import Collector, poll, req

REPO = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "bench"))
sys.path.insert(0, str(REPO / "bench" / "gpu"))

import hf_wave  # noqa: E402
import mesh_bench  # noqa: E402


@pytest.fixture
async def engine() -> AsyncIterator[Engine]:
    model = artefacts.path("stories260K")
    backend = HfBackend(HfConfig(model=str(model), threads=1, num_blocks=128, block_size=32,
                                 max_batch_tokens=256, max_batch_size=8, sampling=False))
    engine = Engine(backend, max_queued=64)
    await engine.start()
    try:
        yield engine
    finally:
        await engine.close()


async def test_an_idle_engine_picks_a_request_up_at_once(engine: Engine) -> None:
    backend: Any = engine.backend
    probe = hf_wave.Probe(backend._manager)
    delays = []
    for k in range(5):
        await asyncio.sleep(0.25)   # idle past the thread's 0.1 s wait
        out = Collector()
        rid = f"idle-{k}"
        sent = time.perf_counter()
        engine.submit(req(rid, [1, 5 + k, 7], max_tokens=1, ignore_eos=True), out)
        await out.wait(rid, timeout=30)
        picked = [t for key, t in probe.picked.items() if key.endswith(f":{rid}")]
        delays.append(picked[0] - sent)
    # A 100 ms poll would put the median near 50 ms; the event wakes it in well under 1 ms here.
    assert statistics.median(delays) < 0.02, delays


async def test_a_cut_short_in_process_phase_aborts_what_it_leaves(engine: Engine) -> None:
    send = mesh_bench.inproc_sender(engine)
    # 8 streams, requests far longer than the limit: every one is live when the phase is cut.
    phase = mesh_bench.Phase("inproc", streams=8, requests=16, prompt=16, output=450, seed=1, vocab=512,
                             warmups=0)
    row = await mesh_bench.closed_loop(phase, send, timeout=60, limit=0.5)
    assert row["truncated"] and row["error_kinds"].get("PHASE_LIMIT") == 8
    assert engine.live == 0
    backend: Any = engine.backend
    assert not backend._requests
    # ... and the manager lets go of them (cancelled on its next step, KV blocks freed).
    await poll(lambda: backend.load().active == 0 and backend.load().kv_blocks_used == 0, timeout=10)
