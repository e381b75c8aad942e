"""A wave of requests into the `hf` backend in process: how fast transformers' batching thread
picks them up, and how many prefill steps the wave's first tokens take (issue 13).

    python bench/hf_wave.py                                   # stories260K on this CPU
    python bench/hf_wave.py --requests 16 --spread-ms 0 5 10 20 --repeats 5 --json /tmp/wave.json
    python bench/hf_wave.py --model DIR --device cuda --dtype bfloat16 --max-batch-tokens 8192 ...

For each spread, a wave of ``--requests`` requests (``--prompt`` random ids, ``--output`` tokens,
ignore_eos) is submitted to a started `HfBackend` from its event loop: all in one loop turn
(spread 0) or evenly over ``--spread-ms`` milliseconds. Measured per wave: TTFT p50 / p99 (submit
-> first token at the sink), the wave's total time (first submit -> last finish), the pickup
delay (submit -> the generation thread moves the request into its scheduler: the polling the
GPU write-up suspected) and how many generation steps the wave's first tokens came from. The
steps are read by wrapping the manager's output router and scheduler (bench-only instrumentation:
the backend is unchanged). Also measured: the pickup of one request sent to an idle engine, after
``--idle-s`` seconds of nothing (a 100 ms poll would show as ~50 ms on average).

Prints one line per spread and, with ``--json``, every figure.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import pathlib
import random
import statistics
import sys
import time
from typing import Any

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

DEFAULT_MODEL = pathlib.Path(__file__).resolve().parents[2] / "shared" / "data" / "models" / "stories260K"


def pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[max(0, min(len(s) - 1, math.ceil(len(s) * q / 100) - 1))] if s else float("nan")


class Probe:
    """What the generation thread does, timed: when each request reaches the scheduler, and which
    step (the manager's batch counter) produced each request's first token, and each step's time,
    requests and query tokens. Wraps private parts of transformers 5.24 (bench only)."""

    def __init__(self, manager: Any) -> None:
        self.manager = manager
        self.picked: dict[str, float] = {}
        self.first_step: dict[str, int] = {}
        processor = manager.batch_processor
        scheduler = processor.scheduler
        add = scheduler.add_waiting_request

        def add_waiting_request(state: Any) -> None:
            self.picked.setdefault(state.request_id, time.perf_counter())
            add(state)

        scheduler.add_waiting_request = add_waiting_request
        router = manager.output_router
        deliver = router.deliver_batch

        def deliver_batch(outputs: list[Any]) -> None:
            step = int(getattr(manager, "current_batch", 0))
            for out in outputs:
                self.first_step.setdefault(out.request_id, step)
            deliver(outputs)

        router.deliver_batch = deliver_batch
        self.steps: list[tuple[float, float, int, int]] = []   # (start, end, requests, query tokens)
        self._batch: tuple[int, int] = (0, 0)
        schedule = scheduler.schedule_batch

        def schedule_batch(*args: Any) -> Any:
            result = schedule(*args)
            if result[0]:
                self._batch = (len(result[0]), int(result[2]))
            return result

        scheduler.schedule_batch = schedule_batch
        step = manager._generation_step

        def generation_step() -> None:
            t = time.perf_counter()
            step()
            self.steps.append((t, time.perf_counter(), *self._batch))

        manager._generation_step = generation_step


async def wave(backend: Any, probe: Probe, tag: str, n: int, spread_ms: float, prompt: int, output: int,
               vocab: int, seed: int) -> dict[str, Any]:
    from engine_svc.backends.base import GenerationEvent, GenerationRequest

    rng = random.Random(seed)
    prompts = [[rng.randrange(3, vocab) for _ in range(prompt)] for _ in range(n)]
    loop = asyncio.get_running_loop()
    submitted: dict[str, float] = {}
    first: dict[str, float] = {}
    ended: dict[str, float] = {}
    done = loop.create_future()

    def sink(event: GenerationEvent) -> None:
        now = time.perf_counter()
        if event.token_ids:
            first.setdefault(event.request_id, now)
        if event.finished:
            ended[event.request_id] = now
            if len(ended) == n and not done.done():
                done.set_result(None)

    def send(i: int) -> None:
        rid = f"{tag}-{i}"
        submitted[rid] = time.perf_counter()
        backend.submit(GenerationRequest(request_id=rid, prompt_token_ids=prompts[i], max_tokens=output,
                                         ignore_eos=True), sink)

    t0 = loop.time()
    for i in range(n):
        if spread_ms <= 0:
            send(i)
        else:
            loop.call_at(t0 + spread_ms / 1000 * i / max(1, n - 1), send, i)
    await asyncio.wait_for(done, 120)
    start = min(submitted.values())
    ttft = [first[r] - submitted[r] for r in submitted]
    pickup = [probe.picked[k] - submitted[k.split(":", 1)[1]] for k in probe.picked
              if k.split(":", 1)[1] in submitted]
    steps = sorted({probe.first_step[k] for k in probe.first_step if k.split(":", 1)[1] in submitted})
    during = [st for st in probe.steps if st[0] >= start - 1e-3 and st[1] <= max(first.values()) + 1e-3]
    return {"spread_ms": spread_ms, "requests": n, "ttft_p50_ms": 1000 * pct(ttft, 50),
            "ttft_p99_ms": 1000 * pct(ttft, 99), "ttft_max_ms": 1000 * max(ttft),
            "total_ms": 1000 * (max(ended.values()) - start),
            "pickup_p50_ms": 1000 * pct(pickup, 50), "pickup_max_ms": 1000 * max(pickup),
            "first_token_steps": len(steps),
            "steps_to_last_first_token": [(round(1000 * (b - start), 1), round(1000 * (e - b), 1), r, q)
                                          for b, e, r, q in during]}


async def idle_pickup(backend: Any, probe: Probe, idle_s: float, tries: int, vocab: int) -> list[float]:
    from engine_svc.backends.base import GenerationEvent, GenerationRequest

    out = []
    for k in range(tries):
        await asyncio.sleep(idle_s)
        done = asyncio.get_running_loop().create_future()

        def sink(event: GenerationEvent, done: asyncio.Future[None] = done) -> None:
            if event.finished and not done.done():
                done.set_result(None)

        rid = f"idle-{k}"
        t = time.perf_counter()
        backend.submit(GenerationRequest(request_id=rid, prompt_token_ids=[5 + k, 7, 9], max_tokens=1,
                                         ignore_eos=True), sink)
        await asyncio.wait_for(done, 30)
        picked = [v for key, v in probe.picked.items() if key.endswith(f":{rid}")]
        out.append(1000 * (picked[0] - t))
    return out


async def main_async(a: argparse.Namespace) -> dict[str, Any]:
    from engine_svc.backends.hf import HfBackend, HfConfig

    backend = HfBackend(HfConfig(model=str(a.model), device=a.device, dtype=a.dtype, threads=a.threads,
                                 num_blocks=a.num_blocks, block_size=a.block_size,
                                 max_batch_tokens=a.max_batch_tokens, max_batch_size=a.max_batch_size,
                                 sampling=False, random_weights=a.random_weights))
    await backend.start()
    try:
        probe = Probe(backend._manager)
        vocab = int(backend.vocab_size)
        # Its own seed: no measured prompt may hit the warm-up's cached blocks.
        await wave(backend, probe, "warm", 2, 0, a.prompt, 2, vocab, seed=-1)
        idle = await idle_pickup(backend, probe, a.idle_s, a.idle_tries, vocab)
        rows = []
        for spread in a.spread_ms:
            runs = [await wave(backend, probe, f"w{spread}-{k}", a.requests, spread, a.prompt, a.output, vocab,
                               seed=1000 * k + int(spread)) for k in range(a.repeats)]
            row = {key: statistics.median(r[key] for r in runs) for key in runs[0]
                   if key != "steps_to_last_first_token"}
            row["runs"] = runs
            rows.append(row)
            print(f"spread {spread:5.1f} ms  N={a.requests}: TTFT p50 {row['ttft_p50_ms']:7.1f} p99 "
                  f"{row['ttft_p99_ms']:7.1f} ms  total {row['total_ms']:7.1f} ms  pickup p50 "
                  f"{row['pickup_p50_ms']:5.2f} max {row['pickup_max_ms']:5.2f} ms  first-token steps "
                  f"{row['first_token_steps']:.0f}  (median of {a.repeats})", flush=True)
        print(f"idle pickup ({a.idle_tries} tries after {a.idle_s} s idle): p50 {statistics.median(idle):.2f} "
              f"max {max(idle):.2f} ms", flush=True)
        return {"settings": {k: (str(v) if isinstance(v, pathlib.Path) else v) for k, v in vars(a).items()},
                "rows": rows, "idle_pickup_ms": idle}
    finally:
        await backend.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=pathlib.Path, default=DEFAULT_MODEL)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--random-weights", action="store_true")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--prompt", type=int, default=64)
    p.add_argument("--output", type=int, default=16)
    p.add_argument("--spread-ms", type=float, nargs="+", default=[0.0, 5.0, 10.0, 20.0])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--num-blocks", type=int, default=256)
    p.add_argument("--block-size", type=int, default=32)
    p.add_argument("--max-batch-tokens", type=int, default=2048)
    p.add_argument("--max-batch-size", type=int, default=32)
    p.add_argument("--idle-s", type=float, default=0.3)
    p.add_argument("--idle-tries", type=int, default=10)
    p.add_argument("--json", default="")
    a = p.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", str(a.threads))
    result = asyncio.run(main_async(a))
    if a.json:
        pathlib.Path(a.json).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
