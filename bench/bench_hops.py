"""One hop of the first-token path at a time: round-trip latency of each call the router makes
before a request's first token, next to a bare grpc.aio unary echo and a Redis PING measured in
the same run (the floors).

Real processes, each pinned: an echo server (bare grpcio, its own port), tokenizer_svc (the
byte-level tokenizer of `up --engine sim`), redis-server; the caller (this process) on its own
core, one call at a time (latency, not throughput). Calls:

  echo            bare grpc.aio unary, 64 bytes each way (the floor of any unary call; its server and
                  channel are opened with grpc directly, the exception tests/test_channels.py allows)
  tok-text-raw    Tokenize of a 5-token text, raw stub
  tok-chat-raw    Tokenize of a ~600-token chat (8 messages), raw stub, no session cache
  tok-chat-coal   the same through the router's TokenizeCoalescer
  tok-chat-cached the same chat plus one new message per call, with a session cache key (the
                  incremental path chat-multiturn turns take)
  redis-ping      redis.asyncio PING over the unix socket (the floor of an admission call)
  echo-bidi       bare grpc.aio bidirectional stream, one 64-byte message each way on a stream kept
                  open (the floor of a hop on a multiplexed stream)
  engine-raw      engine_svc (`sim`, profile `instant`: no simulated GPU time) on one Stream kept open,
                  raw stub: a submit of 8 prompt ids and max_tokens 1, until its token comes back (the
                  engine's own turnaround over echo-bidi: read, submit, one step, outbox, write)
  engine-mux      the same through the router's replica client (`router_svc.upstreams.EngineReplica`:
                  the MuxClient, its inbox and wake-ups): what the router adds to that hop

    python bench/bench_hops.py --calls 400 [--server-cpus 0-2 --client-cpu 3] [--json out.json]
    python bench/bench_hops.py --tokenizer-arg=--inline-bytes=0     # small calls through the threads too
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import pathlib
import random
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any

import grpc

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from bench_relay import Procs, cpu_list

from services.redis_client import unix_socket_listening

ECHO = "/bench.Echo/Call"


def _echo_server(port_file: str) -> None:
    async def serve() -> None:
        async def call(request: bytes, context: Any) -> bytes:
            return request

        async def stream(requests: Any, context: Any) -> Any:
            async for request in requests:
                yield request

        server = grpc.aio.server()
        handler = grpc.method_handlers_generic_handler(
            "bench.Echo", {"Call": grpc.unary_unary_rpc_method_handler(call),
                           "Stream": grpc.stream_stream_rpc_method_handler(stream)})
        server.add_generic_rpc_handlers((handler,))
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        tmp = port_file + ".tmp"
        pathlib.Path(tmp).write_text(str(port))
        os.replace(tmp, port_file)
        await server.wait_for_termination()

    asyncio.run(serve())


def _stats(ms: list[float]) -> dict[str, float]:
    s = sorted(ms)

    def q(p: float) -> float:
        return s[min(len(s) - 1, int(p * (len(s) - 1) + 0.5))]

    return {"p50": q(0.5), "p90": q(0.9), "p99": q(0.99), "mean": statistics.fmean(s)}


async def _measure(calls: int, fn: Any) -> list[float]:
    for _ in range(max(20, calls // 10)):   # warm-up
        await fn(0)
    out = []
    for i in range(calls):
        t = time.perf_counter()
        await fn(i)
        out.append((time.perf_counter() - t) * 1000)
    return out


class _Stream:
    """One bidirectional call kept open, written through a queue: `ask(message)` then `read()`."""

    def __init__(self, open_call: Any) -> None:
        self._queue: asyncio.Queue[Any] = asyncio.Queue()
        self.call = open_call(self._outbound())

    async def _outbound(self) -> Any:
        while True:
            yield await self._queue.get()

    def ask(self, message: Any) -> None:
        self._queue.put_nowait(message)


async def _engine_hops(echo_ch: Any, engine: str) -> tuple[list[tuple[str, Any]], Any]:
    """echo-bidi, engine-raw and engine-mux (module doc), and the channels to close."""
    from router_svc.types import Sampling
    from router_svc.upstreams import EngineReplica
    from services.channels import open_channel
    from services.proto.tokenrelay.v1 import common_pb2, engine_pb2, engine_pb2_grpc

    bidi = _Stream(echo_ch.stream_stream(ECHO.replace("Call", "Stream")))
    payload = b"x" * 64

    async def echo_bidi(i: int) -> None:
        bidi.ask(payload)
        await bidi.call.read()

    raw_ch, mux_ch = open_channel(engine), open_channel(engine)
    raw = _Stream(engine_pb2_grpc.EngineStub(raw_ch).Stream)
    prompt = list(range(1, 9))
    seq = iter(range(1 << 60))

    async def engine_raw(i: int) -> None:
        rid = f"raw-{next(seq)}"
        raw.ask(engine_pb2.EngineInbound(submit=[engine_pb2.EngineRequest(
            request_id=rid, prompt_token_ids=prompt, sampling=common_pb2.SamplingParams(max_tokens=1))]))
        while not any(c.request_id == rid and c.token_ids for c in (await raw.call.read()).chunks):
            pass

    replica = EngineReplica(engine, mux_ch, engine_pb2_grpc.EngineStub(mux_ch))

    async def engine_mux(i: int) -> None:
        rid = f"mux-{next(seq)}"
        inbox = replica.submit(rid, prompt, Sampling(max_tokens=1), [], "", {})
        while not any(getattr(item, "token_ids", None) for item in await inbox.get_ready()):
            pass
        replica.release(rid)

    async def close() -> None:
        bidi.call.cancel()
        raw.call.cancel()
        await replica.close()
        await raw_ch.close()
    hops = [("echo-bidi", echo_bidi), ("engine-raw", engine_raw), ("engine-mux", engine_mux)]
    return hops, close


async def run(args: argparse.Namespace, echo: str, tokenizer: str, sock: str,
              engine: str) -> dict[str, dict[str, float]]:
    import redis.asyncio as aioredis

    from router_svc.tokenize_batch import TokenizeCoalescer
    from services.channels import open_channel
    from services.proto.tokenrelay.v1 import common_pb2, tokenizer_pb2, tokenizer_pb2_grpc

    rng = random.Random(0)
    words = "the quick brown fox jumps over a lazy dog while seven wizards quietly hum".split()

    def text(n: int) -> str:
        return " ".join(rng.choice(words) for _ in range(n))

    history = [("system", text(14))] + [(("user", "assistant")[i % 2], text(12)) for i in range(7)]

    def chat(i: int, key: str = "", extra: int = 0) -> Any:
        msgs = history + [("user", f"turn {i} {text(5)}")] + [("user", f"more {j}") for j in range(extra)]
        return tokenizer_pb2.TokenizeInput(chat=tokenizer_pb2.ChatMessages(
            messages=[common_pb2.ChatMessage(role=r, content=c) for r, c in msgs],
            add_generation_prompt=True, cache_key=key))

    echo_ch = grpc.aio.insecure_channel(echo)
    echo_call = echo_ch.unary_unary(ECHO)
    tok_ch = open_channel(tokenizer)
    stub = tokenizer_pb2_grpc.TokenizerStub(tok_ch)
    coal = TokenizeCoalescer(stub, 10.0)
    rds = aioredis.Redis(unix_socket_path=sock)
    payload = b"x" * 64
    tiny = tokenizer_pb2.TokenizeRequest(inputs=[tokenizer_pb2.TokenizeInput(text="hello there, world")],
                                         packed_ids=True)
    n_ids = len((await stub.Tokenize(tokenizer_pb2.TokenizeRequest(inputs=[chat(0)], packed_ids=True)))
                .results[0].packed_ids) // 4
    session = {"turn": 0}

    async def cached(i: int) -> None:
        # Each call extends the previous one of its session by one message (chat_cache.py's path).
        session["turn"] += 1
        await stub.Tokenize(tokenizer_pb2.TokenizeRequest(
            inputs=[chat(0, key=f"s{session['turn'] // 8}", extra=session["turn"] % 8)], packed_ids=True))

    hops: list[tuple[str, Any]] = [
        ("echo", lambda i: echo_call(payload)),
        ("tok-text-raw", lambda i: stub.Tokenize(tiny)),
        ("tok-chat-raw", lambda i: stub.Tokenize(tokenizer_pb2.TokenizeRequest(inputs=[chat(i)], packed_ids=True))),
        ("tok-chat-coal", lambda i: coal.tokenize(chat(i), 10.0)),
        ("tok-chat-cached", cached),
        ("redis-ping", lambda i: rds.ping()),
    ]
    engine_hops, close_engine = await _engine_hops(echo_ch, engine)
    hops += engine_hops
    results: dict[str, dict[str, float]] = {}
    for rep in range(args.repeats):
        for name, fn in hops:
            r = _stats(await _measure(args.calls, fn))
            key = name if args.repeats == 1 else f"{name}#{rep + 1}"
            results[key] = r
    results["_meta"] = {"chat_prompt_ids": float(n_ids)}
    await close_engine()
    await coal.close()
    await tok_ch.close()
    await echo_ch.close()
    await rds.aclose()
    return results


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--calls", type=int, default=400, help="calls per hop (after a warm-up)")
    p.add_argument("--repeats", type=int, default=1, help="measure every hop this many times, interleaved")
    p.add_argument("--server-cpus", default="", help="cores for echo, tokenizer, redis, engine (one each, in turn)")
    p.add_argument("--client-cpu", default="", help="core of this process")
    p.add_argument("--tokenizer-arg", action="append", default=[], help="extra tokenizer_svc flag (repeatable)")
    p.add_argument("--json", default="")
    args = p.parse_args(argv)
    from tokenrelay_tools.cli.byte_tokenizer import ensure_byte_tokenizer

    srv = cpu_list(args.server_cpus) if args.server_cpus else []

    def core(i: int) -> list[int]:
        return [srv[i % len(srv)]] if srv else []

    work = pathlib.Path(tempfile.mkdtemp(prefix="hops-"))
    procs = Procs(work)
    try:
        tok = ensure_byte_tokenizer(work / "cache")
        echo_port = work / "echo.port"
        here = str(pathlib.Path(__file__).parent)
        procs.spawn("echo", [sys.executable, "-c", f"import sys; sys.path.insert(0, {here!r});"
                             f" import bench_hops; bench_hops._echo_server({str(echo_port)!r})"], core(0))
        tok_port = procs.service("tokenizer", "tokenizer_svc", ["--tokenizer", str(tok), *args.tokenizer_arg],
                                 core(1))
        sock = work / "redis.sock"
        procs.spawn("redis", [shutil.which("redis-server") or "redis-server", "--port", "0", "--unixsocket", str(sock),
                              "--save", "", "--appendonly", "no", "--dir", str(work)], core(2))
        eng_port = procs.service("engine", "engine_svc", ["--backend", "sim", "--sim-profile", "instant"], core(3))
        echo = procs.wait_port("echo", echo_port)
        tokenizer = procs.wait_port("tokenizer", tok_port)
        engine = procs.wait_port("engine", eng_port)
        while not unix_socket_listening(sock):
            time.sleep(0.02)
        if args.client_cpu:
            os.sched_setaffinity(0, cpu_list(args.client_cpu))
        results = asyncio.run(run(args, echo, tokenizer, str(sock), engine))
    finally:
        procs.stop()
        shutil.rmtree(work, ignore_errors=True)
    meta = results.pop("_meta")
    print(f"one call at a time, ms; the chat is {int(meta['chat_prompt_ids'])} ids")
    print(f"{'hop':<20} {'p50':>7} {'p90':>7} {'p99':>7} {'mean':>7}  x echo p50")
    floor = next(v["p50"] for k, v in results.items() if k.startswith("echo"))
    for name, r in results.items():
        print(f"{name:<20} {r['p50']:7.3f} {r['p90']:7.3f} {r['p99']:7.3f} {r['mean']:7.3f}  {r['p50'] / floor:6.1f}")
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps({"hops": results, **meta}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
