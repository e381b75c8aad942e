"""Calibrate the sim's cost model from measurements of a real backend (the `hf` one by default).

    python -m engine_svc.backends.sim_fit --model DIR [--hf-device cuda] --out costs.json
    python -m engine_svc --backend sim --sim-profile-file costs.json

`measure()` runs batches of concurrent requests (every batch size at two prompt lengths, all
submitted at once, EOS ignored) through any `Backend` and records each request's time to first
token and time per output token. `fit()` turns those into the cost model of `sim_cost.py`:

- decode: ``tpot = decode_step_time + decode_time_per_seq * B + decode_time_per_context_token * C``
  by least squares over the runs, with B the batch and C its mean context (B * (isl + osl / 2));
  two prompt lengths are what separate the per-sequence from the per-context-token part. A
  negative coefficient is dropped (set to 0) and the rest refitted.
- prefill: the batch's last first token waited for every prompt of the batch and one decode
  step, so ``prefill_time_per_token = sum(max ttft - first step) / sum(B * isl)`` over the runs.

The fit is as good as the backend's steps are steady; it is a starting point for a profile, not a
measurement of a GPU (the `h200-llama8b-fp8` profile is fitted to TensorRT-LLM's published figures).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import pathlib
import statistics
import sys
import time
from dataclasses import asdict, dataclass

from .base import Backend, GenerationEvent, GenerationRequest


@dataclass(frozen=True, slots=True)
class Run:
    batch: int
    isl: int
    osl: int
    max_ttft: float                     # seconds, the batch's last first token
    tpot: float                         # seconds per token after the first, mean over the batch


async def measure(backend: Backend, batches: list[int], isls: list[int], osl: int, vocab: int = 256) -> list[Run]:
    """One run per (batch, isl), one after another, on a started backend."""
    runs: list[Run] = []
    for isl in isls:
        for batch in batches:
            runs.append(await _run(backend, batch, isl, osl, vocab, tag=f"{isl}x{batch}"))
    return runs


async def _run(backend: Backend, batch: int, isl: int, osl: int, vocab: int, tag: str) -> Run:
    first: dict[str, float] = {}
    last: dict[str, float] = {}
    count: dict[str, int] = {}
    done = asyncio.Event()
    left = [batch]

    def sink(event: GenerationEvent) -> None:
        now = time.perf_counter()
        if event.token_ids:
            first.setdefault(event.request_id, now)
            last[event.request_id] = now
            count[event.request_id] = count.get(event.request_id, 0) + len(event.token_ids)
        if event.finished:
            left[0] -= 1
            if not left[0]:
                done.set()

    start = time.perf_counter()
    for i in range(batch):
        # Distinct prompts: nothing is served from a prefix cache.
        prompt = [(i * 7919 + j * 31 + 1) % vocab for j in range(isl)]
        request = GenerationRequest(f"fit-{tag}-{i}", prompt, osl, ignore_eos=True)
        backend.validate(request)
        backend.submit(request, sink)
    await done.wait()
    tpots = [(last[r] - first[r]) / (count[r] - 1) for r in first if count[r] > 1]
    return Run(batch, isl, osl, max(first.values()) - start, statistics.fmean(tpots) if tpots else 0.0)


def _solve(rows: list[list[float]], ys: list[float]) -> list[float]:
    """Least squares by the normal equations (3 unknowns at most; no numpy in the base install)."""
    n = len(rows[0])
    a = [[sum(r[i] * r[j] for r in rows) for j in range(n)] for i in range(n)]
    b = [sum(r[i] * y for r, y in zip(rows, ys, strict=True)) for i in range(n)]
    for col in range(n):   # Gauss-Jordan with partial pivoting
        pivot = max(range(col, n), key=lambda k: abs(a[k][col]))
        if abs(a[pivot][col]) < 1e-30:
            raise ValueError("the runs do not determine the model: use two prompt lengths and two batch sizes")
        a[col], a[pivot], b[col], b[pivot] = a[pivot], a[col], b[pivot], b[col]
        for k in range(n):
            if k != col:
                f = a[k][col] / a[col][col]
                a[k] = [x - f * y for x, y in zip(a[k], a[col], strict=True)]
                b[k] -= f * b[col]
    return [b[i] / a[i][i] for i in range(n)]


def fit(runs: list[Run]) -> dict[str, float]:
    """The cost fields of `SimConfig` that reproduce the runs best."""
    names = ["decode_step_time", "decode_time_per_seq", "decode_time_per_context_token"]
    features = [[1.0, float(r.batch), r.batch * (r.isl + r.osl / 2)] for r in runs]
    ys = [r.tpot for r in runs]
    keep = list(range(3))
    while True:
        coef = _solve([[f[i] for i in keep] for f in features], ys)
        negative = [i for i, c in zip(keep, coef, strict=True) if c < 0]
        if not negative or len(keep) == 1:
            break
        keep.remove(negative[0])
    costs = dict.fromkeys(names, 0.0)
    for i, c in zip(keep, coef, strict=True):
        costs[names[i]] = max(0.0, c)
    # The first token of a batch's last request waited for every prompt of the batch and one
    # decode step (at context batch * isl); pooled, so that the runs with most prompt tokens weigh most.
    first_steps = [costs["decode_step_time"] + costs["decode_time_per_seq"] * r.batch
                   + costs["decode_time_per_context_token"] * r.batch * r.isl for r in runs]
    waited = sum(max(0.0, r.max_ttft - step) for r, step in zip(runs, first_steps, strict=True))
    costs["prefill_time_per_token"] = waited / sum(r.batch * r.isl for r in runs)
    return costs


async def _main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m engine_svc.backends.sim_fit", description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True, help="JSON file for --sim-profile-file")
    parser.add_argument("--batches", default="1,4,16", help="batch sizes (comma-separated)")
    parser.add_argument("--isl", default="32,128", help="prompt lengths (comma-separated; two or more)")
    parser.add_argument("--osl", type=int, default=32, help="output tokens per request")
    args, engine_argv = parser.parse_known_args(argv)
    from services.config import load_settings

    from ..config import EngineSettings
    from . import create_backend

    settings = load_settings(EngineSettings, ["--backend", "hf", *engine_argv])
    backend = create_backend(settings)
    await backend.start()
    try:
        runs = await measure(backend, [int(b) for b in args.batches.split(",")], [int(n) for n in args.isl.split(",")],
                             args.osl, vocab=backend.vocab_size or 256)
    finally:
        await backend.close()
    costs = fit(runs)
    report = {"source": f"{settings.backend} {settings.backend_config().model}", "costs": costs,
              "runs": [asdict(r) for r in runs]}
    pathlib.Path(args.out).write_text(json.dumps(report, indent=2))
    print(json.dumps(costs))
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(_main(sys.argv[1:])))
