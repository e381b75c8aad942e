"""Load for bench_fairness.py: per-tenant closed- and open-loop gRPC clients, one record per request.

A `Phase` is what every load process runs at once: its `Flow`s (one per tenant: `streams`
closed-loop streams, each sending its next Generate as soon as the previous one ends, or an
open-loop Poisson `rate`), a warm-up, then the measured window. After the window the load goes on
(a *tail*, at most `tail` seconds) until every request started in the window has its first token,
so that the slowest measured requests are not cut off (their TTFT would be missing from the p99);
then everything still running is cancelled. Times in a `Rec` are seconds from the window's start.

Processes: `Workers` keeps N load processes (spawned once, each pinned to its CPU) that each run
their share of every phase (stream i of a flow goes to process i mod N, an N-th of each rate), or
runs the phase in this process when N is 0.
"""

from __future__ import annotations

import asyncio
import math
import multiprocessing as mp
import os
import queue
import random
import string
import time
from dataclasses import dataclass, field
from typing import Any

API_KEY_PREFIX = "trk-fairness-"
_LETTERS = string.ascii_letters + string.digits


def api_key(tenant: str) -> str:
    return API_KEY_PREFIX + tenant


@dataclass
class Flow:
    """One tenant's offered load in a phase."""

    tenant: str
    streams: int = 0          # closed loop: concurrent streams
    rate: float = 0.0         # open loop: requests per second (Poisson)
    timeout: float = 60.0     # the client's deadline of each request


@dataclass
class Phase:
    name: str
    flows: list[Flow]
    routers: list[str]
    prompt_tokens: int
    max_tokens: int           # mean output tokens; each request draws from [max/2, 3*max/2]
    warmup: float
    seconds: float
    tail: float = 5.0
    t0: float = 0.0           # wall clock (time.time()) at which every process starts sending
    seed: int = 0


@dataclass
class Rec:
    """One request, as its client saw it (seconds from the start of the measured window)."""

    tenant: str
    start: float
    ttft: float | None = None         # None: no token (refused, failed, or cut at the end)
    end: float | None = None
    tokens: int = 0                   # output tokens received inside the window
    prompt: int = 0                   # its prompt tokens, when its first token came inside the window
    completion: int = 0               # output tokens received in all
    outcome: str = ""                 # "done" | "CODE/REASON" | "" (cut by the bench)
    queue_s: float | None = None      # the router's admission wait (done.timings.queue_seconds)
    accepted: bool = False
    queued: bool = False              # an `accepted` with queue_position > 0 came


@dataclass
class _Clock:
    begin: float
    end: float
    hard_end: float
    waiting: int = 0                  # measured requests still without their first token
    stop: bool = False
    recs: list[Rec] = field(default_factory=list)
    lags: list[float] = field(default_factory=list)   # this process's loop lag (s), measured window only

    def rel(self) -> float:
        return time.monotonic() - self.begin

    def sending(self) -> bool:
        now = time.monotonic()
        return not self.stop and (now < self.end or (self.waiting > 0 and now < self.hard_end))


async def _request(stub: Any, flow: Flow, phase: Phase, rng: random.Random, clock: _Clock) -> Rec:
    from grpc import aio

    from services.errors import REASON_KEY
    from services.proto.tokenrelay.v1 import common_pb2, inference_pb2

    lo = max(1, phase.max_tokens // 2)
    max_tokens = rng.randint(lo, max(lo, phase.max_tokens + phase.max_tokens // 2))
    prompt = "".join(rng.choices(_LETTERS, k=phase.prompt_tokens))   # unique: no prefix-cache hits
    rec = Rec(flow.tenant, clock.rel())
    clock.recs.append(rec)
    measured = 0 <= rec.start < clock.end - clock.begin
    clock.waiting += measured
    window = clock.end - clock.begin
    call = stub.Generate(inference_pb2.GenerateRequest(prompt=prompt, sampling=common_pb2.SamplingParams(
        max_tokens=max_tokens, ignore_eos=True)), metadata=(("authorization", f"Bearer {api_key(flow.tenant)}"),),
        timeout=flow.timeout)
    try:
        async for msg in call:
            kind = msg.WhichOneof("event")
            if kind == "delta":
                now = clock.rel()
                n = len(msg.delta.text)    # ids below 128: one character per token
                rec.completion += n
                if rec.ttft is None:
                    rec.ttft = now - rec.start
                    clock.waiting -= measured
                    measured = False
                    if 0 <= now < window:
                        rec.prompt = phase.prompt_tokens
                if 0 <= now < window:
                    rec.tokens += n
            elif kind == "accepted":
                rec.accepted = True
                rec.queued = rec.queued or msg.accepted.queue_position > 0
            elif kind == "done":
                rec.outcome = "done"
                rec.queue_s = msg.done.timings.queue_seconds
    except aio.AioRpcError as err:
        reason = dict(err.trailing_metadata() or ()).get(REASON_KEY, "") or "NO_REASON"
        rec.outcome = f"{err.code().name}/{reason}"
    finally:
        rec.end = clock.rel()
        clock.waiting -= measured
        if not call.done():
            call.cancel()             # cut by the bench: the router frees its slot or queue entry
    return rec


async def _closed(stub: Any, flow: Flow, phase: Phase, rng: random.Random, clock: _Clock) -> None:
    while clock.sending():
        rec = await _request(stub, flow, phase, rng, clock)
        if rec.outcome != "done":
            await asyncio.sleep(0.02)     # refused: a closed loop must not spin on its refusals


async def _open(stub: Any, flow: Flow, rate: float, phase: Phase, rng: random.Random, clock: _Clock,
                tasks: set[asyncio.Task[Any]]) -> None:
    loop = asyncio.get_running_loop()
    due = loop.time()
    while clock.sending():
        due += rng.expovariate(rate)
        await asyncio.sleep(max(0.0, due - loop.time()))
        task = asyncio.ensure_future(_request(stub, flow, phase, rng, clock))
        tasks.add(task)
        task.add_done_callback(tasks.discard)


async def drive(phase: Phase, index: int, shares: int) -> tuple[list[Rec], list[float]]:
    """This process's share of `phase`: stream j of each flow if j % shares == index, rate / shares."""
    from services.channels import open_channel
    from services.proto.tokenrelay.v1 import inference_pb2_grpc
    from services.security import PLAINTEXT

    wait = phase.t0 - time.time()
    if wait > 0:
        await asyncio.sleep(wait)
    now = time.monotonic()
    begin = now + phase.warmup
    clock = _Clock(begin, begin + phase.seconds, begin + phase.seconds + phase.tail)
    channels = [open_channel(a, PLAINTEXT) for a in phase.routers]
    stubs = [inference_pb2_grpc.InferenceStub(c) for c in channels]
    rng = random.Random(phase.seed * 1000 + index)
    loops: list[Any] = []
    tasks: set[asyncio.Task[Any]] = set()
    for f, flow in enumerate(phase.flows):
        for j in range(index, flow.streams, shares):
            loops.append(_closed(stubs[(f + j) % len(stubs)], flow, phase, rng, clock))
        if flow.rate > 0:
            for r, stub in enumerate(stubs):   # the rate spread over the routers too
                loops.append(_open(stub, flow, flow.rate / shares / len(stubs), phase,
                                   random.Random(rng.random() + r), clock, tasks))
    runners = [asyncio.ensure_future(lp) for lp in loops]

    async def lag() -> None:
        # The load process's own share of every latency it records: how late its loop runs a 5 ms timer.
        while True:
            t = time.monotonic()
            await asyncio.sleep(0.005)
            if clock.begin <= t < clock.end:
                clock.lags.append(time.monotonic() - t - 0.005)

    runners.append(asyncio.ensure_future(lag()))
    while any(not r.done() for r in runners) and clock.sending():
        await asyncio.sleep(0.05)
    clock.stop = True
    for r in runners:
        r.cancel()
    for t in list(tasks):
        t.cancel()
    await asyncio.gather(*runners, *tasks, return_exceptions=True)
    for c in channels:
        await c.close()
    return clock.recs, clock.lags


def _worker(inbox: Any, outbox: Any, index: int, shares: int, cpus: list[int]) -> None:
    if cpus:
        os.sched_setaffinity(0, cpus)
    while True:
        phase = inbox.get()
        if phase is None:
            return
        outbox.put(asyncio.run(drive(phase, index, shares)))


class Workers:
    """N load processes kept for every phase (0 = the load runs in this process)."""

    def __init__(self, count: int, cpus: list[int]) -> None:
        ctx = mp.get_context("spawn")
        self.count = count
        self._out = ctx.Queue()
        self._ins = [ctx.Queue() for _ in range(count)]
        self.last_lags: list[float] = []   # the load processes' loop lags in the last phase's window (s)
        self._procs = [ctx.Process(target=_worker, args=(q, self._out, i, count,
                                                         [cpus[i % len(cpus)]] if cpus else []), daemon=True)
                       for i, q in enumerate(self._ins)]
        for p in self._procs:
            p.start()

    def run(self, phase: Phase) -> list[Rec]:
        phase.t0 = time.time() + (1.0 if self.count else 0.1)
        if not self.count:
            recs, self.last_lags = asyncio.run(drive(phase, 0, 1))
            return recs
        for q in self._ins:
            q.put(phase)
        recs: list[Rec] = []
        self.last_lags = []
        deadline = time.monotonic() + phase.warmup + phase.seconds + phase.tail + 120
        for _ in self._ins:
            while True:
                try:
                    got, lags = self._out.get(timeout=1.0)
                    recs += got
                    self.last_lags += lags
                    break
                except queue.Empty as empty:
                    dead = [p.exitcode for p in self._procs if not p.is_alive()]
                    if dead or time.monotonic() > deadline:
                        raise SystemExit(f"a load process died (exit codes {dead}) or hung in phase "
                                         f"{phase.name}") from empty
        return recs

    def close(self) -> None:
        for q in self._ins:
            q.put(None)
        for p in self._procs:
            p.join(10)
            if p.is_alive():
                p.kill()


# ------------------------------------------------------------------------------------ statistics
def percentile(values: list[float], q: float) -> float:
    """Nearest rank; inf (a request that never got its first token) sorts last."""
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, max(0, math.ceil(q / 100 * len(values)) - 1))]


def jain(xs: list[float]) -> float:
    return sum(xs) ** 2 / (len(xs) * sum(x * x for x in xs)) if xs and any(xs) else float("nan")


def measured(recs: list[Rec], window: float, tenants: set[str] | None = None) -> list[Rec]:
    """Requests started inside the measured window (of `tenants`, if given)."""
    return [r for r in recs if 0 <= r.start < window and (tenants is None or r.tenant in tenants)]


def ttfts(recs: list[Rec], window: float, tenants: set[str]) -> list[float]:
    """TTFT of every measured request that was not refused: inf for one that never got a token."""
    return [r.ttft if r.ttft is not None else math.inf for r in measured(recs, window, tenants)
            if r.accepted or r.ttft is not None]


def served(recs: list[Rec], tenant: str, prompt: bool = True) -> int:
    """Tokens the tenant was served inside the window (output, plus prompts when `prompt`)."""
    return sum(r.tokens + (r.prompt if prompt else 0) for r in recs if r.tenant == tenant)
