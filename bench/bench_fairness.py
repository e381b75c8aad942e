"""The admission queue's "Shows" of issue 11 (fairness, weights, priority, overload), measured
through a real mesh, each scenario against its baseline measured in the same run.

Real processes (bench/fairness_mesh.py): redis-server, tokenizer_svc (the byte-level tokenizer of
`up --engine sim`), ``--engines`` sim engines (``--profile``, default h200-llama8b-fp8, batch
``--batch``, slowed by ``--time-scale``), ``--routers`` router processes sharing one admission pool
in Redis. The pool's capacity C is the engines' batch sizes summed (the routers take it from the
engines' load reports). Load (bench/fairness_load.py): asyncio gRPC clients in ``--clients``
processes (0 = in this process), raw stubs, per-tenant API keys, unique random prompts of
``--prompt-tokens`` and ``max_tokens`` uniform in [M/2, 3M/2] (M = ``--max-tokens``, ignore_eos).
Every phase: ``--warmup`` s, then ``--seconds`` s measured (TTFT of the requests started in it,
tokens served in it), then a tail of at most ``--tail`` s under the same load until every
measured request has its first token; the pool is drained between phases.

  a  fairness: quiet1..3 closed loop with their share of the slots each (C/4 streams x --quiet-load)
     alone (baseline), then with `noisy` offering 10x its share; quiet TTFT p99 ratio <= 1.25,
     Jain's index over weighted served tokens (prompt + output) of the 4 tenants >= 0.95.
  b  weights 1:2:4, each tenant backlogged (--backlog x C streams): served-token share vs weight
     share within 5%.
  c  priority: `inter` (priority high, --interactive-load x C streams) alone, then with `batch`
     (priority low, --backlog x C streams) saturating: inter's TTFT p99 <= SLO = --slo-factor x its
     p99 alone; batch's share of served tokens >= its class's min_share (--queue-classes).
  d  overload: capacity = output tokens/s of `cap` alone (closed loop, --backlog x C streams); then
     open loop at --overload x that (in requests/s) from `over1` (max_queued C) and `over2`
     (a budget of ~2C requests' tokens per minute, 3 s deadlines): goodput (output tokens/s, in
     the window, of requests that did not fail: ended `done` or still streaming when the bench
     stopped; both phases alike) >= 95% of capacity; rejection latency (call -> status, refused
     before `accepted`) p99 <= 10 ms, beside the floor of the same phase: calls with an unknown
     API key (refused before admission).

    python bench/bench_fairness.py --seconds 8 --routers 2 --clients 2 --cpu-list 0-15 --json out.json
    python bench/bench_fairness.py --scenario a,d --seconds 4 --batch 16 --time-scale 8   # a small host
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import pathlib
import shutil
import sys
import tempfile
import threading
import time
from typing import Any

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

from fairness_load import Flow, Phase, Rec, Workers, jain, measured, percentile, served, ttfts
from fairness_mesh import Mesh
from fairness_report import check, ms, render

BIG = 1_000_000
QUIET = ("quiet1", "quiet2", "quiet3")
# A key no tenant has: refused with UNAUTHENTICATED before any admission work, in the same phase as
# the overload: the floor of call -> status on this host under this load (gRPC, the router's accept path).
PROBE = "probe-unknown-key"


def tenants() -> list[dict[str, Any]]:
    """Every scenario's tenants (one file for the whole run)."""
    plain = {"max_in_flight": BIG, "max_queued": 100_000}
    return [*({"name": n, **plain} for n in (*QUIET, "noisy")),
            {"name": "w1", **plain, "weight": 1.0}, {"name": "w2", **plain, "weight": 2.0},
            {"name": "w4", **plain, "weight": 4.0},
            {"name": "inter", **plain, "priority_ceiling": "high", "default_priority": "high"},
            {"name": "batch", **plain, "priority_ceiling": "low", "default_priority": "low"},
            {"name": "cap", **plain}]


def overload_tenants(capacity: int, args: argparse.Namespace) -> list[dict[str, Any]]:
    # over2's budget: about 2C requests' tokens per minute. GCRA lets a tenant spend a whole minute's
    # budget at once, so over2 spends it in the first second or two, and is held to the rate after it.
    tpm = 2 * capacity * (args.prompt_tokens + args.max_tokens)
    return [{"name": "over1", "max_in_flight": BIG, "max_queued": capacity},
            {"name": "over2", "max_in_flight": BIG, "max_queued": capacity, "tokens_per_minute": tpm}]


class Bench:
    def __init__(self, args: argparse.Namespace, mesh: Mesh, workers: Workers) -> None:
        self.args, self.mesh, self.workers = args, mesh, workers
        self.C = mesh.capacity
        self.seq = 0
        self.last_routers: dict[str, float] = {}   # the routers' counters over the last phase (Mesh.router_stats)

    def run(self, name: str, flows: list[Flow]) -> tuple[list[Rec], dict[str, Any]]:
        a = self.args
        self.seq += 1
        phase = Phase(name, flows, self.mesh.routers, a.prompt_tokens, a.max_tokens, a.warmup, a.seconds,
                      a.tail, seed=a.seed + self.seq)
        samples: list[dict[str, Any]] = []
        lead = 1.0 if self.workers.count else 0.1
        timer = threading.Timer(lead + a.warmup + 0.8 * a.seconds, lambda: samples.append(self.mesh.pool_state()))
        timer.start()
        t = time.monotonic()
        before = self.mesh.router_stats()
        recs = self.workers.run(phase)
        after = self.mesh.router_stats()
        wall = time.monotonic() - t
        if a.dump_requests:
            with open(a.dump_requests, "a") as f:
                for r in recs:
                    f.write(json.dumps({"phase": name, **dataclasses.asdict(r)}) + "\n")
        self.last_routers = {k: after[k] - before[k] for k in after}
        self.last_routers["cpu_per_router"] = self.last_routers["cpu_s"] / wall / len(self.mesh.routers)
        self.last_routers["tokenizer_cores"] = self.last_routers["tokenizer_cpu_s"] / wall
        self.last_routers["redis_cores"] = self.last_routers["redis_cpu_s"] / wall
        timer.cancel()
        self.mesh.drain()
        state = samples[0] if samples else {}
        print(f"# {name}: {len(recs)} requests, {time.monotonic() - t:.1f} s, pool at 80% of the window: {state}",
              file=sys.stderr, flush=True)
        return recs, state

    def streams(self, factor: float) -> int:
        return max(1, round(factor * self.C))

    def tenant_row(self, recs: list[Rec], tenant: str, streams: int) -> dict[str, Any]:
        w = self.args.seconds
        mine = measured(recs, w, {tenant})
        t = ttfts(recs, w, {tenant})
        waits = [r.queue_s * 1000 for r in mine if r.queue_s is not None]
        return {"tenant": tenant, "streams": streams, "requests": len(mine),
                "queue_p50_ms": percentile(waits, 50), "queue_p99_ms": percentile(waits, 99),
                "done": sum(r.outcome == "done" for r in mine),
                "queued_pct": 100 * sum(r.queued for r in mine) / len(mine) if mine else 0.0,
                "ttft_p50_ms": percentile(t, 50) * 1000, "ttft_p99_ms": percentile(t, 99) * 1000,
                "served_tok_s": served(recs, tenant) / w, "output_tok_s": served(recs, tenant, prompt=False) / w}

    # ------------------------------------------------------------------------------ scenarios
    def fairness(self) -> dict[str, Any]:
        share = self.C / 4
        q = max(1, round(self.args.quiet_load * share))
        noisy = max(1, round(10 * share))
        quiet = [Flow(t, streams=q) for t in QUIET]
        alone, _ = self.run("a/quiet-alone", quiet)
        loaded, state = self.run("a/quiet+noisy", [*quiet, Flow("noisy", streams=noisy)])
        w = self.args.seconds
        rows = []
        for t in QUIET:
            ra, rl = self.tenant_row(alone, t, q), self.tenant_row(loaded, t, q)
            rows.append({**rl, "alone_p50_ms": ra["ttft_p50_ms"], "alone_p99_ms": ra["ttft_p99_ms"]})
        rows.append({**self.tenant_row(loaded, "noisy", noisy), "alone_p50_ms": math.nan, "alone_p99_ms": math.nan})
        qa, ql = ttfts(alone, w, set(QUIET)), ttfts(loaded, w, set(QUIET))
        qwait = [r.queue_s * 1000 for r in measured(loaded, w, set(QUIET)) if r.queue_s is not None]
        qwait_alone = [r.queue_s * 1000 for r in measured(alone, w, set(QUIET)) if r.queue_s is not None]
        p99a, p99l = percentile(qa, 99), percentile(ql, 99)
        total = sum(r["served_tok_s"] for r in rows)
        for r in rows:
            r["share_pct"] = 100 * r["served_tok_s"] / total if total else 0.0
        ji = jain([r["served_tok_s"] for r in rows])        # every weight is 1
        lease = state.get("lease_s")
        return {"rows": rows, "quiet_ttft_alone_ms": [percentile(qa, 50) * 1000, p99a * 1000],
                "quiet_ttft_noisy_ms": [percentile(ql, 50) * 1000, p99l * 1000],
                "mean_lease_s": lease, "quiet_queue_noisy_ms": [percentile(qwait, 50), percentile(qwait, 99)],
                "quiet_queue_alone_ms": [percentile(qwait_alone, 50), percentile(qwait_alone, 99)],
                "slot_turnover_ms": lease / self.C * 1000 if lease else None,
                "checks": [check("quiet TTFT p99 with noisy / alone", p99l / p99a, "<=", 1.25),
                           check("quiet TTFT p50 with noisy / alone (info)", percentile(ql, 50) / percentile(qa, 50),
                                 "info"),
                           check("Jain's index, weighted served tokens", ji, ">=", 0.95)]}

    def weights(self) -> dict[str, Any]:
        n = self.streams(self.args.backlog)
        ws = {"w1": 1.0, "w2": 2.0, "w4": 4.0}
        recs, _ = self.run("b/weights-1:2:4", [Flow(t, streams=n) for t in ws])
        rows = [self.tenant_row(recs, t, n) for t in ws]
        total = sum(r["served_tok_s"] for r in rows)
        for r in rows:
            r["weight"] = ws[r["tenant"]]
            r["share_pct"] = 100 * r["served_tok_s"] / total if total else 0.0
            r["target_pct"] = 100 * r["weight"] / sum(ws.values())
            r["error_pct"] = 100 * (r["share_pct"] / r["target_pct"] - 1)
        worst = max(abs(r["error_pct"]) for r in rows)
        return {"rows": rows, "checks": [check("worst |served share / weight share - 1|", worst / 100, "<=", 0.05),
                                         check("Jain's index, weighted served tokens",
                                               jain([r["served_tok_s"] / r["weight"] for r in rows]), "info")]}

    def priority(self) -> dict[str, Any]:
        i, b = self.streams(self.args.interactive_load), self.streams(self.args.backlog)
        alone, _ = self.run("c/inter-alone", [Flow("inter", streams=i)])
        loaded, _ = self.run("c/inter+batch", [Flow("inter", streams=i), Flow("batch", streams=b)])
        w = self.args.seconds
        slo = self.args.slo_factor * percentile(ttfts(alone, w, {"inter"}), 99)
        alone_p99 = self.tenant_row(alone, "inter", i)["ttft_p99_ms"]
        rows = [{**self.tenant_row(loaded, "inter", i), "alone_p99_ms": alone_p99},
                {**self.tenant_row(loaded, "batch", b), "alone_p99_ms": math.nan}]
        total = sum(r["served_tok_s"] for r in rows)
        for r in rows:
            r["share_pct"] = 100 * r["served_tok_s"] / total if total else 0.0
        p99 = percentile(ttfts(loaded, w, {"inter"}), 99)
        return {"rows": rows, "slo_ms": slo * 1000, "batch_min_share": batch_min_share(self.args),
                "checks": [check(f"inter TTFT p99 / SLO ({self.args.slo_factor:g}x its p99 alone = "
                                 f"{ms(slo * 1000)} ms)", p99 / slo, "<=", 1.0),
                           check("batch share of served tokens", rows[1]["share_pct"] / 100, ">=",
                                 batch_min_share(self.args))]}

    def overload(self) -> dict[str, Any]:
        a, w = self.args, self.args.seconds
        cap_recs, _ = self.run("d/capacity", [Flow("cap", streams=self.streams(a.backlog))])
        done = [r for r in cap_recs if r.outcome == "done"]
        # Tokens served in the window by requests that did not fail: ended `done`, or still streaming
        # when the bench stopped after its tail (outcome ""; cut by the bench, not by the mesh). Both
        # phases count the same way; `done` alone is reported beside it.
        capacity = sum(r.tokens for r in cap_recs if r.outcome in ("done", "")) / w
        capacity_done = sum(r.tokens for r in done) / w
        mean_out = sum(r.completion for r in done) / len(done) if done else float(a.max_tokens)
        rate = a.overload * capacity / mean_out
        flows = [Flow("over1", rate=rate / 2, timeout=30.0), Flow("over2", rate=rate / 2, timeout=3.0),
                 Flow(PROBE, rate=max(5.0, rate / 20))]
        recs, _ = self.run("d/overload", flows)
        routers = dict(self.last_routers)
        client_lag = [x * 1000 for x in self.workers.last_lags]
        probe = [(r.end - r.start) * 1000 for r in measured(recs, w, {PROBE}) if r.end is not None]
        recs = [r for r in recs if r.tenant != PROBE]
        goodput = sum(r.tokens for r in recs if r.outcome in ("done", "")) / w
        goodput_done = sum(r.tokens for r in recs if r.outcome == "done") / w
        mine = measured(recs, w)
        refused = [r for r in mine if not r.accepted and r.outcome not in ("", "done")]
        lat = [(r.end - r.start) * 1000 for r in refused if r.end is not None]
        reasons: dict[str, list[float]] = {}
        for r in mine:
            if r.outcome not in ("done", "") and r.end is not None:
                key = (r.outcome if not r.accepted else f"{r.outcome} (after accepted)") + f" [{r.tenant}]"
                reasons.setdefault(key, []).append((r.end - r.start) * 1000)
        table = [{"reason": k, "count": len(v), "p50_ms": percentile(v, 50), "p99_ms": percentile(v, 99)}
                 for k, v in sorted(reasons.items(), key=lambda kv: -len(kv[1]))]
        return {"capacity_tok_s": capacity, "capacity_done_tok_s": capacity_done, "goodput_done_tok_s": goodput_done,
                "offered_req_s": rate, "capacity_req_s": capacity / mean_out,
                "goodput_tok_s": goodput, "requests": len(mine), "done": sum(r.outcome == "done" for r in mine),
                "refused": len(refused), "rejection_ms": [percentile(lat, 50), percentile(lat, 99)], "reasons": table,
                "floor_ms": [percentile(probe, 50), percentile(probe, 99)], "floor_calls": len(probe),
                "client_loop_lag_ms": [percentile(client_lag, 50), percentile(client_lag, 99)],
                "routers": routers,
                "checks": [check("goodput / capacity alone", goodput / capacity if capacity else 0.0, ">=", 0.95),
                           check("goodput / capacity, `done` requests only (cut by the bench = lost)",
                                 goodput_done / capacity_done if capacity_done else 0.0, "info"),
                           check("rejection latency p99 (ms)", percentile(lat, 99), "<=", 10.0),
                           check("rejection p99 - floor p99 (ms): admission's part", percentile(lat, 99)
                                 - percentile(probe, 99), "info"),
                           check("load processes' own loop lag p99 (ms): the client's part", percentile(client_lag, 99),
                                 "info"),
                           check("router CPU per process over the phase (cores)", routers["cpu_per_router"], "info"),
                           check("tokenizer / Redis CPU over the phase (cores)",
                                 f"{routers['tokenizer_cores']:.2f} / {routers['redis_cores']:.2f}", "info"),
                           check("router loop lags > 10 ms / > 50 ms (of 10 ms timer samples)",
                                 f"{routers['lag_over_10ms']:.0f} / {routers['lag_over_50ms']:.0f} of "
                                 f"{routers['lag_samples']:.0f}", "info"),
                           check("refusals over 10 ms in the routers' own view (handler to status; of all, "
                                 "over the phase)", f"{routers['refusals_over_10ms']:.0f} of {routers['refusals']:.0f}",
                                 "info"),
                           check("refusals decided in the router (budget and queue memos) / ENQUEUE calls",
                                 f"{routers['local_refusals']:.0f} / {routers['enqueue_calls']:.0f}", "info"),
                           check("router GC collections > 10 ms (of all; seconds in GC)",
                                 f"{routers['gc_over_10ms']:.0f} of {routers['gc']:.0f}; {routers['gc_s']:.3f} s",
                                 "info")]}


def batch_min_share(args: argparse.Namespace) -> float:
    """The batch class's min_share from the routers' --queue-classes (the router's default else)."""
    spec = "interactive:0:4096,standard:0.1:4096,batch:0.05:4096"
    for arg in args.router_arg:
        if arg.startswith("--queue-classes="):
            spec = arg.split("=", 1)[1]
    return next((float(p.split(":")[1]) for p in spec.split(",") if p.split(":")[0] == "batch"), 0.05)


SCENARIOS = {"a": Bench.fairness, "b": Bench.weights, "c": Bench.priority, "d": Bench.overload}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--scenario", default="a,b,c,d", help="scenarios to run, comma-separated (a,b,c,d)")
    p.add_argument("--seconds", type=float, default=8.0, help="measured seconds per phase")
    p.add_argument("--warmup", type=float, default=2.0, help="seconds of load before each measured window")
    p.add_argument("--tail", type=float, default=3.0, help="at most this many seconds of load after the window, "
                   "until every measured request has its first token")
    p.add_argument("--routers", type=int, default=1, help="router processes (each tenant's streams spread over them)")
    p.add_argument("--engines", type=int, default=1, help="sim engine processes")
    p.add_argument("--clients", type=int, default=1, help="load processes (0 = in this process)")
    p.add_argument("--profile", default="h200-llama8b-fp8", help="the sim's cost profile (engine --sim-profile)")
    p.add_argument("--batch", type=int, default=64, help="the sim's batch size (C = batch x engines)")
    p.add_argument("--time-scale", type=float, default=4.0, help="the sim's --sim-time-scale (real s per simulated "
                   "s; above 1 keeps the Python routers and clients below saturation)")
    p.add_argument("--prompt-tokens", type=int, default=128, help="prompt tokens of every request")
    p.add_argument("--max-tokens", type=int, default=64, help="mean max_tokens (uniform in [M/2, 3M/2])")
    p.add_argument("--quiet-load", type=float, default=1.0, help="a: quiet tenants' streams, x their share (C/4)")
    p.add_argument("--backlog", type=float, default=2.0, help="b, c, d: a backlogged tenant's streams, x C")
    p.add_argument("--interactive-load", type=float, default=1.0, help="c: the interactive tenant's streams, x C")
    p.add_argument("--slo-factor", type=float, default=2.0, help="c: SLO = this x inter's TTFT p99 alone")
    p.add_argument("--overload", type=float, default=3.0, help="d: offered load, x the capacity measured alone")
    p.add_argument("--cpu-list", default="", help="CPUs to pin to, split in order: routers (one each), Redis, "
                   "the tokenizer, engines (one each), the rest for the load processes (default: not pinned)")
    for role in ("router", "redis", "tokenizer", "engine", "client"):
        p.add_argument(f"--{role}-cpus", default="", help=f"CPUs of the {role} process(es), over --cpu-list")
    p.add_argument("--engine-arg", action="append", default=[], help="extra engine_svc flag (repeatable)")
    p.add_argument("--router-arg", action="append", default=[], help="extra router_svc flag, --flag=value "
                   "(repeatable)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--json", default="", help="write every figure as JSON here")
    p.add_argument("--keep", action="store_true", help="keep the work directory (logs)")
    p.add_argument("--dump-requests", default="", help="write every phase's requests (as each client saw "
                   "them) to this JSONL file")
    args = p.parse_args(argv)
    args.scenarios = [s.strip() for s in args.scenario.split(",") if s.strip()]
    bad = [s for s in args.scenarios if s not in SCENARIOS]
    if bad or not args.scenarios:
        p.error(f"--scenario takes a comma-separated subset of a,b,c,d (got {args.scenario!r})")
    for name in ("routers", "engines", "batch"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    work = pathlib.Path(tempfile.mkdtemp(prefix="bench-fairness-"))
    capacity = args.batch * args.engines
    mesh = Mesh(args, work, [*tenants(), *overload_tenants(capacity, args)])
    results: dict[str, Any] = {}
    try:
        workers = Workers(args.clients, mesh.cpus.clients)
        try:
            bench = Bench(args, mesh, workers)
            print(f"# routers {mesh.routers}; pool capacity C = {capacity}; pinned: "
                  f"{'yes' if args.cpu_list or args.router_cpus else 'no'}; work dir {work}", file=sys.stderr)
            for s in args.scenarios:
                results[s] = SCENARIOS[s](bench)
                print(render(s, results[s], args, capacity), flush=True)
        finally:
            workers.close()
    finally:
        mesh.stop()
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    misses = [c["name"] for r in results.values() for c in r["checks"] if c["status"] == "MISS"]
    print(f"\n{sum(c['status'] == 'PASS' for r in results.values() for c in r['checks'])} PASS, {len(misses)} MISS"
          + (f": {'; '.join(misses)}" if misses else ""))
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps({"args": {k: v for k, v in vars(args).items()},
                                                       "capacity": capacity, "scenarios": results},
                                                      indent=2, default=str) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
