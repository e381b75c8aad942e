"""The GPU mesh run's engine host and load generator: one closed loop, three ways to reach one engine.

    # the engine (engine_svc's own flags after --): serves gRPC, runs an in-process phase on request
    python bench/gpu/mesh_bench.py host --port-file /tmp/e.port --control-dir /tmp/ctl \
        -- --backend hf --model /tmp/llama8b --hf-random-weights --hf-device cuda ...
    echo 75 > /tmp/ctl/inproc_16.go      # -> /tmp/ctl/inproc_16.json (75 = the phase's seconds limit)
    # the same closed loop over gRPC: the engine's multiplexed Stream, or the routers' Generate
    python bench/gpu/mesh_bench.py load --target engine --address 127.0.0.1:PORT --streams 16 --json F
    python bench/gpu/mesh_bench.py load --target mesh --address R1,R2,R3 --api-key KEY --streams 16 --json F

``host`` builds the engine exactly as `python -m engine_svc` does (`engine_svc.app.start_engine`:
backend → `Engine` → gRPC server, the same settings parser), loads the model once, publishes its
port and serves gRPC until SIGTERM. When asked (a file ``inproc_N.go`` in ``--control-dir``) it
drives that same `Engine` object from its own event loop — `Engine.submit(request, sink)`, no gRPC,
no protobuf: "the same engine called in process" — and answers with ``inproc_N.json``. So the
in-process, engine-alone and mesh phases all reach the very same engine (same weights, KV cache
and CUDA state), and the three phases of one concurrency run back to back.

Every phase is the same closed loop: ``--streams`` workers, each sending its next request as soon
as the previous one ended, until ``--requests`` were issued (default 2 per stream). Each request
is ``--prompt`` random token ids (drawn below the vocabulary, from ``--seed`` and the request's
index, generated before the clock starts) and ``--output`` tokens with ignore_eos; the mesh gets
its ids as `token_ids` input, so every target sees prompts of exactly the same length (the router
tokenizes nothing; it detokenizes every output token through the tokenizer service). Each phase
uses its own seed, so no phase's prompts share a prefix with an earlier one (the hf backend keeps
finished prompts' KV blocks for reuse), and each request's cached prompt tokens are recorded to
show it. Untimed warm-up requests (4 tokens; one per router for the mesh) open the connections
first. Measured: output tokens / wall seconds (first submit to last finish), TTFT per request
(submit → first token reaching the caller) p50 / p99 (nearest rank), TPOT, errors.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import pathlib
import random
import signal
import statistics
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent.parent))

RESERVED = 3   # ids below this are left out of prompts (BOS/EOS/PAD of many vocabularies)


@dataclass
class Record:
    index: int
    start: float = 0.0
    first: float | None = None
    end: float = 0.0
    tokens: int = 0
    cached: int = 0
    error: str = ""
    server_ttft: float | None = None   # mesh: the router's own view (request received -> first token sent)
    queue: float | None = None         # mesh: seconds in the admission queue


@dataclass
class Phase:
    target: str
    streams: int
    requests: int
    prompt: int
    output: int
    seed: int
    vocab: int
    warmups: int = 1            # untimed requests first (the mesh: one per router, round robin)
    records: list[Record] = field(default_factory=list)


# One request: (prompt ids, max tokens, record to fill) -> awaitable that ends with the request.
Send = Callable[[str, list[int], int, Record], Awaitable[None]]


def prompts(phase: Phase) -> list[list[int]]:
    out = []
    for i in range(phase.requests):
        rng = random.Random(f"{phase.seed}:{i}")
        out.append([rng.randrange(RESERVED, phase.vocab) for _ in range(phase.prompt)])
    return out


def pct(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100); nan when empty."""
    if not values:
        return math.nan
    s = sorted(values)
    return s[max(0, min(len(s) - 1, math.ceil(q / 100 * len(s)) - 1))]


async def closed_loop(phase: Phase, send: Send, timeout: float, limit: float = 1e9) -> dict[str, Any]:
    ids = prompts(phase)
    warm = Record(-1)
    rng = random.Random(f"warm:{phase.seed}")   # their own prompts: no measured request may hit their cache

    async def warm_up(k: int) -> None:
        ids = [rng.randrange(RESERVED, phase.vocab) for _ in range(phase.prompt)]
        try:
            await asyncio.wait_for(send(f"warm-{phase.seed}-{k}", ids, 4, warm), timeout)
        except Exception as exc:  # noqa: BLE001 - reported, the phase still runs
            warm.error = f"warm-up failed: {type(exc).__name__}: {exc}"[:300]

    await asyncio.gather(*(warm_up(k) for k in range(phase.warmups)))
    next_index = 0
    records: list[Record] = []

    async def worker() -> None:
        nonlocal next_index
        while next_index < phase.requests:
            i = next_index
            next_index += 1
            rec = Record(i)
            records.append(rec)
            rec.start = time.perf_counter()
            try:
                await asyncio.wait_for(send(f"p{phase.seed}-{i}", ids[i], phase.output, rec), timeout)
            except (TimeoutError, asyncio.TimeoutError):
                rec.error = rec.error or "TIMEOUT"
            except Exception as exc:  # noqa: BLE001 - counted per request, the loop goes on
                rec.error = rec.error or f"{type(exc).__name__}: {exc}"[:300]
            rec.end = time.perf_counter()

    t0 = time.perf_counter()
    truncated = False
    try:   # past the phase's limit the workers are cancelled: their requests are aborted, the row marked
        await asyncio.wait_for(asyncio.gather(*(worker() for _ in range(min(phase.streams, phase.requests)))),
                               limit)
    except (TimeoutError, asyncio.TimeoutError):
        truncated = True
        now = time.perf_counter()
        for r in records:
            if not r.end:
                r.error, r.end = "PHASE_LIMIT", now
    wall = time.perf_counter() - t0
    phase.records = records
    ok = [r for r in records if not r.error]
    ttft = [r.first - r.start for r in ok if r.first is not None]
    tpot = [(r.end - r.first) / (r.tokens - 1) for r in ok if r.first is not None and r.tokens > 1]
    tokens = sum(r.tokens for r in records)
    errors: dict[str, int] = {}
    for r in records:
        if r.error:
            errors[r.error[:120]] = errors.get(r.error[:120], 0) + 1
    row: dict[str, Any] = {"target": phase.target, "streams": phase.streams, "requests": phase.requests, "ok": len(ok),
            "errors": sum(errors.values()), "error_kinds": errors, "warmup_error": warm.error,
            "prompt_tokens": phase.prompt, "output_tokens_per_request": phase.output, "seed": phase.seed,
            "output_tokens": tokens, "wall_s": wall, "output_tok_s": tokens / wall if wall > 0 else 0.0,
            "ttft_p50_s": pct(ttft, 50), "ttft_p99_s": pct(ttft, 99),
            "ttft_mean_s": statistics.fmean(ttft) if ttft else math.nan, "ttft_max_s": max(ttft) if ttft else math.nan,
            "tpot_p50_s": pct(tpot, 50), "tpot_p99_s": pct(tpot, 99),
            "cached_prompt_tokens": sum(r.cached for r in records), "truncated": truncated,
            "issued": len(records)}
    server = [r.server_ttft for r in ok if r.server_ttft is not None]
    if server:
        row.update(server_ttft_p50_s=pct(server, 50), server_ttft_p99_s=pct(server, 99),
                   queue_p99_s=pct([r.queue or 0.0 for r in ok], 99))
    return row


# ------------------------------------------------------------------------------ in process
def inproc_sender(engine: Any, stagger: Callable[[], float] = lambda: 0.0) -> Send:
    """`stagger()`: seconds; when above 0, request i waits (i mod 3) x that before its submit (its
    TTFT clock starts after the wait), so that a closed loop's wave reaches the engine in three
    parts, as a wave through three routers does."""
    from engine_svc.backends.base import FinishReason, GenerationEvent, GenerationRequest

    async def send(rid: str, ids: list[int], max_tokens: int, rec: Record) -> None:
        if stagger() > 0 and rec.index % 3:
            await asyncio.sleep(stagger() * (rec.index % 3))
            rec.start = time.perf_counter()
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        ended = False

        def sink(event: GenerationEvent) -> None:
            nonlocal ended
            if event.token_ids:
                if rec.first is None:
                    rec.first = time.perf_counter()
                    rec.cached = event.cached_tokens
                rec.tokens += len(event.token_ids)
            if event.finished:
                ended = True
                if event.finish_reason is FinishReason.ERROR or event.finish_reason is FinishReason.CANCELLED:
                    rec.error = event.error_reason or event.finish_reason.value
                if not done.done():
                    done.set_result(None)

        engine.submit(GenerationRequest(request_id=rid, prompt_token_ids=ids, max_tokens=max_tokens,
                                        ignore_eos=True), sink)
        try:
            await done
        finally:
            # Timed out or cancelled (the phase's limit): abort it, or it runs on in the engine and
            # holds a batch slot through the next phase. Not `done.done()`: cancelling this task
            # cancels `done` too, so that test was always true and nothing was aborted (the 256-stream
            # in-process phases on the H200 left 256 requests running into the mesh phase).
            if not ended:
                engine.abort([rid])

    return send


async def host(args: argparse.Namespace, engine_argv: list[str]) -> int:
    from engine_svc.app import start_engine
    from engine_svc.config import EngineSettings
    from services.config import load_settings
    from services.grpc_util import write_port_file
    from services.logging import configure_logging

    settings = load_settings(EngineSettings, engine_argv, prog="mesh_bench host")
    configure_logging(settings.telemetry.log_level, settings.telemetry.log_format, service="engine")
    t0 = time.perf_counter()
    engine, server = await start_engine(settings)
    load_s = time.perf_counter() - t0
    load = engine.load()
    vocab = int(getattr(engine.backend, "vocab_size", 0) or args.vocab)
    print(f"# engine ready in {load_s:.1f} s: {load.backend} {load.model}, vocab {vocab}, "
          f"max_active {load.max_active}, max_context {load.max_context}; gRPC on {server.address}", flush=True)
    control = pathlib.Path(args.control_dir)
    control.mkdir(parents=True, exist_ok=True)
    (control / "engine.json").write_text(json.dumps({"vocab": vocab, "load_s": load_s, "port": server.port,
                                                      "max_context": load.max_context}) + "\n")
    write_port_file(args.port_file, server.port)
    stagger = 0.0
    send = inproc_sender(engine, lambda: stagger)
    runs: dict[int, int] = {}
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    # The shell asks for an in-process phase by writing inproc_N.go (its content: the phase's seconds
    # limit, optionally then a stagger in ms: see inproc_sender); the result is inproc_N.json.
    # Polled every 50 ms: nothing else runs here meanwhile.
    while not stop.is_set():
        for go in sorted(control.glob("inproc_*.go")):
            streams = int(go.stem.split("_")[1])
            words = go.read_text().split()
            limit = float(words[0]) if words else 1e9
            stagger = float(words[1]) / 1000 if len(words) > 1 else 0.0
            go.unlink()
            k = runs[streams] = runs.get(streams, -1) + 1   # a repeated phase gets new prompts (no cache hits)
            phase = Phase("inproc", streams, requests_for(args, streams), args.prompt, args.output,
                          seed=args.seed + streams + 100_000 * k, vocab=vocab)
            live_before = await idle(engine, 60.0)   # what an earlier gRPC phase left (its aborts in transit)
            row = await closed_loop(phase, send, args.timeout, limit)
            row.update(engine_load_s=load_s, engine_live_before=live_before, engine_live_after=engine.live,
                       stagger_ms=stagger * 1000)
            tmp = control / f"inproc_{streams}.json.tmp"
            tmp.write_text(json.dumps(row, indent=1) + "\n")
            tmp.replace(control / f"inproc_{streams}.json")
            print(line(row), flush=True)
        with contextlib.suppress(TimeoutError, asyncio.TimeoutError):
            await asyncio.wait_for(stop.wait(), 0.05)
    engine.drain()
    await server.stop(5)
    await engine.close()
    return 0


async def idle(engine: Any, limit: float) -> int:
    """Wait (at most `limit` seconds) until no request is live in the engine; returns how many were
    live on entry. A phase must start on an idle engine: leftovers hold batch slots and KV blocks."""
    live = engine.live
    deadline = time.monotonic() + limit
    while engine.live and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    return live


def requests_for(args: argparse.Namespace, streams: int) -> int:
    return args.requests or max(args.per_stream * streams, args.min_requests)


# ------------------------------------------------------------------------------ over gRPC
def engine_sender(address: str) -> tuple[Send, Callable[[], Awaitable[None]]]:
    from services.channels import open_channel
    from services.mux import MuxClient, StreamBroken
    from services.proto.tokenrelay.v1 import common_pb2, engine_pb2, engine_pb2_grpc

    channel = open_channel(address)
    stub = engine_pb2_grpc.EngineStub(channel)
    mux: MuxClient[Any] = MuxClient(
        "engine", stub.Stream,
        lambda p: engine_pb2.EngineInbound(submit=p.get("submit", []), abort=p.get("abort", [])),
        lambda resp: [(c.request_id, c) for c in resp.chunks])

    async def send(rid: str, ids: list[int], max_tokens: int, rec: Record) -> None:
        inbox = mux.open(rid)
        mux.post("submit", engine_pb2.EngineRequest(
            request_id=rid, prompt_token_ids=ids,
            sampling=common_pb2.SamplingParams(max_tokens=max_tokens, ignore_eos=True)))
        finished = False
        try:
            while not finished:
                for chunk in await inbox.get_ready():
                    if isinstance(chunk, StreamBroken):
                        finished = True
                        raise chunk.error
                    if chunk.token_ids:
                        if rec.first is None:
                            rec.first = time.perf_counter()
                            rec.cached = chunk.cached_tokens
                        rec.tokens += len(chunk.token_ids)
                    if chunk.error_reason:
                        finished = True
                        rec.error = f"{chunk.error_reason}: {chunk.error_message}"[:300]
                    if chunk.finished:
                        finished = True
        finally:
            if not finished:
                mux.post("abort", rid)
            mux.release(rid)

    async def close() -> None:
        await mux.close()
        await channel.close()

    return send, close


def mesh_sender(addresses: list[str], api_key: str) -> tuple[Send, Callable[[], Awaitable[None]]]:
    """Generate with token_ids at the routers, request i at router i mod len(addresses)."""
    from services.client import Client, Finished, TextDelta

    clients = [Client(a, api_key) for a in addresses]
    count = 0

    async def send(rid: str, ids: list[int], max_tokens: int, rec: Record) -> None:
        nonlocal count
        client = clients[count % len(clients)]
        count += 1
        async for event in client.stream(token_ids=ids, max_tokens=max_tokens, ignore_eos=True,
                                         return_token_ids=True):
            if isinstance(event, TextDelta):
                n = len(event.token_ids)
                if n and rec.first is None:
                    rec.first = time.perf_counter()
                rec.tokens += n
            elif isinstance(event, Finished):
                rec.cached = event.cached_tokens
                rec.server_ttft, rec.queue = event.ttft_seconds, event.queue_seconds
                if event.finish_reason not in ("length", "stop"):
                    rec.error = f"finish {event.finish_reason}"

    async def close() -> None:
        for c in clients:
            await c.close()

    return send, close


async def load(args: argparse.Namespace) -> int:
    addresses = [a for a in args.address.split(",") if a]
    if args.target == "engine":
        send, close = engine_sender(addresses[0])
    else:
        send, close = mesh_sender(addresses, args.api_key)
    phase = Phase(args.target, args.streams, requests_for(args, args.streams), args.prompt,
                  args.output, seed=args.seed, vocab=args.vocab, warmups=len(addresses))
    try:
        row = await closed_loop(phase, send, args.timeout, args.limit)
    finally:
        await close()
    row["addresses"] = addresses
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(row, indent=1) + "\n")
    print(line(row), flush=True)
    return 0 if row["ok"] else 1


def line(r: dict[str, Any]) -> str:
    return (f"{r['target']:>6} {r['streams']:>4} streams: {r['output_tok_s']:9.1f} tok/s  "
            f"TTFT p50 {r['ttft_p50_s'] * 1000:8.1f} p99 {r['ttft_p99_s'] * 1000:8.1f} ms  "
            f"TPOT p50 {r['tpot_p50_s'] * 1000:7.1f} ms  {r['ok']}/{r['requests']} ok, wall {r['wall_s']:.1f} s, "
            f"cached {r['cached_prompt_tokens']} {r['error_kinds'] or ''} {r['warmup_error']}")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    engine_argv: list[str] = []
    if "--" in argv:
        at = argv.index("--")
        argv, engine_argv = argv[:at], argv[at + 1:]
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    h = sub.add_parser("host", help="load the engine, serve gRPC, run in-process phases on request, until SIGTERM")
    h.add_argument("--port-file", required=True, help="the gRPC port, written once the engine is ready")
    h.add_argument("--control-dir", required=True, help="inproc_N.go asks for a phase; inproc_N.json answers")
    h.add_argument("--vocab", type=int, default=0, help="prompt ids below this (default: the model's)")
    ld = sub.add_parser("load", help="the closed loop over gRPC: the engine's Stream or the routers' Generate")
    ld.add_argument("--target", choices=["engine", "mesh"], required=True)
    ld.add_argument("--address", required=True, help="host:port (mesh: comma-separated routers)")
    ld.add_argument("--api-key", default=os.environ.get("TOKENRELAY_API_KEY", ""))
    ld.add_argument("--streams", type=int, required=True)
    ld.add_argument("--vocab", type=int, required=True)
    ld.add_argument("--json", default="")
    ld.add_argument("--limit", type=float, default=1e9, help="seconds for the whole phase (then it is cut short)")
    for q in (h, ld):
        q.add_argument("--requests", type=int, default=0, help="requests per phase (0 = --per-stream x streams)")
        q.add_argument("--per-stream", type=int, default=2)
        q.add_argument("--min-requests", type=int, default=4, help="at least this many requests a phase")
        q.add_argument("--prompt", type=int, default=512)
        q.add_argument("--output", type=int, default=128)
        q.add_argument("--seed", type=int, default=1000, help="prompt seed (host: + the concurrency per phase)")
        q.add_argument("--timeout", type=float, default=120.0, help="per-request limit, seconds")
    args = p.parse_args(argv)
    if args.command == "host":
        return asyncio.run(host(args, engine_argv))
    return asyncio.run(load(args))


if __name__ == "__main__":
    sys.exit(main())
