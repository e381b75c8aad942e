"""Routing side by side (issue 12's "Shows"): tokenrelay's placement policies and SGLang's router in
front of the same simulated replicas, on multi-turn traces, as real processes.

Replicas: `--replicas` (8) `sim` engines, 32-token KV blocks, batch `--batch` (2: a replica that gets
more than its share queues), prefill `--prefill-us` µs per uncached prompt token (200), decode step
`--decode-ms` (4 ms): TTFT is mostly the prefill the cache did not save, and 2 cores can run it.
Engines are shared by the runs of one engine configuration (started once, not per run); every run
prefixes its prompts with 3 tokens of its own, so no run hits another's blocks.

Traces (routing_trace.py; seeded, closed loop: `--concurrency` (8) conversations at a time, a new
one when one ends, no session ids): chat-multiturn (independent conversations), shared-hot (3
shared system prompts + one hot conversation that half the conversations continue), evict
(chat-multiturn's shape, longer, `--evict-concurrency` (16) at a time, on replicas of `--evict-blocks`
(96) blocks). Each turn resends the
whole conversation with the engine's own reply tokens; prompts go as token ids (`token_ids` to
tokenrelay, `input_ids` to SGLang: sglang-router 0.3.2's cache_aware policy routes on them, joined
as decimal text, so its radix tree sees exactly the ids the engine caches).

Configurations (one router setup each, a fresh router process per run):
  round-robin, random, least-loaded, session, prefix   tokenrelay's router, --routing-policy X (the
                                           `session` run sends each conversation's id as session_id;
                                           no other run sends one)
  prefix-2routers                          two tokenrelay router processes (one Redis), the turns of
                                           a conversation alternating between them
  sglang-cache_aware, sglang-round_robin, sglang-random, sglang-power_of_two
                                           sglang-router 0.3.2 (its own venv: --sglang-venv) in front of
                                           routing_adapter.py, one listener per engine
By default every configuration runs on chat-multiturn; shared-hot and evict get round-robin,
least-loaded, session, prefix (+ 2 routers on shared-hot) and sglang-cache_aware.

Metrics per (trace, config): pool hit rate Σcached/Σprompt from the engines' GetLoad counters
(deltas over the run); the oracle (routing_oracle.py: one infinite cache over the prompts sent, 32-
token blocks) and the ratio to it; TTFT p50/p99 (client side: send to first token); output tokens/s;
imbalance = max/mean over replicas of the in-flight (active + queued, GetLoad every 50 ms) averaged
over the run, and of requests served; goodput = share of requests with TTFT <= `--slo-ttft`
(0.25 s); the highest KV blocks used/total seen on any replica; follow-up turns on the previous
turn's replica (tokenrelay: from the router's --trace-file route spans; SGLang: the adapter says).

`--decision-time`: routing decision time instead: open loop at `--rate` (1000) requests/s of
max_tokens 1 for `--seconds` (5) through one router (`--routing-policy prefix`) on instant sims,
the route span's duration p50/p99 from the router's trace file, and the router's
tokenrelay_router_route_seconds histogram when it has one.

    python bench/bench_routing.py --json routing.json              # the default run (~5 min here)
    python bench/bench_routing.py --quick                          # 16 conversations, fewer configs
    python bench/bench_routing.py --traces chat-multiturn --configs prefix,sglang-cache_aware
    python bench/bench_routing.py --decision-time --rate 1000 --seconds 5
    python bench/bench_routing.py --report routing.json            # table + checks of a saved run

Setup: redis-server on PATH; sglang-router 0.3.2 in a venv of its own (its fastapi/uvicorn/aiohttp
stay out of the project's environment):
    python -m venv ~/.cache/tokenrelay/sglang-router-0.3.2
    ~/.cache/tokenrelay/sglang-router-0.3.2/bin/pip install sglang-router==0.3.2
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import pathlib
import random
import sys
import tempfile
import time
import urllib.request
import uuid
from typing import Any

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

import grpc
import routing_trace
from routing_mesh import API_KEY, REPO, SGLANG_VENV, Procs
from routing_report import Req, Sample, checks, percentile, render_checks, summarize, table

from services.channels import open_channel
from services.proto.tokenrelay.v1 import (
    common_pb2,
    engine_pb2,
    engine_pb2_grpc,
    inference_pb2,
    inference_pb2_grpc,
)

TOKENRELAY = ("round-robin", "random", "least-loaded", "session", "prefix", "prefix-2routers")
SGLANG = ("sglang-cache_aware", "sglang-round_robin", "sglang-random", "sglang-power_of_two")
HARD = ("round-robin", "least-loaded", "session", "prefix", "sglang-cache_aware")
TPB = 32


# ------------------------------------------------------------------------------------------ clients
class TokenrelayClient:
    def __init__(self, addresses: list[str], session: bool) -> None:
        self.channels = [open_channel(a) for a in addresses]
        self.stubs = [inference_pb2_grpc.InferenceStub(c) for c in self.channels]
        self.session = session
        self.metadata = (("authorization", f"Bearer {API_KEY}"),)

    async def send(self, req: Req, rid: str, which: int) -> None:
        msg = inference_pb2.GenerateRequest(
            token_ids=inference_pb2.TokenIds(ids=req.prompt), return_token_ids=True, request_id=rid,
            sampling=common_pb2.SamplingParams(max_tokens=req.max_tokens, ignore_eos=True),
            session_id=f"conv-{req.cid}" if self.session else "")
        t0 = time.monotonic()
        req.sent = t0
        try:
            async for ev in self.stubs[which % len(self.stubs)].Generate(msg, metadata=self.metadata, timeout=120):
                kind = ev.WhichOneof("event")
                if kind == "delta" and ev.delta.token_ids:
                    if math.isnan(req.ttft):
                        req.ttft = time.monotonic() - t0
                    req.reply.extend(ev.delta.token_ids)
                elif kind == "done":
                    req.cached = ev.done.usage.cached_tokens
                    req.server_ttft = ev.done.timings.ttft_seconds
        except grpc.aio.AioRpcError as exc:
            req.error = f"{exc.code().name}: {exc.details()}"[:200]
        req.e2e = time.monotonic() - t0

    async def close(self) -> None:
        for c in self.channels:
            await c.close()


class HttpConn:
    """One keep-alive HTTP/1.1 connection to sglang-router (stdlib asyncio streams)."""

    def __init__(self, url: str) -> None:
        host, port = url.removeprefix("http://").split(":")
        self.host, self.port = host, int(port)
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def post_stream(self, path: str, body: bytes) -> Any:
        if self.writer is None or self.writer.is_closing():
            self.reader, self.writer = await asyncio.open_connection(self.host, self.port, limit=1 << 24)
        assert self.reader is not None
        self.writer.write(f"POST {path} HTTP/1.1\r\nHost: {self.host}\r\nContent-Type: application/json\r\n"
                          f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        await self.writer.drain()
        status = (await self.reader.readline()).decode()
        headers: dict[str, str] = {}
        while (line := await self.reader.readline()) not in (b"\r\n", b""):
            k, _, v = line.decode("latin-1").partition(":")
            headers[k.strip().lower()] = v.strip()
        if " 200 " not in status:
            n = int(headers.get("content-length", "0"))
            detail = (await self.reader.readexactly(n)).decode(errors="replace") if n else ""
            self.writer.close()
            self.writer = None
            raise RuntimeError(f"{status.strip()} {detail[:200]}")
        buf = b""
        if headers.get("transfer-encoding", "").lower() == "chunked":
            while True:
                size = int((await self.reader.readline()).split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    await self.reader.readline()
                    break
                buf += await self.reader.readexactly(size)
                await self.reader.readline()
                while b"\n\n" in buf:
                    event, buf = buf.split(b"\n\n", 1)
                    yield event
        else:
            n = headers.get("content-length")
            buf = await (self.reader.readexactly(int(n)) if n is not None else self.reader.read())
            if n is None:
                self.writer.close()
                self.writer = None
            for event in buf.split(b"\n\n"):
                yield event

    async def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


class SglangClient:
    def __init__(self, url: str, concurrency: int) -> None:
        self.conns = [HttpConn(url) for _ in range(concurrency)]

    async def send(self, req: Req, rid: str, slot: int) -> None:
        body = json.dumps({"input_ids": req.prompt, "stream": True, "rid": rid,
                           "sampling_params": {"max_new_tokens": req.max_tokens, "ignore_eos": True,
                                               "temperature": 0.0}}).encode()
        t0 = time.monotonic()
        req.sent = t0
        try:
            async for event in self.conns[slot].post_stream("/generate", body):
                data = event.strip().removeprefix(b"data:").strip()
                if not data or data == b"[DONE]":
                    continue
                msg = json.loads(data)
                if msg["output_ids"]:
                    if math.isnan(req.ttft):
                        req.ttft = time.monotonic() - t0
                    req.reply.extend(msg["output_ids"])
                meta = msg["meta_info"]
                req.cached = meta.get("cached_tokens", 0) or req.cached
                req.replica = meta.get("worker", -1)
                req.engine_ttft = meta.get("engine_ttft", math.nan)
                if (meta.get("finish_reason") or {}).get("type") == "abort":
                    req.error = f"abort: {meta['finish_reason'].get('message', '')}"[:200]
        except (OSError, RuntimeError, ValueError, asyncio.IncompleteReadError) as exc:
            req.error = repr(exc)[:200]
            await self.conns[slot].close()
            self.conns[slot].writer = None
        req.e2e = time.monotonic() - t0

    async def close(self) -> None:
        for c in self.conns:
            await c.close()


# ----------------------------------------------------------------------------------------- engines
class EngineWatch:
    def __init__(self, addresses: list[str]) -> None:
        self.channels = [open_channel(a) for a in addresses]
        self.stubs = [engine_pb2_grpc.EngineStub(c) for c in self.channels]

    async def loads(self) -> list[engine_pb2.LoadReport]:
        return list(await asyncio.gather(*(s.GetLoad(engine_pb2.LoadRequest(), timeout=5) for s in self.stubs)))

    async def sample(self, out: list[Sample], stop: asyncio.Event, interval: float = 0.05) -> None:
        t0 = time.monotonic()
        while not stop.is_set():
            with contextlib.suppress(grpc.aio.AioRpcError):
                loads = await self.loads()
                out.append(Sample(time.monotonic() - t0, [r.active_requests + r.queued_requests for r in loads],
                                  [r.kv_blocks_used for r in loads], [r.kv_blocks_total for r in loads]))
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stop.wait(), interval)

    async def close(self) -> None:
        for c in self.channels:
            await c.close()


# ------------------------------------------------------------------------------------------- runs
async def closed_loop(trace: routing_trace.Trace, lead: list[int], client: Any) -> list[Req]:
    queue: asyncio.Queue[routing_trace.Conversation] = asyncio.Queue()
    for conv in trace.conversations:
        queue.put_nowait(conv)
    reqs: list[Req] = []

    async def worker(slot: int) -> None:
        while not queue.empty():
            conv = queue.get_nowait()
            replies: list[list[int]] = []
            for turn in range(conv.turns):
                req = Req(conv.cid, turn, routing_trace.prompt(conv, replies, turn, lead), conv.max_tokens[turn])
                reqs.append(req)
                # The turn's router: 2-router runs alternate turns of a conversation between routers.
                req.rid = f"r{uuid.uuid4().hex[:16]}-{conv.cid}-{turn}"
                await client.send(req, req.rid, slot if isinstance(client, SglangClient) else conv.cid + turn)
                if req.error:
                    break
                replies.append(req.reply)

    await asyncio.gather(*(worker(i) for i in range(trace.concurrency)))
    return reqs


def parse_spans(paths: list[pathlib.Path], engines: list[str]) -> tuple[dict[str, tuple[int, float]], list[float]]:
    """From routers' --trace-file output: request id -> (engine index, seconds from sending the
    request to the engine to its first token reaching the router: the `prefill` span), and every
    `route` span's duration (the placement decision)."""
    rid_of: dict[str, str] = {}
    replica: dict[str, str] = {}
    prefill: dict[str, float] = {}
    durations: list[float] = []
    for path in paths:
        if not path.exists():
            continue
        for line in path.read_text().splitlines():
            with contextlib.suppress(ValueError, KeyError):
                span = json.loads(line)
                attrs, tid = span.get("attributes") or {}, span["trace_id"]
                if span["name"] == "tokenrelay.generate" and "tokenrelay.request_id" in attrs:
                    rid_of[tid] = attrs["tokenrelay.request_id"]
                elif span["name"] == "route":
                    durations.append((span["end"] - span["start"]) / 1e9)
                    if "tokenrelay.replica" in attrs:
                        replica[tid] = attrs["tokenrelay.replica"]
                elif span["name"] == "prefill":
                    prefill[tid] = (span["end"] - span["start"]) / 1e9   # the last attempt's
    index = {a: i for i, a in enumerate(engines)}
    out = {rid: (index.get(replica.get(tid, ""), -1), prefill.get(tid, math.nan)) for tid, rid in rid_of.items()}
    return out, durations


class Bench:
    def __init__(self, args: argparse.Namespace, work: pathlib.Path) -> None:
        self.a = args
        self.work = work
        self.procs = Procs(work)
        self.run_index = 0
        self.rows: list[dict[str, Any]] = []
        self.redis_url = ""
        self.tok = ""
        self.adapter_urls: list[str] = []

    def engine_flags(self, blocks: int, decision: bool = False) -> list[str]:
        flags = ["--sim-tokens-per-block", str(TPB), "--sim-max-batch-size", str(256 if decision else self.a.batch)]
        if decision:
            return [*flags, "--sim-profile", "instant"]
        flags += ["--sim-prefill-time-per-token", str(self.a.prefill_us * 1e-6),
                  "--sim-decode-step-time", str(self.a.decode_ms / 1000), "--sim-decode-time-per-seq", "0"]
        return [*flags, "--sim-num-blocks", str(blocks)] if blocks else flags

    async def start_common(self) -> None:
        self.redis_url = await self.procs.redis()
        self.tok = await self.procs.tokenizer()

    async def run(self, trace: routing_trace.Trace, config: str, engines: list[str], group: str) -> dict[str, Any]:
        self.run_index += 1
        lead = [routing_trace.USER, self.run_index % 256, (self.run_index // 256) % 256]
        name = f"run{self.run_index}"
        spans: list[pathlib.Path] = []
        procs: list[str] = []
        client: Any
        if config.startswith("sglang-"):
            adapter = f"{group}-adapter"
            if adapter not in self.procs.procs:
                self.adapter_urls = await self.procs.adapter(adapter, engines)
            url = await self.procs.sglang(name, self.adapter_urls, config.removeprefix("sglang-"), [])
            procs = [name]
            client = SglangClient(url, trace.concurrency)
        else:
            policy = config.removesuffix("-2routers")
            n = 2 if config.endswith("-2routers") else 1
            addrs = await self.procs.routers(name, n, self.tok, engines, self.redis_url, name,
                                             ["--routing-policy", policy, *self.a.router_flag])
            procs = [f"{name}-r{i}" for i in range(n)]
            spans = [self.work / f"{p}.spans" for p in procs]
            client = TokenrelayClient(addrs, session=policy == "session")
        watch = EngineWatch(engines)
        before = await watch.loads()
        samples: list[Sample] = []
        stop = asyncio.Event()
        sampler = asyncio.create_task(watch.sample(samples, stop))
        t0 = time.monotonic()
        try:
            reqs = await closed_loop(trace, lead, client)
        finally:
            wall = time.monotonic() - t0
            stop.set()
            await sampler
            after = await watch.loads()
            await client.close()
            await watch.close()
            self.procs.stop(*procs)
        pairs = list(zip(after, before, strict=True))
        counters = {"prompt": [a.prompt_tokens_total - b.prompt_tokens_total for a, b in pairs],
                    "cached": [a.cached_tokens_total - b.cached_tokens_total for a, b in pairs]}
        route_times: list[float] = []
        if spans:
            replica_of, route_times = parse_spans(spans, engines)
            for r in reqs:
                r.replica, r.engine_ttft = replica_of.get(r.rid, (r.replica, r.engine_ttft))
        row = summarize(trace.name, config, reqs, samples, counters, wall, self.a.slo_ttft, TPB, len(engines),
                        trace.concurrency)
        if self.a.dump_requests:
            lines = [json.dumps({"trace": trace.name, "config": config, "cid": r.cid, "turn": r.turn,
                                 "replica": r.replica, "sent": r.sent - t0, "e2e": r.e2e, "prompt": len(r.prompt),
                                 "reply": len(r.reply), "cached": r.cached, "error": r.error}) for r in reqs]
            with pathlib.Path(self.a.dump_requests).open("a") as out:  # noqa: ASYNC230 - after the run
                out.write("".join(f"{line}\n" for line in lines))
        if route_times:
            row["route_p50_ms"] = percentile(route_times, 0.5) * 1000
            row["route_p99_ms"] = percentile(route_times, 0.99) * 1000
        print(f"  {trace.name:15s} {config:22s} hit {row['hit_rate']:.3f} (oracle {row['oracle_hit_rate']:.3f}) "
              f"ttft p50 {row['ttft_p50_s'] * 1000:.0f} ms  imb {row['imbalance_inflight']:.2f}  "
              f"same {row['followup_same_replica']:.2f}  errors {row['errors']}  {wall:.1f} s", flush=True)
        self.rows.append(row)
        return row


def plan(args: argparse.Namespace) -> list[tuple[str, list[str]]]:
    traces = args.traces.split(",")
    configs = args.configs.split(",") if args.configs else []
    out = []
    for t in traces:
        if configs:
            chosen = configs
        elif t == "chat-multiturn":
            chosen = list(TOKENRELAY + SGLANG) if not args.quick else ["round-robin", "least-loaded", "prefix",
                                                                        "prefix-2routers", "sglang-cache_aware",
                                                                        "sglang-round_robin"]
        else:
            chosen = list(HARD) + (["prefix-2routers"] if t == "shared-hot" and not args.quick else [])
        out.append((t, chosen))
    return out


def histogram_quantile(text: str, name: str, q: float) -> float:
    """Prometheus' histogram_quantile over every series of `name` in a /metrics text (linear within
    the bucket); NaN when the router has no such histogram."""
    buckets: dict[float, float] = {}
    for line in text.splitlines():
        if line.startswith(f"{name}_bucket{{"):
            le_text = line.split('le="', 1)[1].split('"', 1)[0]
            le = math.inf if le_text == "+Inf" else float(le_text)
            buckets[le] = buckets.get(le, 0.0) + float(line.rsplit(" ", 1)[1])
    if not buckets or not buckets.get(math.inf):
        return math.nan
    rank, lower, below = q * buckets[math.inf], 0.0, 0.0
    for le in sorted(buckets):
        if buckets[le] >= rank:
            if le == math.inf:
                return lower
            return lower + (le - lower) * (rank - below) / max(buckets[le] - below, 1e-12)
        lower, below = le, buckets[le]
    return math.nan


async def decision_time(bench: Bench) -> dict[str, Any]:
    a = bench.a
    await bench.start_common()
    engines = await bench.procs.engines("dt", a.replicas, bench.engine_flags(0, decision=True))
    # The router's own histogram when it has one (no trace file then: it writes every span to disk).
    has_metric = any("tokenrelay_router_route_seconds" in f.read_text() for f in (REPO / "router_svc").glob("*.py"))
    addrs = await bench.procs.routers("dt", 1, bench.tok, engines, bench.redis_url, "dt",
                                      ["--routing-policy", "prefix", *a.router_flag], trace=not has_metric)
    client = TokenrelayClient(addrs, session=False)
    rng = random.Random(7)
    systems = [[rng.randrange(256) for _ in range(256)] for _ in range(16)]
    reqs: list[Req] = []
    tasks: set[asyncio.Task[None]] = set()
    t0 = time.monotonic()
    i = 0
    while (now := time.monotonic() - t0) < a.seconds:
        due = int(now * a.rate) + 1
        while i < due and len(tasks) < 512:
            req = Req(i, 0, [*systems[i % 16], *(rng.randrange(256) for _ in range(32))], 1)
            reqs.append(req)
            req.rid = f"dt-{i}"
            task = asyncio.create_task(client.send(req, req.rid, 0))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
            i += 1
        await asyncio.sleep(0.001)
    if tasks:
        await asyncio.gather(*tasks)
    wall = time.monotonic() - t0
    text = ""
    with contextlib.suppress(OSError):
        text = await asyncio.to_thread(lambda: urllib.request.urlopen(bench.procs.metrics_url("dt-r0"), timeout=5)
                                       .read().decode())
    await client.close()
    bench.procs.stop("dt-r0")
    _, durations = parse_spans([bench.work / "dt-r0.spans"], engines)
    ok = [r for r in reqs if not r.error]
    out = {"offered_rps": a.rate, "achieved_rps": len(ok) / wall, "requests": len(reqs),
           "errors": len(reqs) - len(ok), "errors_sample": sorted({r.error for r in reqs if r.error})[:3],
           "route_span_p50_ms": percentile(durations, 0.5) * 1000,
           "route_span_p99_ms": percentile(durations, 0.99) * 1000,
           "route_seconds_p50_ms": histogram_quantile(text, "tokenrelay_router_route_seconds", 0.5) * 1000,
           "route_seconds_p99_ms": histogram_quantile(text, "tokenrelay_router_route_seconds", 0.99) * 1000,
           "ttft_p50_ms": percentile([r.ttft for r in ok], 0.5) * 1000,
           "ttft_p99_ms": percentile([r.ttft for r in ok], 0.99) * 1000}
    print(json.dumps(out, indent=2))
    return out


async def main_async(args: argparse.Namespace) -> int:
    if args.report:    # re-render a saved run
        saved = json.loads(pathlib.Path(args.report).read_text())
        if "rows" in saved:
            print(table(saved["rows"]))
            print()
            print(render_checks(checks(saved["rows"])))
        else:
            print(json.dumps(saved.get("decision_time"), indent=2))
        return 0
    work = pathlib.Path(tempfile.mkdtemp(prefix="bench-routing-"))
    bench = Bench(args, work)
    print(f"logs: {work}", flush=True)
    result: dict[str, Any] = {"args": vars(args)}
    try:
        if args.decision_time:
            result["decision_time"] = await decision_time(bench)
        else:
            await bench.start_common()
            groups: dict[str, list[str]] = {}
            for trace_name, configs in plan(args):
                concurrency = args.evict_concurrency if trace_name == "evict" else args.concurrency
                trace = routing_trace.build(trace_name, args.seed, args.conversations, concurrency)
                blocks = args.evict_blocks if trace_name == "evict" else 0
                group = f"g{blocks}"
                if group not in groups:
                    for old in list(groups):   # one engine group at a time
                        bench.procs.stop(*[n for n in bench.procs.procs if n.startswith(old)])
                        del groups[old]
                    groups[group] = await bench.procs.engines(group, args.replicas, bench.engine_flags(blocks))
                print(f"{trace_name}: {len(trace.conversations)} conversations, {trace.requests} requests", flush=True)
                for config in configs:
                    if config.startswith("sglang-") and not (SGLANG_VENV / "bin" / "python").exists():
                        print(f"  {config}: skipped (no sglang-router in {SGLANG_VENV})")
                        continue
                    await bench.run(trace, config, groups[group], group)
            print()
            print(table(bench.rows))
            print()
            results = checks(bench.rows)
            print(render_checks(results))
            result["rows"] = bench.rows
            result["checks"] = [{"check": n, "ok": ok, "detail": d} for n, ok, d in results]
    finally:
        bench.procs.stop()
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(result, indent=2, default=str))
    return 0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--traces", default=",".join(routing_trace.TRACES))
    p.add_argument("--configs", default="", help=f"comma-separated, of {', '.join(TOKENRELAY + SGLANG)} "
                                                 "(default: see above)")
    p.add_argument("--quick", action="store_true", help="16 conversations, fewer configurations")
    p.add_argument("--conversations", type=int, default=0, help="per trace (default 32, --quick 16)")
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--replicas", type=int, default=8)
    p.add_argument("--batch", type=int, default=2, help="each sim's max batch size")
    p.add_argument("--prefill-us", type=float, default=200.0, help="sim prefill µs per uncached prompt token")
    p.add_argument("--decode-ms", type=float, default=4.0, help="sim decode step, ms")
    p.add_argument("--evict-blocks", type=int, default=96, help="KV blocks per replica on the evict trace")
    p.add_argument("--evict-concurrency", type=int, default=16, help="conversations at a time on the evict trace")
    p.add_argument("--slo-ttft", type=float, default=0.25, help="goodput: requests with TTFT at most this (s)")
    p.add_argument("--router-flag", action="append", default=[],
                   help="extra flag for tokenrelay's routers, repeatable: --router-flag=--prefix-balance-slack=0")
    p.add_argument("--decision-time", action="store_true")
    p.add_argument("--rate", type=float, default=1000.0)
    p.add_argument("--seconds", type=float, default=5.0)
    p.add_argument("--json", default="")
    p.add_argument("--dump-requests", default="", metavar="JSONL",
                   help="append every request (config, conversation, turn, replica, send time, cached) here")
    p.add_argument("--report", default="", metavar="JSON", help="print the table and checks of a saved --json run")
    a = p.parse_args(argv)
    a.conversations = a.conversations or (16 if a.quick else 32)
    return a


def main(argv: list[str] | None = None) -> int:
    return asyncio.run(main_async(parse_args(argv)))


if __name__ == "__main__":
    sys.exit(main())
