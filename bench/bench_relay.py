"""Relay cost of the router: output tokens and client messages per router CPU-second.

Real processes: redis-server, ``--tokenizers`` tokenizer_svc processes (1 by default; the byte-level
tokenizer of `up --engine sim`), ``--engines`` `sim` engine processes (1 by default, all the same
config) with fast steps (``--step-ms``, 1 ms by default, no per-sequence or prefill cost, so the engine is
never what limits), ``--routers`` router processes (each pointed at every tokenizer and every engine), and
``--clients`` load-generator
processes (multiprocessing, raw stubs, closed loop: each stream sends its next Generate as soon as
the previous one ends). For each stream count in ``--streams`` it runs the mesh, then the same load
driven at the engines alone (their multiplexed Stream, one per load process and engine; the streams are
spread evenly over the engines and the tokens/s summed; ``--calibrated`` runs each sim as one H200 with
Llama 3.1 8B FP8 instead of fast steps, so ``--engines 4`` is four simulated GPUs), and reports, over the
measured window (after ``--warmup``): output tokens/s, router CPU-seconds (psutil, every thread),
output tokens per router CPU-second, client messages per router CPU-second, tokens per message,
TTFT p50/p99 (measured by the client from the call's start), and the ratio mesh / engine alone.

Every process can be pinned (``--router-cpus 0 --redis-cpus 1 --tokenizer-cpus 2 --engine-cpus 3
--client-cpus 4-15``: one CPU list per role; routers and clients take one CPU each, round robin). On
a machine with few cores leave them out: nothing is pinned and the figures are noisy. With ``--engines N``
or ``--tokenizers N`` above 1 each engine / tokenizer takes one CPU of its list, round robin; a single one
takes the whole list, as before.

``--targets bare`` adds a baseline measured in the same run on the router's CPU: a bare grpc.aio
server of the real ``Inference.Generate`` (``bench/bare_inference.py``) that writes one-token deltas,
one asyncio wake-up each, paced by a ticker (``--bare-step-ms``; 0, the default, runs it flat out, as
saturated as a router that one-token deltas keep busy); the same clients drive it. Each mesh
row then shows its client messages per CPU-second as a ratio of the bare server's (``mesh/bare``):
what the router costs per message over the floor of grpc.aio on the same core, in the same minute.
It is the figure to read with ``--step-ms 10 --router-arg=--engine-wake-delay=0`` (one token per
message, like the bare server's).

``--probe-cpu N`` runs a fixed pure-Python loop on CPU N (left free) during each measured window and
prints its work per CPU-second beside the row: on a shared (virtual) host a CPU-second is not a fixed
amount of work, and the probe shows how fast the host's cores ran in that window.

    python bench/bench_relay.py --streams 64 256 1024 --duration 10 --json-out relay.json
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import json
import multiprocessing as mp
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

import grpc
import psutil

from services.errors import REASON_KEY
from services.eventloop import LOOP_CHOICES
from services.redis_client import unix_socket_listening

API_KEY = "trk-bench-relay"
# The sim draws ids below --sim-vocab-size; the byte-level tokenizer's ids 32..126 are printable
# ASCII bytes, each decoded to one character, so a delta's length is its token count. Below 128
# every id is one ASCII byte: the sim's vocabulary is 128 and control characters count too.
VOCAB = 128


def cpu_list(spec: str) -> list[int]:
    """'0,2-4' → [0, 2, 3, 4]; '' → []."""
    cpus: list[int] = []
    for part in filter(None, (p.strip() for p in spec.split(","))):
        lo, _, hi = part.partition("-")
        cpus += range(int(lo), int(hi or lo) + 1)
    return cpus


def _pin(cpus: list[int]) -> Any:
    if not cpus:
        return None
    return lambda: os.sched_setaffinity(0, cpus)


def cpu_share(cpus: list[int], index: int, count: int) -> list[int]:
    """The CPUs of process ``index`` of ``count`` of one role: one each, round robin; a lone process
    (``count`` 1) keeps the whole list."""
    if not cpus or count == 1:
        return list(cpus)
    return [cpus[index % len(cpus)]]


def role_name(role: str, index: int, count: int) -> str:
    """'engine' for a lone engine (its log and port files keep their names), else 'engine0', 'engine1'..."""
    return role if count == 1 else f"{role}{index}"


def spread(streams: int, clients: int, targets: int) -> list[list[tuple[int, int]]]:
    """Per load process, its (target index, streams) pairs: the processes take contiguous shares of the
    streams (as even as can be), and the streams are cut into ``targets`` contiguous blocks, one per
    target, as even as can be. So each target gets streams // targets or one more, and a process
    talks to one target or a few neighbouring ones."""
    clients = max(1, min(clients, streams))
    targets = max(1, targets)
    plan: list[list[tuple[int, int]]] = []
    first = 0
    for i in range(clients):
        share = streams // clients + (1 if i < streams % clients else 0)
        counts: dict[int, int] = {}
        for j in range(first, first + share):
            t = j * targets // streams
            counts[t] = counts.get(t, 0) + 1
        plan.append(sorted(counts.items()))
        first += share
    return plan


# ------------------------------------------------------------------------------------ processes
@dataclass
class Procs:
    work: pathlib.Path
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)

    def spawn(self, name: str, argv: list[str], cpus: list[int]) -> subprocess.Popen[bytes]:
        log = open(self.work / f"{name}.log", "wb")
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env, preexec_fn=_pin(cpus),
                                start_new_session=True)
        log.close()
        self.procs[name] = proc
        return proc

    def service(self, name: str, module: str, extra: list[str], cpus: list[int]) -> pathlib.Path:
        port_file = self.work / f"{name}.port"
        port_file.unlink(missing_ok=True)
        self.spawn(name, [sys.executable, "-m", module, "--host", "127.0.0.1", "--port", "0",
                          "--port-file", str(port_file), "--log-level", "WARNING", "--metrics-port", "0",
                          "--metrics-port-file", str(self.work / f"{name}.metrics-port"), *extra], cpus)
        return port_file

    def wait_port(self, name: str, port_file: pathlib.Path, timeout: float = 120) -> str:
        deadline = time.monotonic() + timeout
        while not port_file.exists() or not port_file.read_text().strip():
            proc = self.procs[name]
            if proc.poll() is not None:
                raise SystemExit(f"{name} exited {proc.returncode}:\n{(self.work / f'{name}.log').read_text()[-3000:]}")
            if time.monotonic() > deadline:
                raise SystemExit(f"{name} did not start in {timeout}s")
            time.sleep(0.05)
        return f"127.0.0.1:{port_file.read_text().strip()}"

    def stop(self) -> None:
        for proc in reversed(self.procs.values()):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in reversed(self.procs.values()):
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(OSError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        self.procs.clear()


@dataclass
class Mesh:
    routers: list[str]
    router_pids: list[int]
    engines: list[str]
    engine_pids: list[int]
    engine_metrics: list[str] = field(default_factory=list)
    tokenizers: list[str] = field(default_factory=list)
    tokenizer_pids: list[int] = field(default_factory=list)
    bare: str = ""          # the bare grpc.aio baseline (--targets bare), its address and pid
    bare_pid: int = 0


def engine_e2e(url: str) -> tuple[float, float]:
    """(sum, count) of the engine's submit-to-finish histogram: where a request's time went."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    if not url:
        return 0.0, 0.0
    total = count = 0.0
    for family in text_string_to_metric_families(urllib.request.urlopen(url, timeout=5).read().decode()):
        for sample in family.samples:
            if sample.name == "tokenrelay_engine_e2e_seconds_sum":
                total += sample.value
            elif sample.name == "tokenrelay_engine_e2e_seconds_count":
                count += sample.value
    return total, count


def engines_e2e(urls: list[str]) -> list[tuple[float, float]]:
    """engine_e2e of every engine."""
    return [engine_e2e(url) for url in urls]


def start_mesh(args: argparse.Namespace, procs: Procs) -> Mesh:
    from tokenrelay_tools.cli.byte_tokenizer import ensure_byte_tokenizer

    tokenizer = ensure_byte_tokenizer(procs.work / "cache")
    sock = procs.work / "redis.sock"
    procs.spawn("redis", [shutil.which("redis-server") or "redis-server", "--port", "0", "--unixsocket", str(sock),
                          "--save", "", "--appendonly", "no", "--dir", str(procs.work)], cpu_list(args.redis_cpus))
    tok_cpus, eng_cpus = cpu_list(args.tokenizer_cpus), cpu_list(args.engine_cpus)
    tok_names = [role_name("tokenizer", i, args.tokenizers) for i in range(args.tokenizers)]
    tok_ports = [procs.service(name, "tokenizer_svc", ["--tokenizer", str(tokenizer)],
                               cpu_share(tok_cpus, i, args.tokenizers)) for i, name in enumerate(tok_names)]
    # --calibrated: the sim's defaults (one H200, Llama 3.1 8B FP8, TensorRT-LLM's published figures).
    sim = [] if args.calibrated else [
        "--sim-decode-step-time", str(args.step_ms / 1000), "--sim-decode-time-per-seq", str(args.per_seq_us * 1e-6),
        "--sim-prefill-time-per-token", "0", "--sim-max-batch-size", str(max(args.streams) + 64),
        "--sim-num-blocks", "1000000"]
    eng_names = [role_name("engine", i, args.engines) for i in range(args.engines)]
    eng_ports = [procs.service(name, "engine_svc", [
        "--backend", "sim", "--max-queued", "100000", "--sim-vocab-size", "259", "--sim-sample-ids-below", str(VOCAB),
        *sim, *args.engine_arg],
        cpu_share(eng_cpus, i, args.engines)) for i, name in enumerate(eng_names)]
    tenants = procs.work / "tenants.yaml"
    tenants.write_text("tenants:\n  - name: bench\n"
                       f"    api_key_sha256: {hashlib.sha256(API_KEY.encode()).hexdigest()}\n"
                       "    max_in_flight: 100000\n    max_queued: 100000\n")
    deadline = time.monotonic() + 20
    while not unix_socket_listening(sock):
        if time.monotonic() > deadline:
            raise SystemExit("redis-server did not start")
        time.sleep(0.02)
    toks = [procs.wait_port(name, port) for name, port in zip(tok_names, tok_ports, strict=True)]
    engs = [procs.wait_port(name, port) for name, port in zip(eng_names, eng_ports, strict=True)]
    router_cpus = cpu_list(args.router_cpus)
    ports = [procs.service(f"router{i}", "router_svc", [
        "--tokenizers", ",".join(toks), "--engines", ",".join(engs), "--redis-url", f"unix://{sock}",
        "--tenants-file", str(tenants), "--tokenizer-files", str(tokenizer),   # for --detokenize local
        *args.router_arg], [router_cpus[i % len(router_cpus)]] if router_cpus else [])
        for i in range(args.routers)]
    routers = [procs.wait_port(f"router{i}", p) for i, p in enumerate(ports)]
    bare, bare_pid = "", 0
    if "bare" in args.targets:   # on the router's CPU: the same core's floor
        bare_port = procs.work / "bare.port"
        procs.spawn("bare", [sys.executable, str(pathlib.Path(__file__).resolve().parent / "bare_inference.py"),
                             "--port-file", str(bare_port), "--step-ms", str(args.bare_step_ms),
                             "--event-loop", args.bare_event_loop],
                    router_cpus[:1])
        bare, bare_pid = procs.wait_port("bare", bare_port), procs.procs["bare"].pid
    metrics = [f"http://127.0.0.1:{(procs.work / f'{name}.metrics-port').read_text().strip()}/metrics"
               for name in eng_names]
    return Mesh(routers, [procs.procs[f"router{i}"].pid for i in range(args.routers)], engs,
                [procs.procs[name].pid for name in eng_names], metrics, toks,
                [procs.procs[name].pid for name in tok_names], bare, bare_pid)


# ------------------------------------------------------------------------------------ load
@dataclass
class Load:
    target: str          # "mesh" | "engine" | "bare"
    addresses: list[str]
    streams: int
    max_tokens: int
    prompt: str
    warmup: float
    duration: float
    t0: float            # wall clock (time.time()) at which every process starts sending
    min_delta_tokens: int = 0   # the mesh's clients ask for coarser deltas (service-to-service callers)
    gap: float = 0.0            # seconds each stream waits after a request (0: back to back)
    mesh_calls: str = "call"    # "stream": each load process puts its requests on one open Stream call per router


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(q / 100 * len(values)))]


async def _drive_mesh(load: Load, address: str, streams: int, stats: dict[str, Any]) -> None:
    from services.channels import open_channel
    from services.proto.tokenrelay.v1 import common_pb2, inference_pb2, inference_pb2_grpc
    from services.security import PLAINTEXT

    channel = open_channel(address, PLAINTEXT)
    stub = inference_pb2_grpc.InferenceStub(channel)
    metadata = (("authorization", f"Bearer {API_KEY}"),)
    request = inference_pb2.GenerateRequest(prompt=load.prompt, min_delta_tokens=load.min_delta_tokens,
                                            sampling=common_pb2.SamplingParams(max_tokens=load.max_tokens,
                                                                               ignore_eos=True))
    begin, end = stats["begin"], stats["end"]

    async def one_stream() -> None:
        while time.monotonic() < end:
            start = time.monotonic()
            first = True
            try:
                async for msg in stub.Generate(request, metadata=metadata):
                    if msg.WhichOneof("event") != "delta":
                        continue
                    now = time.monotonic()
                    if first:
                        first = False
                        if begin <= start < end:
                            stats["ttft"].append(now - start)
                    if begin <= now < end:
                        stats["messages"] += 1
                        stats["tokens"] += len(msg.delta.text)
                        stats["by_address"][address] = stats["by_address"].get(address, 0) + len(msg.delta.text)
            except Exception as exc:  # noqa: BLE001 - counted, the stream goes on
                stats["errors"] += 1
                stats["last_error"] = _describe(exc)
                await asyncio.sleep(0.05)
            else:
                if begin <= start < end:
                    stats["requests"] += 1
            if load.gap:     # a stream at light load: the services' code runs cold (docs/benchmarks.md)
                await asyncio.sleep(load.gap)

    await asyncio.gather(*(one_stream() for _ in range(streams)))
    await channel.close()


async def _batches(outbox: asyncio.Queue[Any]) -> AsyncIterator[list[Any]]:
    """What was queued while the previous message went out, as one batch per message; None ends."""
    while (item := await outbox.get()) is not None:
        batch = [item]
        while not outbox.empty():
            nxt = outbox.get_nowait()
            if nxt is None:
                yield batch
                return
            batch.append(nxt)
        yield batch


async def _drive_mesh_stream(load: Load, address: str, streams: int, stats: dict[str, Any]) -> None:
    """The same closed loop over the router's Stream API: one open call per load process and router, each
    request on it (a client message is then one StreamResponse, which may carry many requests' deltas)."""
    from services.channels import open_channel
    from services.proto.tokenrelay.v1 import common_pb2, inference_pb2, inference_pb2_grpc
    from services.security import PLAINTEXT

    channel = open_channel(address, PLAINTEXT)
    stub = inference_pb2_grpc.InferenceStub(channel)
    metadata = (("authorization", f"Bearer {API_KEY}"),)
    sampling = common_pb2.SamplingParams(max_tokens=load.max_tokens, ignore_eos=True)
    outbox: asyncio.Queue[inference_pb2.StreamSubmit | None] = asyncio.Queue()
    begin, end = stats["begin"], stats["end"]
    started: dict[str, float] = {}
    seq = 0

    def submit() -> None:
        nonlocal seq
        seq += 1
        rid = f"{os.getpid()}-{address}-{seq}"   # ids are the tenant's across routers: one per call
        started[rid] = time.monotonic()
        outbox.put_nowait(inference_pb2.StreamSubmit(request=inference_pb2.GenerateRequest(
            prompt=load.prompt, request_id=rid, min_delta_tokens=load.min_delta_tokens, sampling=sampling)))

    async def outbound() -> Any:
        async for batch in _batches(outbox):
            yield inference_pb2.StreamRequest(submit=batch)

    for _ in range(streams):
        submit()
    first_seen: set[str] = set()
    loop = asyncio.get_running_loop()
    call = stub.Stream(outbound(), metadata=metadata)
    async for msg in call:
        now = time.monotonic()
        for ev in msg.events:
            rid, kind = ev.request_id, ev.WhichOneof("event")
            if kind == "delta":
                if rid not in first_seen:
                    first_seen.add(rid)
                    if begin <= started[rid] < end:
                        stats["ttft"].append(now - started[rid])
                if begin <= now < end:
                    stats["tokens"] += len(ev.delta.text)
                    stats["by_address"][address] = stats["by_address"].get(address, 0) + len(ev.delta.text)
            elif kind in ("done", "error"):
                if kind == "error":
                    stats["errors"] += 1
                    stats["last_error"] = f"{ev.error.code} {ev.error.reason}"
                elif begin <= started[rid] < end:
                    stats["requests"] += 1
                first_seen.discard(rid)
                del started[rid]
                if now < end:
                    loop.call_later(load.gap, submit) if load.gap else submit()
                elif not started:
                    outbox.put_nowait(None)
        if begin <= now < end:
            stats["messages"] += 1
    await channel.close()


async def _drive_engine(load: Load, address: str, streams: int, stats: dict[str, Any]) -> None:
    """The same closed loop straight at the engine's multiplexed Stream (one per load process and engine)."""
    from services.channels import open_channel
    from services.proto.tokenrelay.v1 import common_pb2, engine_pb2, engine_pb2_grpc
    from services.security import PLAINTEXT

    channel = open_channel(address, PLAINTEXT)
    stub = engine_pb2_grpc.EngineStub(channel)
    prompt = list(load.prompt.encode())
    outbox: asyncio.Queue[engine_pb2.EngineRequest | None] = asyncio.Queue()
    begin, end = stats["begin"], stats["end"]
    started: dict[str, float] = {}
    seq = 0

    def submit() -> None:
        nonlocal seq
        seq += 1
        rid = f"{os.getpid()}-{seq}"
        started[rid] = time.monotonic()
        outbox.put_nowait(engine_pb2.EngineRequest(request_id=rid, prompt_token_ids=prompt,
                                                   sampling=common_pb2.SamplingParams(max_tokens=load.max_tokens,
                                                                                      ignore_eos=True)))

    async def outbound() -> Any:
        async for batch in _batches(outbox):
            yield engine_pb2.EngineInbound(submit=batch)

    for _ in range(streams):
        submit()
    first_seen: set[str] = set()
    call = stub.Stream(outbound())
    async for msg in call:
        now = time.monotonic()
        for chunk in msg.chunks:
            rid = chunk.request_id
            if rid not in first_seen and chunk.token_ids:
                first_seen.add(rid)
                if begin <= started[rid] < end:
                    stats["ttft"].append(now - started[rid])
            if begin <= now < end:
                stats["tokens"] += len(chunk.token_ids)
                stats["by_address"][address] = stats["by_address"].get(address, 0) + len(chunk.token_ids)
                stats["chunks"] += 1
            if chunk.finished:
                if chunk.error_reason:
                    stats["errors"] += 1
                    stats["last_error"] = chunk.error_reason
                elif begin <= started[rid] < end:
                    stats["requests"] += 1
                first_seen.discard(rid)
                del started[rid]
                if now < end:
                    submit()
                elif not started:
                    outbox.put_nowait(None)
        if begin <= now < end:
            stats["messages"] += 1
    await channel.close()


def _client(load: Load, plan: list[tuple[str, int]], cpus: list[int], results: Any) -> None:
    """One load process: ``plan`` is its (address, streams) pairs, driven together in one event loop."""
    if cpus:
        os.sched_setaffinity(0, cpus)
    # Every process measures the same window, in its own monotonic clock.
    wait = load.t0 - time.time()
    if wait > 0:
        time.sleep(wait)
    now = time.monotonic()
    stats: dict[str, Any] = {"begin": now + load.warmup, "end": now + load.warmup + load.duration, "ttft": [],
                             "messages": 0, "tokens": 0, "chunks": 0, "requests": 0, "errors": 0, "last_error": "",
                             "by_address": {}}
    drive = _drive_engine if load.target == "engine" else _drive_mesh   # the bare server: the mesh's client
    if load.target == "mesh" and load.mesh_calls == "stream":
        drive = _drive_mesh_stream

    async def drive_all() -> None:
        await asyncio.gather(*(drive(load, address, n, stats) for address, n in plan))

    asyncio.run(drive_all())
    results.put(stats)


def load_plan(load: Load, clients: int) -> list[list[tuple[str, int]]]:
    """Per load process, its (address, streams) pairs: the streams spread evenly over the targets (the
    routers, or the engines alone; see ``spread``), so every router gets its share even with fewer
    load processes than routers; with one target, each process's whole share at it."""
    return [[(load.addresses[t], n) for t, n in pairs]
            for pairs in spread(load.streams, clients, len(load.addresses))]


def _probe(cpu: int | None, stop: Any, out: Any) -> None:
    """A fixed pure-Python workload on a CPU of its own for the measured window: how much Python work
    a CPU-second of this host does right now (a KVM guest's cores slow down with its neighbours)."""
    if cpu is not None:
        os.sched_setaffinity(0, {cpu})
    ops, t0 = 0, time.thread_time()
    while not stop.is_set():
        for _ in range(100):
            sum(range(1000))
        ops += 100
    out.put(ops / max(1e-9, time.thread_time() - t0))


def run_load(load: Load, clients: int, client_cpus: list[int], cpu_pids: list[int],
             engine_metrics: list[str] | None = None, probe_cpu: int | None = None,
             other_pids: dict[str, list[int]] | None = None) -> dict[str, Any]:
    """One measured load. ``other_pids``: processes by role (redis, tokenizers, engines) whose
    CPU-seconds over the same window go in the row's ``other_cpu_seconds``, to see which one limits."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    engine_metrics = list(engine_metrics or [])
    plans = load_plan(load, clients)
    workers = [ctx.Process(target=_client, args=(load, plan, [client_cpus[i % len(client_cpus)]] if client_cpus
                                                 else [], results), daemon=True) for i, plan in enumerate(plans)]
    for w in workers:
        w.start()
    processes = [psutil.Process(pid) for pid in cpu_pids]

    def cpu_of(ps: list[psutil.Process]) -> float:
        return sum(sum(p.cpu_times()[:2]) for p in ps)

    others = {role: [psutil.Process(pid) for pid in pids] for role, pids in (other_pids or {}).items()}

    def other_cpu() -> dict[str, float]:
        return {role: cpu_of(ps) for role, ps in others.items()}

    # Sample the router's CPU over the same window the clients measure.
    time.sleep(max(0.0, load.t0 + load.warmup - time.time()))
    c0, w0, es0, o0 = cpu_of(processes), time.monotonic(), engines_e2e(engine_metrics), other_cpu()
    probe, probe_out, probe_stop = None, ctx.Queue(), ctx.Event()
    if probe_cpu is not None:
        probe = ctx.Process(target=_probe, args=(probe_cpu, probe_stop, probe_out), daemon=True)
        probe.start()
    time.sleep(max(0.0, load.t0 + load.warmup + load.duration - time.time()))
    c1, w1, es1, o1 = cpu_of(processes), time.monotonic(), engines_e2e(engine_metrics), other_cpu()
    probe_rate = float("nan")
    if probe is not None:
        probe_stop.set()
        probe_rate = probe_out.get(timeout=30)
        probe.join(10)
    e0 = (sum(e[0] for e in es0), sum(e[1] for e in es0))
    e1 = (sum(e[0] for e in es1), sum(e[1] for e in es1))
    collected = [results.get(timeout=load.duration + 120) for _ in workers]
    for w in workers:
        w.join(30)
    window = load.duration
    tokens = sum(s["tokens"] for s in collected)
    messages = sum(s["messages"] for s in collected)
    ttft = [t for s in collected for t in s["ttft"]]
    cpu_s = c1 - c0
    by_address: dict[str, float] = {}
    for s in collected:
        for address, n in s["by_address"].items():
            by_address[address] = by_address.get(address, 0.0) + n / window
    return {"target": load.target, "streams": load.streams, "tokens_per_s": tokens / window,
            "tokens_per_s_by_address": by_address,
            "streams_by_address": {address: sum(n for plan in plans for a, n in plan if a == address)
                                   for address in load.addresses},
            "engine_finished_by_engine": [b[1] - a[1] for a, b in zip(es0, es1, strict=True)],
            "messages_per_s": messages / window, "tokens_per_message": tokens / messages if messages else 0.0,
            "requests": sum(s["requests"] for s in collected), "errors": sum(s["errors"] for s in collected),
            "last_error": next((s["last_error"] for s in collected if s["last_error"]), ""),
            "engine_e2e_mean_ms": (e1[0] - e0[0]) / (e1[1] - e0[1]) * 1000 if e1[1] > e0[1] else float("nan"),
            "ttft_p50_ms": _percentile(ttft, 50) * 1000, "ttft_p99_ms": _percentile(ttft, 99) * 1000,
            "cpu_seconds": cpu_s, "cpu_utilisation": cpu_s / (w1 - w0),
            "other_cpu_seconds": {role: o1[role] - o0[role] for role in o0},
            "tokens_per_cpu_s": tokens / cpu_s if cpu_s else 0.0,
            "messages_per_cpu_s": messages / cpu_s if cpu_s else 0.0,
            "probe_kops_per_cpu_s": probe_rate / 1000}


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    work = pathlib.Path(tempfile.mkdtemp(prefix="bench-relay-"))
    procs = Procs(work)
    rows: list[dict[str, Any]] = []
    try:
        mesh = start_mesh(args, procs)
        print(f"# routers {mesh.routers} engines {mesh.engines} tokenizers {mesh.tokenizers}; pinned: "
              f"{'yes' if args.router_cpus else 'no (pass --router-cpus etc. on a machine with spare cores)'}",
              file=sys.stderr)
        client_cpus = cpu_list(args.client_cpus)
        for streams in args.streams:
            for target in args.targets:
                addresses, pids = {"mesh": (mesh.routers, mesh.router_pids), "engine": (mesh.engines, mesh.engine_pids),
                                   "bare": ([mesh.bare], [mesh.bare_pid])}[target]
                load = Load(target, addresses, streams, args.max_tokens, args.prompt, args.warmup, args.duration,
                            time.time() + 1.5, args.min_delta_tokens if target == "mesh" else 0,
                            args.gap_ms / 1000, args.mesh_calls)
                other = {} if target != "mesh" else {"redis": [procs.procs["redis"].pid],
                                                      "tokenizers": mesh.tokenizer_pids, "engines": mesh.engine_pids}
                row = run_load(load, args.clients, client_cpus, pids, mesh.engine_metrics, other_pids=other,
                               probe_cpu=args.probe_cpu if args.probe_cpu >= 0 else None)
                row["cpu_of"] = {"mesh": "routers", "bare": "bare server"}.get(
                    target, "engine" if args.engines == 1 else "engines")
                row.update(routers=args.routers, engines=args.engines, tokenizers=args.tokenizers)
                rows.append(row)
                print(_line(row), file=sys.stderr, flush=True)
    finally:
        procs.stop()
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    for streams in args.streams:
        mesh_row = next((r for r in rows if r["streams"] == streams and r["target"] == "mesh"), None)
        engine_row = next((r for r in rows if r["streams"] == streams and r["target"] == "engine"), None)
        if mesh_row and engine_row and engine_row["tokens_per_s"]:
            mesh_row["ratio_to_engine"] = mesh_row["tokens_per_s"] / engine_row["tokens_per_s"]
        bare_row = next((r for r in rows if r["streams"] == streams and r["target"] == "bare"), None)
        if mesh_row and bare_row and bare_row["messages_per_cpu_s"]:
            mesh_row["ratio_to_bare"] = mesh_row["messages_per_cpu_s"] / bare_row["messages_per_cpu_s"]
    return rows


def _describe(exc: BaseException) -> str:
    """One line for the report: a gRPC error's status, reason and details (a repr spans lines)."""
    if isinstance(exc, grpc.aio.AioRpcError):
        reason = dict(exc.trailing_metadata() or ()).get(REASON_KEY, "")
        return f"{exc.code().name} {reason} {exc.details() or ''}".replace("\n", " ")[:300]
    return repr(exc).replace("\n", " ")[:300]


def _line(r: dict[str, Any]) -> str:
    probe = r.get("probe_kops_per_cpu_s", float("nan"))
    return (f"{r['target']:>6} {r['streams']:>5} streams ({r['engines']} eng, {r['tokenizers']} tok): "
            f"{r['tokens_per_s']:>9,.0f} tok/s "
            f"{r['messages_per_s']:>8,.0f} msg/s {r['tokens_per_message']:5.2f} tok/msg  {r['cpu_of']} "
            f"{r['cpu_seconds']:6.2f} CPU-s ({r['cpu_utilisation']:.2f} cores) "
            f"{r['tokens_per_cpu_s']:>9,.0f} tok/CPU-s "
            f"{r['messages_per_cpu_s']:>8,.0f} msg/CPU-s  TTFT p50 {r['ttft_p50_ms']:.1f} p99 {r['ttft_p99_ms']:.1f} ms"
            f"  engine e2e {r['engine_e2e_mean_ms']:.0f} ms  {r['requests']} req {r['errors']} err "
            f"{r['last_error'][:120]}" + (f" probe {probe:.0f} kops/CPU-s" if probe == probe else "")
            + "".join(f" {role} {v:.2f} CPU-s" for role, v in r.get("other_cpu_seconds", {}).items()))


def table(rows: list[dict[str, Any]]) -> str:
    out = [f"routers {rows[0]['routers']}, engines {rows[0]['engines']}, tokenizers {rows[0]['tokenizers']} "
           "(engine rows: the same load spread over the engines alone, tokens/s summed)\n"] if rows else []
    out += ["| streams | target | tok/s | msg/s | tok/msg | CPU-s (of) | tok per CPU-s | msg per CPU-s | "
           "TTFT p50 / p99 ms | mesh/engine | mesh/bare msg per CPU-s | errors |",
           "| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        ratio = f"{r['ratio_to_engine']:.2f}" if "ratio_to_engine" in r else ""
        bare = f"{r['ratio_to_bare']:.2f}" if "ratio_to_bare" in r else ""
        out.append(f"| {r['streams']} | {r['target']} | {r['tokens_per_s']:,.0f} | {r['messages_per_s']:,.0f} | "
                   f"{r['tokens_per_message']:.2f} | {r['cpu_seconds']:.2f} ({r['cpu_of']}) | "
                   f"{r['tokens_per_cpu_s']:,.0f} | {r['messages_per_cpu_s']:,.0f} | "
                   f"{r['ttft_p50_ms']:.1f} / {r['ttft_p99_ms']:.1f} | {ratio} | {bare} | {r['errors']} |")
    return "\n".join(out)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--streams", type=int, nargs="+", default=[64, 256, 1024], help="concurrent streams per run")
    p.add_argument("--targets", nargs="+", choices=["mesh", "engine", "bare"], default=["mesh", "engine"],
                   help="what each stream count is driven at (engine = the engine alone, the baseline; bare = a "
                   "bare grpc.aio Generate server on the router's CPU writing one-token deltas, the floor)")
    p.add_argument("--duration", type=float, default=10.0, help="measured seconds per run")
    p.add_argument("--warmup", type=float, default=2.0, help="seconds of load before measuring")
    p.add_argument("--max-tokens", type=int, default=256, help="output tokens per request (ignore_eos)")
    p.add_argument("--prompt", default="Relay benchmark prompt: " + "x" * 40, help="the prompt of every request")
    p.add_argument("--min-delta-tokens", type=int, default=0, help="the mesh's clients ask for deltas of at least "
                   "this many tokens (GenerateRequest.min_delta_tokens: a service-to-service caller); 0 = every "
                   "delta as soon as it is ready")
    p.add_argument("--mesh-calls", choices=["call", "stream"], default="call", help="the mesh's clients: one "
                   "Generate call per request, or every request of a load process on one open Stream call per "
                   "router (many requests' deltas per client message)")
    p.add_argument("--gap-ms", type=float, default=0.0, help="each stream waits this long after a request "
                   "(0 = back to back; mesh and bare targets): with --streams 1, requests at light load, "
                   "whose code runs cold")
    p.add_argument("--step-ms", type=float, default=1.0, help="the sim's decode step (ms)")
    p.add_argument("--per-seq-us", type=float, default=0.0, help="the sim's extra step time per running request (µs)")
    p.add_argument("--bare-step-ms", type=float, default=0.0, help="--targets bare: its ticker's period (ms); 0 = "
                   "every turn of its event loop, flat out (saturated, as a router busy with one-token deltas)")
    p.add_argument("--bare-event-loop", choices=LOOP_CHOICES, default="asyncio",
                   help="--targets bare: the bare server's event loop (the routers': --router-arg=--event-loop=...)")
    p.add_argument("--calibrated", action="store_true", help="the sim's defaults instead of fast steps: one H200 "
                   "running Llama 3.1 8B FP8 (batch 256, 2.5 ms + 8 µs/seq steps, 18 µs/prompt token)")
    p.add_argument("--routers", type=int, default=1, help="router processes (clients spread over them)")
    p.add_argument("--engines", type=int, default=1, help="sim engine processes, each the same config "
                   "(--calibrated: one simulated H200 each); every router is pointed at all of them")
    p.add_argument("--tokenizers", type=int, default=1, help="tokenizer processes; every router is pointed at "
                   "all of them")
    p.add_argument("--clients", type=int, default=10, help="load-generator processes")
    for role in ("router", "engine", "client", "redis", "tokenizer"):
        p.add_argument(f"--{role}-cpus", default="", help=f"CPUs of the {role} process(es), e.g. 0 or 4-15 "
                                                          "(default: not pinned)")
    p.add_argument("--engine-arg", action="append", default=[], help="extra engine_svc flag (repeatable)")
    p.add_argument("--router-arg", action="append", default=[], help="extra router_svc flag (repeatable)")
    p.add_argument("--probe-cpu", type=int, default=-1, help="a CPU left free for a probe: a fixed pure-Python "
                   "loop over the measured window, its work per CPU-second beside each row (how fast this "
                   "host's cores run right now); -1 = none")
    p.add_argument("--json-out", default="", help="write the rows as JSON here")
    p.add_argument("--keep", action="store_true", help="keep the work directory (logs)")
    args = p.parse_args(argv)
    for name in ("routers", "engines", "tokenizers", "clients"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be at least 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    rows = run(args)
    print(table(rows))
    if args.json_out:
        pathlib.Path(args.json_out).write_text(json.dumps({"args": vars(args), "rows": rows}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
