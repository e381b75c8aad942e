"""The tokenizer starvation experiment: a naive monolith vs the mesh with N tokenizer replicas.

Unique long prompts (8k-32k tokens, log-uniform, cut at random token offsets of
../shared/data/text/state-of-the-union.txt, else of a synthetic English-like text), max_tokens 64
with ignore_eos, Poisson arrivals at ``--load`` x the simulated engine's capacity for
``--duration`` s, then a bounded drain, against each system in turn: ``monolith``
(bench/monolith.py: tokenization inline on the engine's event loop) and ``meshN`` (Redis, N
tokenizer_svc replicas of ``--tokenizer-workers`` encode threads each, engine_svc, router_svc as
real processes). Both run the same ``sim`` engine with the same settings. Reported over the
arrival window: client TTFT, engine busy fraction, starved / stalled engine time, admitted prompt
tokens/s and CPU per process; docs/benchmarks-starvation.md defines each and has the results.

    python bench/bench_starvation.py [--duration 45] [--load 1.2] [--prefill-us 18]
                                     [--systems monolith,mesh1,mesh2] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import collections
import contextlib
import itertools
import json
import math
import os
import pathlib
import random
import re
import statistics
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from typing import Any

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

import psutil
from prometheus_client.parser import text_string_to_metric_families
from tokenizers import Tokenizer

from engine_svc.backends.sim import SimConfig
from services.channels import open_channel
from services.client import Accepted, Client, Finished, Reason, TextDelta, TokenrelayError
from services.proto.tokenrelay.v1 import engine_pb2, engine_pb2_grpc
from tokenrelay_tools.cli.launcher import Mesh, MeshOptions

REPO = pathlib.Path(__file__).resolve().parent.parent
SHARED = pathlib.Path(os.environ.get("TOKENRELAY_SHARED_DATA", REPO.parent / "shared" / "data"))
TEXT_FILE = SHARED / "text" / "state-of-the-union.txt"
DEFAULT_TOKENIZER = SHARED / "tokenizers" / "llama2" / "tokenizer.json"
WORDS = ("the of and to in that is was for it with as on be at by this had not are but from or have they which one "
         "were all we there would their been has when who will more no if out so said what up about into than them "
         "can only other new some could time these two may then first any like our over such even most made after "
         "also many before must through back years where much way well down should because each just people how "
         "nation families workers energy economy health children future jobs country world").split()
Sample = tuple[float, int, int, int, float]  # (monotonic time, active, queued, prompt tokens, busy s)


# ------------------------------------------------------------------------------------ workload
def synthetic_text(chars: int, seed: int) -> str:
    """English-like filler (common words, sentences, paragraphs) for machines without the data."""
    rng, parts, size = random.Random(seed), [], 0
    while size < chars:
        parts.append(" ".join(rng.choices(WORDS, k=rng.randint(6, 24))).capitalize()
                     + rng.choice([". ", ". ", ", and ", "? ", ".\n\n"]))
        size += len(parts[-1])
    return "".join(parts)


@dataclass
class Workload:
    prompts: list[str]
    tokens: list[int]           # intended prompt lengths (re-encoding a cut may differ slightly)
    arrivals: list[float]       # seconds after t0
    rate: float
    capacity: float             # requests/s the simulated engine sustains on this mix


def engine_capacity(mean_tokens: float, prefill_per_token: float, max_tokens: int) -> float:
    """Requests/s the sim sustains when saturated: a prompt beyond max_num_tokens is prefilled
    alone (one step per admission), the KV cache (prompt + max_tokens reserved each) caps the
    batch, and each request needs max_tokens decode steps, shared by the batch."""
    cfg = SimConfig()
    batch = min(cfg.max_batch_size, cfg.num_blocks * cfg.tokens_per_block / (mean_tokens + max_tokens))
    step = cfg.decode_step_time + cfg.decode_time_per_seq * batch
    return 1.0 / (mean_tokens * prefill_per_token + max(1.0, max_tokens / batch) * step)


def build_workload(tok: Tokenizer, text: str, args: argparse.Namespace) -> Workload:
    rng = random.Random(args.seed)
    lo, hi = args.min_prompt_tokens, args.max_prompt_tokens
    offsets = tok.encode(text, add_special_tokens=False).offsets
    mean = (hi - lo) / math.log(hi / lo) if hi > lo else lo
    capacity = engine_capacity(mean, args.prefill_us * 1e-6, args.max_tokens)
    rate = args.rate or args.load * capacity
    arrivals: list[float] = []
    t = rng.expovariate(rate)
    while t < args.duration:
        arrivals.append(t)
        t += rng.expovariate(rate)
    tokens = [round(math.exp(rng.uniform(math.log(lo), math.log(hi)))) for _ in arrivals]
    if len(offsets) - hi < 2 * len(tokens):
        raise SystemExit(f"the text has {len(offsets)} tokens: too few for {len(tokens)} unique prompts")
    # Distinct offsets into a text that does not repeat itself: no two prompts share a first
    # KV block, so the engine's prefix cache never helps (drawn without replacement, since
    # a few hundred random offsets would otherwise collide now and then).
    starts = rng.sample(range(len(offsets) - hi), len(tokens))
    prompts = [text[offsets[s][0]:offsets[s + n - 1][1]] for s, n in zip(starts, tokens, strict=True)]
    return Workload(prompts, tokens, arrivals, rate, capacity)


# ------------------------------------------------------------------------------------- systems
def engine_flags(args: argparse.Namespace) -> list[str]:
    """Sim settings both systems share: context for the longest prompt, the prefill cost (the
    mesh's engine also gets the tokenizer's vocabulary size from the launcher)."""
    return ["--sim-max-context", str(args.max_prompt_tokens + args.max_tokens + 1024),
            "--sim-prefill-time-per-token", repr(args.prefill_us * 1e-6)]


class System(Mesh):
    """A system under test as real processes (the launcher's process handling) + its load samples."""

    def __init__(self, name: str, tokenizer: pathlib.Path, work: pathlib.Path, args: argparse.Namespace) -> None:
        super().__init__(MeshOptions(model=tokenizer, engine="sim", port=0, run_dir=work,
                                     state_file=work / "state.json", max_in_flight=1_000_000,
                                     startup_timeout=120, log_level="WARNING"))
        self.name, self.args = name, args

    def pids(self) -> dict[str, int]:
        return {p.name: p.popen.pid for p in self.procs}

    async def begin(self) -> None:
        """Start sampling the engine's load (just before the window opens)."""

    async def busy_now(self) -> float | None:
        """Cumulative engine busy seconds, where they can be read from outside the process."""
        return None

    async def finish(self) -> list[Sample]:
        raise NotImplementedError

    async def close(self) -> None:
        await asyncio.to_thread(self.stop)


class MonolithSystem(System):
    """bench/monolith.py; it samples its own load and writes the samples out at shutdown."""

    async def start(self) -> str:
        self.o.run_dir.mkdir(parents=True, exist_ok=True)
        port_file, self.trace = self.o.run_dir / "monolith.port", self.o.run_dir / "load.json"
        port_file.unlink(missing_ok=True)  # a stale one from an earlier run in this work dir
        proc = self._spawn("monolith", [
            sys.executable, str(REPO / "bench" / "monolith.py"), "--tokenizer", str(self.o.model), "--port", "0",
            "--port-file", str(port_file), "--load-trace", str(self.trace),
            "--sample-interval", str(self.args.sample_interval), *engine_flags(self.args)])
        self.router_address = await self._wait_port(proc, port_file)
        return self.router_address

    async def finish(self) -> list[Sample]:
        await self.close()
        return [tuple(s) for s in json.loads(self.trace.read_text())["samples"]]  # type: ignore[misc]


class MeshSystem(System):
    """Redis, N tokenizer replicas, the engine and the router; this process polls the engine's
    GetLoad for the load samples (the launcher's own mesh has one tokenizer)."""

    def __init__(self, replicas: int, tokenizer: pathlib.Path, work: pathlib.Path, args: argparse.Namespace) -> None:
        super().__init__(f"mesh{replicas}", tokenizer, work, args)
        self.replicas = replicas
        self.samples: list[Sample] = []
        self._poller: asyncio.Task[None] | None = None

    async def start(self) -> str:
        self.o.tokenizer_replicas = self.replicas
        self.o.tokenizer_args = ["--workers", str(self.args.tokenizer_workers), "--library-threads", "1"]
        self.o.engine_args = engine_flags(self.args)
        return await super().start()

    async def begin(self) -> None:
        self._poller = asyncio.create_task(self._poll(), name="engine-load-poller")

    async def _poll(self) -> None:
        async with open_channel(self.addresses["engine"]) as channel:
            stub = engine_pb2_grpc.EngineStub(channel)
            tick = time.monotonic()
            while True:
                t_a = time.monotonic()
                r = await stub.GetLoad(engine_pb2.LoadRequest(), timeout=5)
                t_b = time.monotonic()
                self.samples.append(((t_a + t_b) / 2, r.active_requests, r.queued_requests,
                                     r.prompt_tokens_total, math.nan))
                tick += self.args.sample_interval  # paces the sampling; nothing waits on it
                await asyncio.sleep(max(0.0, tick - time.monotonic()))

    async def busy_now(self) -> float | None:
        return await asyncio.to_thread(scrape_busy, self.metrics["engine"])

    async def finish(self) -> list[Sample]:
        if self._poller is not None:
            self._poller.cancel()
            (result,) = await asyncio.gather(self._poller, return_exceptions=True)
            if isinstance(result, Exception):  # the engine stopped answering: the samples are void
                raise RuntimeError(f"engine load polling failed: {result}") from result
        return self.samples


def scrape_busy(url: str) -> float:
    """Seconds of engine steps the sim charged so far (prefill + decode step-seconds sums)."""
    text = urllib.request.urlopen(url, timeout=5).read().decode()
    names = {"tokenrelay_engine_prefill_step_seconds_sum", "tokenrelay_engine_decode_step_seconds_sum"}
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples if s.name in names)


def cpu_seconds(pids: dict[str, int]) -> dict[str, float]:
    """CPU time (user + system, all threads) each process has used so far, and the machine's."""
    m = psutil.cpu_times()
    out = {"machine": m.user + m.nice + m.system + getattr(m, "irq", 0.0) + getattr(m, "softirq", 0.0)}
    for name, pid in pids.items():
        with contextlib.suppress(psutil.Error):
            t = psutil.Process(pid).cpu_times()
            out[name] = t.user + t.system
    return out


# ------------------------------------------------------------------------------------- driving
@dataclass
class Record:
    tokens: int
    sent: float = math.nan
    handed: float | None = None      # when the engine got it: `accepted` + admission wait
    first: float | None = None       # first token received
    ended: float = math.nan
    tokenize_seconds: float = 0.0
    cached_tokens: int = 0
    error: str = ""
    error_message: str = ""


async def one_request(client: Client, prompt: str, rec: Record, at: float, args: argparse.Namespace) -> None:
    await asyncio.sleep(max(0.0, at - time.monotonic()))  # the Poisson schedule
    rec.sent = time.monotonic()
    accepted = None
    try:
        async for event in client.stream(prompt, max_tokens=args.max_tokens, ignore_eos=True,
                                         return_token_ids=True, timeout=args.duration + args.drain_timeout + 60):
            if isinstance(event, Accepted):
                accepted = time.monotonic()
            elif isinstance(event, TextDelta) and event.token_ids and rec.first is None:
                rec.first = time.monotonic()
            elif isinstance(event, Finished):
                # The router sends `accepted` after tokenizing, then waits for admission, then
                # submits; the monolith submits first. Either way this is when the engine had it.
                rec.handed = (accepted or rec.sent) + event.queue_seconds
                rec.tokenize_seconds, rec.cached_tokens = event.tokenize_seconds, event.cached_tokens
    except TokenrelayError as exc:
        rec.error, rec.error_message = exc.reason, exc.message
    except asyncio.CancelledError:
        rec.error = Reason.BENCH_DRAIN_TIMEOUT
        raise
    finally:
        rec.ended = time.monotonic()
        if rec.handed is None:  # failed or cut off: stopped waiting for the engine at the latest now
            rec.handed = accepted or rec.first or rec.ended


async def drive(system: System, workload: Workload, args: argparse.Namespace) -> dict[str, Any]:
    """Warm up, run the schedule, drain; returns the records and what was sampled."""
    records = [Record(n) for n in workload.tokens]
    async with Client(system.router_address, system.api_key) as client:
        warm = synthetic_text(2000, args.seed + 1)  # shares no prefix with the workload's prompts
        for _ in range(2):  # channels, tokenizer and detokenizer streams established before t0
            await client.generate(warm, max_tokens=4, ignore_eos=True)
        busy_a = await system.busy_now()
        await system.begin()
        pids = {"bench": os.getpid(), **system.pids()}
        cpu_a, t_cpu = cpu_seconds(pids), time.monotonic()
        t0 = time.monotonic() + 0.2
        tasks = [asyncio.create_task(one_request(client, p, r, t0 + at, args))
                 for p, r, at in zip(workload.prompts, records, workload.arrivals, strict=True)]
        await asyncio.sleep(max(0.0, t0 + args.duration - time.monotonic()))
        busy_b, t_b, cpu_b = await system.busy_now(), time.monotonic(), cpu_seconds(pids)
        _, pending = await asyncio.wait(tasks, timeout=args.drain_timeout) if tasks else (set(), set())
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
    samples = await system.finish()
    busy = None if busy_a is None or busy_b is None else (busy_b - busy_a) * args.duration / (t_b - t0)
    cpu = {name: (cpu_b[name] - cpu_a[name]) / (t_b - t_cpu) for name in cpu_b if name in cpu_a}
    cpu["other"] = cpu.pop("machine") - sum(cpu.values())  # anything else running on this machine
    return {"records": records, "samples": samples, "busy": busy, "window": (t0, t0 + args.duration), "cpu": cpu}


# ------------------------------------------------------------------------------------ analysis
def _at(times: list[float], values: list[float], t: float) -> float:
    """The sampled value holding at time t (samples are a step function)."""
    return values[max(0, bisect.bisect_right(times, t) - 1)]


def idle_breakdown(samples: list[Sample], records: list[Record], a: float, b: float) -> dict[str, float]:
    """Seconds in [a, b]: the engine empty; and, while a sent request had not reached the engine
    yet, the engine empty ("idle") or with no prompt waiting to be prefilled ("prefill")."""
    times = [s[0] for s in samples]
    active, queued = [float(s[1]) for s in samples], [float(s[2]) for s in samples]
    sent = sorted(r.sent for r in records if not math.isnan(r.sent))
    handed = sorted(r.handed for r in records if r.handed is not None)
    cuts = sorted({a, b, *(t for t in (*times, *sent, *handed) if a < t < b)})
    out = {"empty_s": 0.0, "idle_starved_s": 0.0, "prefill_starved_s": 0.0}
    for p, q in itertools.pairwise(cuts):
        mid = (p + q) / 2
        no_prompt = _at(times, queued, mid) == 0
        empty = no_prompt and _at(times, active, mid) == 0
        upstream = bisect.bisect_right(sent, mid) > bisect.bisect_right(handed, mid)
        out["empty_s"] += (q - p) * empty
        out["idle_starved_s"] += (q - p) * (empty and upstream)
        out["prefill_starved_s"] += (q - p) * (no_prompt and upstream)
    return out


def percentile(values: list[float], q: int) -> float:
    if len(values) < 2:
        return values[0] if values else math.nan
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1]


def summarize(name: str, run: dict[str, Any], workload: Workload) -> dict[str, Any]:
    records, samples, (a, b) = run["records"], run["samples"], run["window"]
    wall, times = b - a, [s[0] for s in samples]
    busy = run["busy"]
    if busy is None:  # monolith: cumulative busy seconds are in its samples
        busy = _at(times, [s[4] for s in samples], b) - _at(times, [s[4] for s in samples], a)
    prompt = _at(times, [s[3] for s in samples], b) - _at(times, [s[3] for s in samples], a)
    idle = idle_breakdown(samples, records, a, b)
    ok = [r for r in records if r.first is not None]
    ttft = [r.first - r.sent for r in ok]
    return {
        "system": name, "sent": len(records), "with_first_token": len(ok),
        "errors": dict(collections.Counter(r.error for r in records if r.error)),
        "error_examples": {r.error: r.error_message for r in reversed(records) if r.error},
        "ttft_p50_s": percentile(ttft, 50), "ttft_p90_s": percentile(ttft, 90), "ttft_p99_s": percentile(ttft, 99),
        "tokenize_p50_ms": percentile([r.tokenize_seconds * 1000 for r in ok], 50),
        "window_s": wall, "busy_s": busy, "busy_fraction": busy / wall, **idle,
        "idle_starved_fraction": idle["idle_starved_s"] / wall,
        "prefill_starved_fraction": idle["prefill_starved_s"] / wall,
        "stalled_s": max(0.0, wall - busy - idle["empty_s"]),
        "prompt_tokens_per_s": prompt / wall, "offered_prompt_tokens_per_s": sum(workload.tokens) / wall,
        "cached_tokens": sum(r.cached_tokens for r in records), "load_samples": len(samples),
        "cpu_cores": {name: round(cores, 3) for name, cores in run["cpu"].items()},
    }


def table(rows: list[dict[str, Any]]) -> str:
    head = (f"{'system':<9} {'ok/sent':>9} {'TTFT p50':>9} {'p90':>7} {'p99':>7} {'tok p50':>9} {'busy':>6} "
            f"{'starved:idle':>13} {'starved:prefill':>16} {'stalled':>8} {'prompt tok/s':>13}")
    lines = [head, "-" * len(head)]
    for r in rows:
        idle = f"{r['idle_starved_s']:.2f}s {r['idle_starved_fraction']:.1%}"
        prefill = f"{r['prefill_starved_s']:.2f}s {r['prefill_starved_fraction']:.1%}"
        lines.append(
            f"{r['system']:<9} {r['with_first_token']:>4}/{r['sent']:<4} {r['ttft_p50_s']:>8.2f}s "
            f"{r['ttft_p90_s']:>6.2f}s {r['ttft_p99_s']:>6.2f}s {r['tokenize_p50_ms']:>7.1f}ms "
            f"{r['busy_fraction']:>6.1%} {idle:>13} {prefill:>16} {r['stalled_s']:>7.2f}s "
            f"{r['prompt_tokens_per_s']:>13,.0f}")
    lines.append("CPU cores used in the window (user + system):")
    lines += [f"  {r['system']:<9} " + "  ".join(f"{k} {v:.2f}" for k, v in r["cpu_cores"].items()) for r in rows]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------- main
def make_system(name: str, tokenizer: pathlib.Path, work: pathlib.Path, args: argparse.Namespace) -> System:
    if name == "monolith":
        return MonolithSystem(name, tokenizer, work / name, args)
    match = re.fullmatch(r"mesh(\d+)", name)
    if not match or int(match.group(1)) < 1:
        raise SystemExit(f"--systems: unknown system {name!r} (monolith, mesh1, mesh2, ...)")
    return MeshSystem(int(match.group(1)), tokenizer, work / name, args)


async def run(args: argparse.Namespace, work: pathlib.Path) -> dict[str, Any]:
    text, source = (TEXT_FILE.read_text(encoding="utf-8"), str(TEXT_FILE)) if TEXT_FILE.exists() \
        else (synthetic_text(1_500_000, args.seed), "synthetic")
    tokenizer = pathlib.Path(args.tokenizer) if args.tokenizer else DEFAULT_TOKENIZER
    if not tokenizer.exists():
        raise SystemExit(f"{tokenizer}: no such tokenizer; pass --tokenizer (a tokenizer.json or its directory)")
    tok = Tokenizer.from_file(str(tokenizer / "tokenizer.json" if tokenizer.is_dir() else tokenizer))
    workload = build_workload(tok, text, args)
    print(f"[starvation] {len(workload.prompts)} requests over {args.duration:.0f}s at {workload.rate:.2f} req/s "
          f"(engine capacity ~{workload.capacity:.2f} req/s); text={source} tokenizer={tokenizer}", file=sys.stderr)
    rows = []
    for name in args.systems.split(","):
        system = make_system(name.strip(), tokenizer, work, args)
        try:
            await system.start()
            rows.append(summarize(system.name, await drive(system, workload, args), workload))
        finally:
            await system.close()
        print(f"[starvation] {name}: done", file=sys.stderr)
    config = {k: v for k, v in vars(args).items() if k != "json"}
    return {"config": {**config, "text": source, "tokenizer": str(tokenizer), "cpu_count": os.cpu_count(),
                       "requests": len(workload.prompts), "rate": workload.rate,
                       "engine_capacity": workload.capacity}, "systems": rows}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="bench_starvation.py", description=__doc__.splitlines()[0])
    p.add_argument("--systems", default="monolith,mesh1,mesh2", help="comma list: monolith, meshN")
    p.add_argument("--tokenizer", default="",
                   help="tokenizer.json or its dir (default: the development data's Llama 2 tokenizer, "
                        "$TOKENRELAY_SHARED_DATA/tokenizers/llama2, when present; else pass one, e.g. the byte "
                        "tokenizer `tokenrelay up --engine sim` builds)")
    p.add_argument("--duration", type=float, default=45.0, help="seconds of arrivals (the measured window)")
    p.add_argument("--load", type=float, default=1.2, help="offered load as a multiple of engine capacity")
    p.add_argument("--rate", type=float, default=0.0, help="requests/s (overrides --load)")
    p.add_argument("--min-prompt-tokens", type=int, default=8192)
    p.add_argument("--max-prompt-tokens", type=int, default=32768)
    p.add_argument("--max-tokens", type=int, default=64, help="completion tokens per request")
    p.add_argument("--prefill-us", type=float, default=SimConfig().prefill_time_per_token * 1e6,
                   help="sim prefill cost, microseconds per prompt token (both systems)")
    p.add_argument("--tokenizer-workers", type=int, default=1, help="encode threads per tokenizer replica")
    p.add_argument("--sample-interval", type=float, default=0.01, help="engine load sampling period (s)")
    p.add_argument("--drain-timeout", type=float, default=120.0, help="seconds to let requests finish")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--work-dir", default="", help="logs and run files (default: a temporary directory)")
    p.add_argument("--json", default="", help="write the results here")
    args = p.parse_args(argv)
    if args.max_tokens < 1 or not 0 < args.min_prompt_tokens <= args.max_prompt_tokens:
        p.error("need max_tokens >= 1 and 0 < min_prompt_tokens <= max_prompt_tokens")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # One core per encode thread in this process and in the monolith (which inherits it): the
    # tokenizers library would otherwise fan a batch out over every core. The mesh's replicas get
    # the same from --library-threads 1 (tokenizer_svc sets this variable itself).
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    with tempfile.TemporaryDirectory(prefix="starvation-") as tmp:
        result = asyncio.run(run(args, pathlib.Path(args.work_dir or tmp)))
    print(table(result["systems"]))
    if args.json:  # NaN (e.g. no TTFT at all) is not JSON: null instead
        clean = json.loads(json.dumps(result), parse_constant=lambda _: None)
        pathlib.Path(args.json).write_text(json.dumps(clean, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
