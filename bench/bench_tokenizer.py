"""Benchmark of tokenizer_svc: Tokenize through gRPC vs raw in-process encode_batch, and
Detokenize with one stream per request vs one multiplexed stream.

The service runs as a real process (`python -m tokenizer_svc`); this process is its gRPC client.
For each prompt size (~2k and ~32k tokens, cut from ../shared/data/text/state-of-the-union.txt)
and each client count (1 and N), it measures tokens/s through the service and, in the same run on
the same cores, tokens/s of the raw `Tokenizer.encode_batch_fast` on the same prompts (C prompts
per call for C clients, in a process of its own), and reports the ratio plus request latency
p50/p99. Detokenize: R requests of T tokens each, streamed one token per request per message,
either over R streams or multiplexed over one (median of runs).

Cores: by default the machine's cores are split in two halves; the service and the raw encoder
are pinned to the same half (`--service-cpus`), the bench client to the other (`--client-cpus`),
so the ratio compares the service with the library on the same cores and the client's own CPU
does not count against either. `--shared` pins nothing (everything shares every core).

    python bench/bench_tokenizer.py [--tokenizer PATH] [--clients 16] [--seconds 4] [--json]
        [--service-cpus 1] [--client-cpus 0] [--shared]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass
from typing import Any

REPO = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import psutil  # noqa: E402
from tokenizers import Tokenizer  # noqa: E402

from router_svc.tokenize_batch import MAX_CALLS  # noqa: E402
from router_svc.upstreams import TokenizerUpstream  # noqa: E402
from services.channels import open_channel  # noqa: E402
from services.grpc_util import wait_healthy  # noqa: E402
from services.proto.tokenrelay.v1 import tokenizer_pb2 as pb  # noqa: E402
from services.proto.tokenrelay.v1 import tokenizer_pb2_grpc  # noqa: E402

SHARED = pathlib.Path(os.environ.get("TOKENRELAY_SHARED_DATA", REPO.parent / "shared" / "data"))
TEXT_FILE = SHARED / "text" / "state-of-the-union.txt"
DEFAULT_TOKENIZER = SHARED / "tokenizers" / "gpt2" / "tokenizer.json"


@dataclass
class TokenizeRow:
    mode: str  # "direct": a Tokenize call per request; "coalesced": the router's batching client
    prompt_tokens: int   # mean over the prompts used
    clients: int
    requests: int
    service_tok_s: float
    raw_tok_s: float
    ratio: float
    p50_ms: float
    p99_ms: float
    # Tokens per CPU-second: the service process's own CPU vs the raw encoder's. On this 2-core box
    # the bench client shares the cores with the service, which caps the wall-clock ratio; this one
    # says what a tokenizer host with its cores to itself would get.
    service_tok_cpu_s: float = 0.0
    raw_tok_cpu_s: float = 0.0
    cpu_ratio: float = 0.0


@dataclass
class DetokRow:
    mode: str
    requests: int
    tokens_per_request: int
    messages_in: int
    tok_s: float
    seconds: float


def make_prompts(text: str, offsets: list[tuple[int, int]], tokens: int, count: int) -> list[str]:
    """`count` distinct prompts of about `tokens` tokens each, cut at token boundaries (`offsets`:
    the character spans of `text`'s tokens)."""
    prompts: list[str] = []
    step = max(1, (len(offsets) - tokens) // max(1, count))
    for i in range(count):
        start = (i * step) % max(1, len(offsets) - tokens)
        prompts.append(text[offsets[start][0]:offsets[min(start + tokens, len(offsets)) - 1][1]])
    return prompts


def parse_cpus(spec: str) -> set[int]:
    """'0-3,8' -> {0, 1, 2, 3, 8}."""
    cpus: set[int] = set()
    for part in spec.split(","):
        low, _, high = part.strip().partition("-")
        cpus.update(range(int(low), int(high or low) + 1))
    return cpus


def split_cpus(available: set[int]) -> tuple[set[int], set[int]]:
    """(service, client): the upper half of the cores for the service, the rest for the client."""
    ordered = sorted(available)
    half = max(1, len(ordered) // 2)
    return set(ordered[len(ordered) - half:]), set(ordered[:len(ordered) - half]) or set(ordered)


def _pin(cpus: set[int] | None) -> Callable[[], None] | None:
    """A preexec_fn that pins a child (and every thread it will start) to `cpus`."""
    if not cpus:
        return None
    return lambda: os.sched_setaffinity(0, cpus)


def _child_env(cpus: set[int] | None) -> dict[str, str]:
    """The raw encoder's library pool sized to its pinned cores (some sandboxes, gVisor among
    them, accept an affinity mask without enforcing it; the pool size still holds)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    if cpus:
        env["RAYON_NUM_THREADS"] = str(len(cpus))
    return env


class RawEncoder:
    """`encode_batch_fast` in a process of its own, pinned like the service, measured on request."""

    def __init__(self, tokenizer: pathlib.Path, cpus: set[int] | None) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, __file__, "--raw-worker", "--tokenizer", str(tokenizer)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, preexec_fn=_pin(cpus), env=_child_env(cpus))

    def measure(self, prompts: list[str], clients: int, seconds: float) -> tuple[float, float]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps({"prompts": prompts, "clients": clients, "seconds": seconds}) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError("raw encoder process died")
        answer = json.loads(line)
        return answer["tok_s"], answer["tok_cpu_s"]

    def stop(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        self.proc.wait(30)


def raw_worker(tokenizer: pathlib.Path) -> None:
    """The RawEncoder's process: a JSON request per line in, a JSON answer per line out."""
    tok = Tokenizer.from_file(str(tokenizer))
    tok.no_padding()
    tok.no_truncation()
    for line in sys.stdin:
        ask = json.loads(line)
        tok_s, tok_cpu_s = measure_raw(tok, ask["prompts"], ask["clients"], ask["seconds"])
        print(json.dumps({"tok_s": tok_s, "tok_cpu_s": tok_cpu_s}), flush=True)


def measure_raw(tok: Tokenizer, prompts: list[str], clients: int, seconds: float) -> tuple[float, float]:
    """Raw encode_batch_fast (tokens/s, tokens per CPU-second) with `clients` prompts per call."""
    tok.encode_batch_fast(prompts[:clients], add_special_tokens=False)   # warm-up
    done, i, start, cpu0 = 0, 0, time.perf_counter(), time.process_time()
    while time.perf_counter() - start < seconds:
        batch = [prompts[(i + k) % len(prompts)] for k in range(clients)]
        i += clients
        done += sum(len(e.ids) for e in tok.encode_batch_fast(batch, add_special_tokens=False))
    return done / (time.perf_counter() - start), done / max(time.process_time() - cpu0, 1e-9)


async def _drive(call: Callable[[int], Awaitable[int]], clients: int,
                 seconds: float) -> tuple[float, list[float], int]:
    """`clients` concurrent loops of `call(i)` (returns tokens) for `seconds`: tok/s, latencies, tokens."""
    latencies: list[float] = []
    tokens = 0
    end = time.perf_counter() + seconds

    async def client(index: int) -> None:
        nonlocal tokens
        i = index
        while time.perf_counter() < end:
            t0 = time.perf_counter()
            n = await call(i)  # not `tokens += await ...`: that reads `tokens` before the await
            latencies.append(time.perf_counter() - t0)
            tokens += n
            i += clients

    start = time.perf_counter()
    await asyncio.gather(*[client(k) for k in range(clients)])
    return tokens / (time.perf_counter() - start), latencies, tokens


async def measure_service(stubs: list[Any], prompts: list[str], clients: int,
                          seconds: float) -> tuple[float, list[float], int]:
    """One Tokenize call per request; client k calls replica k mod R."""
    requests = [pb.TokenizeRequest(inputs=[pb.TokenizeInput(text=p)]) for p in prompts]

    async def call(i: int) -> int:
        resp = await stubs[i % clients % len(stubs)].Tokenize(requests[i % len(requests)])
        return len(resp.results[0].ids)

    return await _drive(call, clients, seconds)


async def measure_coalesced(addresses: list[str], prompts: list[str], clients: int, seconds: float,
                            max_calls: int) -> tuple[float, list[float], int]:
    """Through the router's own tokenizer client (router_svc.upstreams.TokenizerUpstream): requests
    spread over the replicas, each replica's waiting requests batched into shared calls."""
    upstream = TokenizerUpstream(addresses, timeout=60, max_calls=max_calls)

    async def call(i: int) -> int:
        return len(await upstream.tokenize(text=prompts[i % len(prompts)]))

    try:
        return await _drive(call, clients, seconds)
    finally:
        await upstream.close()


async def measure_point(prompt_tokens: int, raw_encoder: RawEncoder, services: list[Service], prompts: list[str],
                        clients: int, args: argparse.Namespace, mode: str = "direct") -> TokenizeRow:
    """Raw and service measured in alternating rounds, so background load hits both alike."""
    raws, rates, ratios, latencies, raw_cpu, svc_cpu = [], [], [], [], [], []
    procs = [psutil.Process(service.proc.pid) for service in services]

    def service_cpu() -> float:
        return sum(sum(p.cpu_times()[:2]) for p in procs)

    for _ in range(args.rounds):
        raw, raw_per_cpu = raw_encoder.measure(prompts, clients, args.seconds / args.rounds)
        if mode == "direct":   # warm-up, outside the CPU window: a call per client
            await asyncio.gather(*(services[k % len(services)].stub.Tokenize(
                pb.TokenizeRequest(inputs=[pb.TokenizeInput(text=prompts[k % len(prompts)])]))
                for k in range(clients)))
        before = service_cpu()
        if mode == "coalesced":
            svc, lat, tokens = await measure_coalesced([s.address for s in services], prompts, clients,
                                                       args.seconds / args.rounds, args.max_calls)
        else:
            svc, lat, tokens = await measure_service([s.stub for s in services], prompts, clients,
                                                     args.seconds / args.rounds)
        svc_cpu.append(tokens / max(service_cpu() - before, 1e-9))
        raw_cpu.append(raw_per_cpu)
        raws.append(raw)
        rates.append(svc)
        ratios.append(svc / raw)
        latencies.extend(lat)
    q = statistics.quantiles(latencies, n=100) if len(latencies) >= 2 else [latencies[0]] * 99
    return TokenizeRow(mode, prompt_tokens, clients, len(latencies),
                       statistics.median(rates), statistics.median(raws), statistics.median(ratios),
                       statistics.median(latencies) * 1e3, q[98] * 1e3, statistics.median(svc_cpu),
                       statistics.median(raw_cpu), statistics.median(svc_cpu) / statistics.median(raw_cpu))


async def detok_single(stub: Any, ids: list[list[int]]) -> float:
    """One Detokenize stream per request, one token per message."""
    async def one(rid: str, seq: list[int]) -> None:
        call = stub.Detokenize()

        async def writer() -> None:
            await call.write(pb.DetokenizeRequest(open=[pb.DetokOpen(request_id=rid)]))
            for k, t in enumerate(seq):
                await call.write(pb.DetokenizeRequest(
                    tokens=[pb.DetokTokens(request_id=rid, token_ids=[t], final=k == len(seq) - 1)]))
            await call.done_writing()

        task = asyncio.create_task(writer())
        async for resp in call:
            if any(o.finished for o in resp.outputs):
                break
        await task

    start = time.perf_counter()
    await asyncio.gather(*[one(f"r{i}", seq) for i, seq in enumerate(ids)])
    return time.perf_counter() - start


async def detok_multiplexed(stub: Any, ids: list[list[int]]) -> float:
    """One stream; each message carries the next token of every request."""
    call = stub.Detokenize()
    rids = [f"r{i}" for i in range(len(ids))]
    length = len(ids[0])

    async def writer() -> None:
        await call.write(pb.DetokenizeRequest(open=[pb.DetokOpen(request_id=r) for r in rids]))
        for k in range(length):
            await call.write(pb.DetokenizeRequest(tokens=[
                pb.DetokTokens(request_id=r, token_ids=[seq[k]], final=k == length - 1)
                for r, seq in zip(rids, ids, strict=True)]))
        await call.done_writing()

    start = time.perf_counter()
    task = asyncio.create_task(writer())
    finished = 0
    async for resp in call:
        finished += sum(1 for o in resp.outputs if o.finished)
        if finished == len(ids):
            break
    await task
    return time.perf_counter() - start


class Service:
    """`python -m tokenizer_svc` on an ephemeral port, pinned to `cpus` when given. Its library
    pool is sized to those cores (some sandboxes, gVisor among them, accept an affinity mask
    without enforcing it; the pool size still holds), or to `threads` for unpinned replicas that
    share the cores."""

    def __init__(self, tokenizer: pathlib.Path, cpus: set[int] | None, extra: list[str] | None = None,
                 threads: int = 0) -> None:
        self._dir = tempfile.TemporaryDirectory(prefix="bench-tok-")
        self.port_file = pathlib.Path(self._dir.name) / "port"
        self.log = open(pathlib.Path(self._dir.name) / "log", "w")  # closed in stop()
        threads = len(cpus) if cpus else threads
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tokenizer_svc", "--tokenizer", str(tokenizer), "--port", "0",
             "--port-file", str(self.port_file), "--log-level", "WARNING",
             "--max-input-tokens", "-1", "--max-batch", "256",
             *(["--library-threads", str(threads)] if threads else []), *(extra or [])],
            cwd=REPO, stdout=self.log, stderr=subprocess.STDOUT, preexec_fn=_pin(cpus),
            env=_child_env(None))
        self.address = ""
        self.channel: Any = None
        self.stub: Any = None

    async def start(self) -> None:
        deadline = time.monotonic() + 120
        while not self.port_file.exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("tokenizer service did not start: " + self.log.name)
            await asyncio.sleep(0.05)
        self.address = f"127.0.0.1:{int(self.port_file.read_text())}"
        await wait_healthy(self.address, timeout=30)
        self.channel = open_channel(self.address)
        self.stub = tokenizer_pb2_grpc.TokenizerStub(self.channel)

    async def stop(self) -> None:
        if self.channel is not None:
            await self.channel.close()
        self.proc.terminate()
        self.proc.wait(30)
        self.log.close()
        self._dir.cleanup()


def split_groups(cpus: set[int] | None, groups: int) -> list[set[int] | None]:
    """`cpus` cut into `groups` contiguous sets whose sizes differ by at most one."""
    if not cpus:
        return [None] * groups
    ordered = sorted(cpus)
    if groups > len(ordered):
        raise SystemExit(f"{groups} replicas on {len(ordered)} cores: at least one core each")
    bounds = [round(i * len(ordered) / groups) for i in range(groups + 1)]
    return [set(ordered[bounds[i]:bounds[i + 1]]) for i in range(groups)]


async def run(args: argparse.Namespace) -> dict[str, Any]:
    text = args.text.read_text(encoding="utf-8")
    tok = Tokenizer.from_file(str(args.tokenizer))
    tok.no_padding()
    tok.no_truncation()
    available = os.sched_getaffinity(0)
    service_cpus: set[int] | None = None
    client_cpus: set[int] | None = None
    if not args.shared:
        service_cpus, client_cpus = split_cpus(available)
        service_cpus = parse_cpus(args.service_cpus) if args.service_cpus else service_cpus
        client_cpus = parse_cpus(args.client_cpus) if args.client_cpus else client_cpus
        os.sched_setaffinity(0, client_cpus)   # before any channel, so gRPC's threads inherit it
    groups = split_groups(service_cpus, args.replicas)
    # Unpinned replicas (--shared) share the cores: each library pool gets its share of them.
    shared_threads = max(1, len(available) // args.replicas) if args.replicas > 1 else 0
    services = [Service(args.tokenizer, group, args.service_arg, shared_threads) for group in groups]
    raw_encoder = RawEncoder(args.tokenizer, service_cpus)
    rows: list[TokenizeRow] = []
    detok: list[DetokRow] = []
    try:
        for service in services:
            await service.start()
        stub = services[0].stub
        encoded = tok.encode(text, add_special_tokens=False)
        all_ids, offsets = encoded.ids, encoded.offsets
        for size in args.sizes:
            # Many distinct prompts, so repeats do not just measure the tokenizer's word cache.
            if size == "mixed":   # mostly 2k prompts, every 16th a 32k one (a long chat among short ones)
                short = make_prompts(text, offsets, 2048, 60)
                long = make_prompts(text, offsets, 32768, 4)
                prompts = [long[i // 16] if i % 16 == 15 else short[i - i // 16] for i in range(64)]
            else:
                prompts = make_prompts(text, offsets, int(size), max(args.clients, min(64, len(all_ids) // int(size))))
            mean_tokens = round(statistics.mean(
                len(e.ids) for e in tok.encode_batch_fast(prompts, add_special_tokens=False)))
            if "direct" in args.modes:
                for clients in sorted({1, args.clients}):
                    rows.append(await measure_point(mean_tokens, raw_encoder, services, prompts, clients, args))
            if "coalesced" in args.modes:
                rows.append(await measure_point(mean_tokens, raw_encoder, services, prompts, args.clients, args,
                                                mode="coalesced"))
        seqs = [all_ids[i * args.detok_tokens:(i + 1) * args.detok_tokens] for i in range(args.detok_requests)]
        total = args.detok_requests * args.detok_tokens
        for mode, fn in (("stream per request", detok_single), ("multiplexed", detok_multiplexed)):
            if not args.detok_requests:
                break
            await fn(stub, [s[:16] for s in seqs])   # warm-up
            secs = statistics.median([await fn(stub, seqs) for _ in range(args.repeats)])
            messages = total if fn is detok_single else args.detok_tokens
            detok.append(DetokRow(mode, args.detok_requests, args.detok_tokens, messages, total / secs, secs))
    finally:
        for service in services:
            await service.stop()
        raw_encoder.stop()
    return {"tokenizer": str(args.tokenizer), "cores": len(available), "seconds_per_point": args.seconds,
            "service_cpus": sorted(service_cpus or available), "client_cpus": sorted(client_cpus or available),
            "replicas": [sorted(group or available) for group in groups], "host": _host(),
            "tokenize": [asdict(r) for r in rows], "detokenize": [asdict(r) for r in detok]}


def _host() -> dict[str, str]:
    import platform

    import grpc
    import tokenizers
    model = ""
    with contextlib.suppress(OSError):
        model = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo")
                      if line.startswith("model name")), "")
    return {"cpu": model, "python": platform.python_version(), "grpcio": grpc.__version__,
            "tokenizers": tokenizers.__version__}


def print_table(result: dict[str, Any]) -> None:
    print(f"tokenizer: {result['tokenizer']}  cores: {result['cores']}  service and raw encoder on cores "
          f"{result['service_cpus']}, bench client on {result['client_cpus']}; replicas on {result['replicas']}")
    print("host: " + ", ".join(f"{k} {v}" for k, v in result["host"].items()))
    print(f"{'mode':>9} {'prompt':>7} {'clients':>7} {'reqs':>6} {'service tok/s':>14} {'raw tok/s':>12} {'ratio':>6} "
          f"{'p50 ms':>8} {'p99 ms':>8} {'svc tok/CPU-s':>14} {'raw tok/CPU-s':>14} {'CPU ratio':>9}")
    for r in result["tokenize"]:
        print(f"{r['mode']:>9} {r['prompt_tokens']:>7} {r['clients']:>7} {r['requests']:>6} "
              f"{r['service_tok_s']:>14,.0f} "
              f"{r['raw_tok_s']:>12,.0f} {r['ratio']:>6.2f} {r['p50_ms']:>8.2f} {r['p99_ms']:>8.2f} "
              f"{r['service_tok_cpu_s']:>14,.0f} {r['raw_tok_cpu_s']:>14,.0f} {r['cpu_ratio']:>9.2f}")
    print(f"\n{'detokenize':>20} {'requests':>9} {'tokens/req':>10} {'messages':>9} {'tok/s':>10} {'s':>6}")
    for r in result["detokenize"]:
        print(f"{r['mode']:>20} {r['requests']:>9} {r['tokens_per_request']:>10} {r['messages_in']:>9} "
              f"{r['tok_s']:>10,.0f} {r['seconds']:>6.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokenizer", type=pathlib.Path, default=DEFAULT_TOKENIZER)
    parser.add_argument("--text", type=pathlib.Path, default=TEXT_FILE, help="text the prompts are cut from")
    parser.add_argument("--clients", type=int, default=16, help="N concurrent clients (1 is always run)")
    parser.add_argument("--seconds", type=float, default=4.0, help="measuring time per point and side")
    parser.add_argument("--rounds", type=int, default=4, help="alternating raw/service rounds per point")
    parser.add_argument("--sizes", nargs="+", default=["2048", "32768"],
                        help="prompt sizes in tokens, or 'mixed' (15 of 16 prompts 2k tokens, one 32k)")
    parser.add_argument("--modes", nargs="+", choices=["direct", "coalesced"], default=["direct", "coalesced"],
                        help="direct: a Tokenize call per request; coalesced: the router's batching client")
    parser.add_argument("--replicas", type=int, default=1, help="tokenizer_svc processes, the service cores "
                        "split between them (the router spreads requests over them)")
    parser.add_argument("--max-calls", type=int, default=MAX_CALLS,
                        help="the coalescer's calls in flight (router default)")
    parser.add_argument("--detok-requests", type=int, default=128, help="0 skips the detokenize part")
    parser.add_argument("--detok-tokens", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=3, help="detokenize runs per mode (median is reported)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.add_argument("--json-out", type=pathlib.Path, help="also write the JSON result to this file")
    parser.add_argument("--service-cpus", help="cores of the service and the raw encoder, e.g. 1 or 8-15 "
                        "(default: the upper half)")
    parser.add_argument("--client-cpus", help="cores of the bench client (default: the other half)")
    parser.add_argument("--shared", action="store_true", help="pin nothing: client, service and raw share every core")
    parser.add_argument("--service-arg", action="append", default=[],
                        help="extra flag for tokenizer_svc, e.g. --service-arg=--no-library-parallelism")
    parser.add_argument("--raw-worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.raw_worker:
        raw_worker(args.tokenizer)
        return
    if not args.text.exists() or not args.tokenizer.exists():
        print(f"skipped: {args.text} or {args.tokenizer} is absent (development data from ../shared/data)")
        return
    result = asyncio.run(run(args))
    if args.json_out:
        args.json_out.write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2) if args.json else "", end="\n" if args.json else "")
    if not args.json:
        print_table(result)


if __name__ == "__main__":
    main()
