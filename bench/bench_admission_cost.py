"""Cost of the Redis admission queue (issue 11): Redis round trips per request and admission
latency p50/p99 at given arrival rates with N router processes, against a bare EVALSHA.

Starts a redis-server of its own (unix socket; --appendonly yes|no), then N worker processes, each
holding one real `router_svc.admission.Admission` (its own connection pool, heartbeat, grant
listener and reaper: what one router process runs). Per rate, every worker runs two phases with an
open-loop Poisson arrival at rate/N (after an unrecorded warm-up of each):

- baseline: one EVALSHA of a trivial one-key script per arrival, on the client the Admission's own
  calls use (its lean connection, router_svc/redis_scripts.py, or with --redis-client redis-py its
  redis-py pool): the raw client + socket + Redis cost, in the same processes, same run;
- admission: admit (call -> granted) -> hold --service-ms -> settle_tokens (call -> done).

Per phase it reports admit (or baseline call) latency p50/p90/p99, the ratio of admission's p50 and
p99 to the baseline's, settle latency, Redis round trips per request from `INFO commandstats`
(evalsha + eval calls, less the heartbeat/reap calls the workers counted, which are shown apart
as background calls per second), every command Redis ran per request (those inside the Lua
included), Redis CPU and the workers' own CPU per request (x client: over the baseline's), the
generator's lag (scheduled -> sent p99: large means the client could not keep the rate), the
achieved rate and errors.

    python bench/bench_admission_cost.py --rates 1000,5000 --workers 2 --seconds 10 --cpu-list 0-2
    python bench/bench_admission_cost.py --rates 200,500 --seconds 5 --capacity 8 --json out.json

--cpu-list: the first CPU runs redis-server, the next ones one worker each (wrapping around).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import pathlib
import random
import re
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from typing import Any

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

import redis

from router_svc import queue_lua
from router_svc.admission import Admission, AdmissionSettings
from router_svc.ports import AdmitRequest
from services.errors import TokenrelayError
from services.logging import configure_logging
from services.redis_client import unix_socket_listening
from tokenrelay_tools.bench.report import _table, dist_stats

BASELINE_LUA = "return redis.call('EXISTS', KEYS[1])"
SCRIPTS = ("ENQUEUE", "SETTLE", "CANCEL", "BEAT", "REAP")
BACKGROUND = ("BEAT", "REAP")


def cpu_list(text: str) -> list[int]:
    out: list[int] = []
    for part in (p for p in text.split(",") if p.strip()):
        lo, _, hi = part.partition("-")
        out += list(range(int(lo), int(hi or lo) + 1))
    return out


def _text(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


# ------------------------------------------------------------------------------------ worker
class Worker:
    """One router process's Admission, driven by commands from the parent."""

    def __init__(self, index: int, cfg: dict[str, Any]) -> None:
        self.index, self.cfg = index, cfg
        settings = AdmissionSettings(redis_url=cfg["url"], pool="bench", pool_capacity=cfg["capacity"] or 1_000_000,
                                     max_connections=cfg["max_connections"], lease_ttl=cfg["lease_ttl"],
                                     reap_interval=cfg["reap_interval"], redis_client=cfg["redis_client"])
        self.adm = Admission(settings, router_id=f"bench-w{index}")
        self.calls: Counter[str] = Counter()
        self.failed: Counter[str] = Counter()
        self.anomalies: list[dict[str, Any]] = []
        self.settled: set[str] = set()
        # Count every script call this process makes (the hot path and background), whichever client
        # carries it: `Admission.call` is where each one starts.
        self._call = self.adm.call
        self._pending: set[asyncio.Future[Any]] = set()
        self.adm.call = self._counted    # type: ignore[method-assign]
        self.baseline = self.adm.redis.register_script(BASELINE_LUA)
        self.rng = random.Random(cfg["seed"] * 1000 + index)

    def _counted(self, name: str, *args: Any) -> asyncio.Future[Any]:
        self.calls[name] += 1
        op = self._call(name, *args)

        def done(fut: asyncio.Future[Any]) -> None:
            if fut.cancelled() or fut.exception() is not None:
                self.failed[name] += 1
                return
            reply = fut.result()
            # args: n, then the first entry's member and fence (SETTLE); the reply's first status is its own
            if name == "SETTLE" and int(reply[0]) == 0:          # stale fence or unknown: the bench's error
                self._later(self.anomaly("settle_refused", _text(args[1]), args[2]))
            elif name == "BEAT":
                rest = reply[len(self.adm.classes):]
                for i in range(0, len(rest) - 2, 3):
                    if rest[i] == b"lost":
                        self._later(self.anomaly("beat_lease_lost", rest[i + 1].decode(), ""))
        op.add_done_callback(done)
        return op

    def _later(self, coro: Any) -> None:
        task = asyncio.ensure_future(coro)
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)

    async def anomaly(self, kind: str, member: str, fence: Any) -> None:
        """Counted; the first few kept with the record's state in Redis now (to tell a race from a loss)."""
        self.failed[kind] += 1
        if len(self.anomalies) < 8:
            rec = await self.adm.redis.hgetall(f"tq:{{bench}}:r:{member}")
            self.anomalies.append({"kind": kind, "member": member, "fence_sent": str(fence),
                                   "record_now": {_text(k): _text(v) for k, v in rec.items()},
                                   "lease_score": await self.adm.redis.zscore("tq:{bench}:leases", member),
                                   "settled_here": member in self.settled, "at": time.time()})

    async def one_baseline(self, i: int, out: dict[str, Any]) -> None:
        self.calls["BASELINE"] += 1
        t0 = time.perf_counter()
        try:
            key = f"bench:{{bench}}:k{i % 64}"
            if self.adm.lean is not None:     # the same client as the admission's calls (--redis-client)
                await self.adm.lean.call(self.baseline.sha, self.baseline.script, [key], [])
            else:
                await self.baseline(keys=[key])
        except Exception as exc:  # noqa: BLE001 - counted, the run goes on
            out["errors"][type(exc).__name__] += 1
            return
        out["admit"].append(time.perf_counter() - t0)

    async def one_admission(self, i: int, out: dict[str, Any]) -> None:
        cfg = self.cfg
        req = AdmitRequest(f"t{i % cfg['tenants']}", f"w{self.index}-{out['tag']}-{i}", 2, cfg["cost"], 30.0,
                           1_000_000, 100_000)
        t0 = time.perf_counter()
        try:
            x = await self.adm.admit(req)
            if x.grant is None:
                out["queued"] += 1
            while x.grant is None:
                await x.next()
        except Exception as exc:  # noqa: BLE001 - counted (by reason when typed), the run goes on
            out["errors"][str(exc.reason) if isinstance(exc, TokenrelayError) else type(exc).__name__] += 1
            return
        out["admit"].append(time.perf_counter() - t0)
        await asyncio.sleep(cfg["service_ms"] / 1000)
        t1 = time.perf_counter()
        self.settled.add(f"{req.tenant}:{req.request_id}")
        await x.grant.settle_tokens(int(cfg["cost"] * 0.8))
        out["settle"].append(time.perf_counter() - t1)

    async def phase(self, kind: str, rate: float, seconds: float, start_at: float, tag: str) -> dict[str, Any]:
        out: dict[str, Any] = {"admit": [], "settle": [], "lag": [], "errors": Counter(), "queued": 0, "tag": tag}
        self.failed.clear()     # per phase, like the samples
        one = self.one_baseline if kind == "baseline" else self.one_admission
        loop = asyncio.get_running_loop()
        await asyncio.sleep(max(0.0, start_at - time.time()))
        ru0, t0 = resource.getrusage(resource.RUSAGE_SELF), loop.time()
        tasks: set[asyncio.Task[None]] = set()

        async def run(i: int, due: float) -> None:
            out["lag"].append(loop.time() - due)
            await one(i, out)

        at, i = t0, 0
        while True:
            at += self.rng.expovariate(rate)
            if at >= t0 + seconds:
                break
            if at > loop.time():
                await asyncio.sleep(at - loop.time())
            task = asyncio.ensure_future(run(i, at))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
            i += 1
        if tasks:
            await asyncio.wait(set(tasks))
        ru1 = resource.getrusage(resource.RUSAGE_SELF)
        out["cpu"] = (ru1.ru_utime + ru1.ru_stime) - (ru0.ru_utime + ru0.ru_stime)
        out["wall"], out["issued"] = loop.time() - t0, i
        out["errors"] = dict(out["errors"])
        return out

    async def serve(self, conn: Any) -> None:
        await self.adm.start()
        conn.send({"ready": True})
        while True:
            cmd = await asyncio.to_thread(conn.recv)
            if cmd is None:
                break
            result = await self.phase(**cmd)
            conn.send({**result, "calls": dict(self.calls), "failed": dict(self.failed), "anomalies": self.anomalies})
            self.anomalies = []
        await self.adm.close()


def worker_main(index: int, conn: Any, cfg: dict[str, Any], cpu: int | None) -> None:
    if cpu is not None:
        os.sched_setaffinity(0, {cpu})
    configure_logging("WARNING", fmt="console")
    try:
        asyncio.run(Worker(index, cfg).serve(conn))
    except BaseException as exc:
        conn.send({"fatal": repr(exc)})
        raise


# ------------------------------------------------------------------------------------ parent
class RedisServer:
    def __init__(self, appendonly: str, fsync: str, cpu: int | None) -> None:
        self.dir = pathlib.Path(tempfile.mkdtemp(prefix="bench-admission-"))
        self.sock = self.dir / "redis.sock"
        self.url = f"unix://{self.sock}"
        server = shutil.which("redis-server")
        if server is None:
            sys.exit("bench: redis-server is required (apt-get install redis-server)")
        self.proc = subprocess.Popen([server, "--port", "0", "--unixsocket", str(self.sock), "--save", "",
                                      "--appendonly", appendonly, "--appendfsync", fsync, "--dir", str(self.dir)],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        if cpu is not None:
            os.sched_setaffinity(self.proc.pid, {cpu})
        deadline = time.monotonic() + 10
        while not unix_socket_listening(self.sock):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                sys.exit("bench: redis-server did not start")
            time.sleep(0.01)
        self.client = redis.Redis(unix_socket_path=str(self.sock))
        self.version = self.client.info("server")["redis_version"]

    def stats(self) -> dict[str, Any]:
        cmds = self.client.info("commandstats")
        cpu = self.client.info("cpu")
        return {"calls": {k.removeprefix("cmdstat_"): v["calls"] for k, v in cmds.items()},
                "usec": {k.removeprefix("cmdstat_"): v["usec"] for k, v in cmds.items()},
                "cpu": cpu["used_cpu_user"] + cpu["used_cpu_sys"], "t": time.monotonic()}

    def close(self) -> None:
        self.client.close()
        self.proc.terminate()
        self.proc.wait(10)
        shutil.rmtree(self.dir, ignore_errors=True)


def lua_only() -> set[str]:
    """Commands that only the scripts run (redis.call inside the Lua): not round trips."""
    text = "\n".join(v for k, v in vars(queue_lua).items() if k.isupper() and isinstance(v, str)) + BASELINE_LUA
    return {c.lower() for c in re.findall(r"redis\.p?call\(['\"]([A-Za-z]+)['\"]", text)}


def _delta(a: dict[str, int], b: dict[str, int]) -> dict[str, int]:
    return {k: b.get(k, 0) - a.get(k, 0) for k in set(a) | set(b) if b.get(k, 0) != a.get(k, 0)}


def summarise(kind: str, rate: float, seconds: float, results: list[dict[str, Any]], calls0: list[dict[str, int]],
              s0: dict[str, Any], s1: dict[str, Any]) -> dict[str, Any]:
    """One phase's row: the workers' samples pooled, Redis's counters' deltas over the phase."""
    admit = [x for r in results for x in r["admit"]]
    settle = [x for r in results for x in r["settle"]]
    done = len(admit)
    client: Counter[str] = Counter()
    for before, r in zip(calls0, results, strict=True):
        client.update(_delta(before, r["calls"]))
    server = _delta(s0["calls"], s1["calls"])
    server.pop("info", None)    # the parent's own INFO calls
    window = s1["t"] - s0["t"]
    scripts = server.get("evalsha", 0) + server.get("eval", 0)
    background = sum(client[n] for n in BACKGROUND)
    per = (lambda n: n / done) if done else (lambda n: float("nan"))
    errors: Counter[str] = Counter()
    for r in results:
        errors.update(r["errors"])
    return {
        "phase": kind, "rate": rate, "seconds": seconds, "issued": sum(r["issued"] for r in results),
        "done": done, "achieved_per_s": done / max(max(r["wall"] for r in results), 1e-9),
        "errors": dict(errors), "queued": sum(r["queued"] for r in results),
        "admit": dist_stats(admit), "settle": dist_stats(settle),
        "lag": dist_stats([x for r in results for x in r["lag"]]),
        # A round trip is a command a client sent: every command but those only the Lua runs.
        "round_trips_per_request": per(sum(n for c, n in server.items() if c not in lua_only()) - background),
        "script_calls_per_request": per(scripts - background),
        "client_scripts_per_request": per(sum(n for c, n in client.items() if c not in BACKGROUND)),
        "commands_per_request": per(sum(server.values())),   # all of them: inside Lua and background too
        "publish_per_request": per(server.get("publish", 0)),
        "background_calls_per_s": background / window, "background_calls": {n: client[n] for n in BACKGROUND},
        "script_failures": dict(sum((Counter(r["failed"]) for r in results), Counter())),
        "anomalies": [a for r in results for a in r["anomalies"]],
        "redis_cpu_us_per_request": per((s1["cpu"] - s0["cpu"]) * 1e6),
        "redis_script_us_per_request": per(_delta(s0["usec"], s1["usec"]).get("evalsha", 0)),
        "client_cpu_us_per_request": per(sum(r["cpu"] for r in results) * 1e6),
        "server_calls": server, "client_calls": dict(client),
    }


class Pool:
    """The worker processes and the commands the parent sends them."""

    def __init__(self, n: int, cfg: dict[str, Any], cpus: list[int | None]) -> None:
        ctx = mp.get_context("spawn")
        self.conns, self.procs = [], []
        for i in range(n):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=worker_main, args=(i, child, cfg, cpus[i]), daemon=True)
            p.start()
            self.conns.append(parent)
            self.procs.append(p)
        self.calls: list[dict[str, int]] = [{} for _ in range(n)]
        for reply in self._gather():
            assert reply.get("ready"), reply

    def _gather(self) -> list[dict[str, Any]]:
        replies = [c.recv() for c in self.conns]
        fatal = [r["fatal"] for r in replies if "fatal" in r]
        if fatal:
            raise RuntimeError(f"a worker failed: {fatal[0]}")
        return replies

    def phase(self, kind: str, rate: float, seconds: float, tag: str) -> list[dict[str, Any]]:
        start_at = time.time() + 0.2
        for c in self.conns:
            c.send({"kind": kind, "rate": rate / len(self.conns), "seconds": seconds, "start_at": start_at,
                    "tag": tag})
        replies = self._gather()
        self.calls = [r["calls"] for r in replies]
        return replies

    def close(self) -> None:
        for c in self.conns:
            c.send(None)
        for p in self.procs:
            p.join(15)


def measure(pool: Pool, server: RedisServer, args: argparse.Namespace) -> list[dict[str, Any]]:
    rows = []
    for rate in args.rates:
        for kind in ("baseline", "admission"):
            if args.warmup > 0:
                pool.phase(kind, rate, args.warmup, f"warm{rate:g}")
            calls0, s0 = pool.calls, server.stats()
            results = pool.phase(kind, rate, args.seconds, f"run{rate:g}")
            rows.append(summarise(kind, rate, args.seconds, results, calls0, s0, server.stats()))
            print(f"bench: {rate:g}/s {kind}: {rows[-1]['done']} requests", file=sys.stderr)
        base, adm = rows[-2], rows[-1]
        for what in ("admit", "settle"):
            adm[f"{what}_ratio"] = {p: _ratio(_at(adm[what], p), _at(base["admit"], p)) for p in ("p50", "p99")}
        # The router-side cost: the client's CPU per admitted request against a bare EVALSHA's.
        adm["client_cpu_ratio"] = _ratio(adm["client_cpu_us_per_request"], base["client_cpu_us_per_request"])
    return rows


def _at(stats: dict[str, float] | None, key: str) -> float | None:
    return stats[key] if stats else None


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v * 1000:.2f}"


def _x(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}x"


def format_table(rows: list[dict[str, Any]]) -> str:
    header = ["rate/s", "phase", "achieved/s", "done", "err", "queued", "lag p99", "p50 ms", "p90", "p99",
              "x p50", "x p99", "settle p50", "p99", "x p50", "x p99", "RT/req", "scripts/req", "cmds/req",
              "bg calls/s", "redis us/req", "client us/req", "x client"]
    body = []
    for r in rows:
        a, s = r["admit"], r["settle"]
        ar, sr = r.get("admit_ratio", {}), r.get("settle_ratio", {})
        body.append([f"{r['rate']:g}", r["phase"], f"{r['achieved_per_s']:.0f}", str(r["done"]),
                     str(sum(r["errors"].values()) + sum(r["script_failures"].values())), str(r["queued"]),
                     _ms(_at(r["lag"], "p99")),
                     _ms(_at(a, "p50")), _ms(_at(a, "p90")), _ms(_at(a, "p99")),
                     _x(ar.get("p50", 1.0)), _x(ar.get("p99", 1.0)),
                     _ms(_at(s, "p50")), _ms(_at(s, "p99")), _x(sr.get("p50")), _x(sr.get("p99")),
                     f"{r['round_trips_per_request']:.3f}", f"{r['client_scripts_per_request']:.3f}",
                     f"{r['commands_per_request']:.1f}", f"{r['background_calls_per_s']:.1f}",
                     f"{r['redis_cpu_us_per_request']:.0f}", f"{r['client_cpu_us_per_request']:.0f}",
                     _x(r.get("client_cpu_ratio", 1.0))])
    return _table(header, body, left=2)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rates", default="1000,5000", help="total arrival rates, requests/s, comma-separated")
    ap.add_argument("--workers", type=int, default=2, help="router processes (one Admission each)")
    ap.add_argument("--seconds", type=float, default=10.0, help="measured seconds per phase and rate")
    ap.add_argument("--warmup", type=float, default=1.0, help="unrecorded seconds before each phase")
    ap.add_argument("--service-ms", type=float, default=20.0, help="how long a granted request holds its lease")
    ap.add_argument("--capacity", type=int, default=0,
                    help="the pool's capacity in requests (0 = 1,000,000: every request granted at once)")
    ap.add_argument("--tenants", type=int, default=8, help="tenants the requests are spread over")
    ap.add_argument("--cost", type=int, default=600, help="each request's estimate (prompt + max_tokens)")
    ap.add_argument("--max-connections", type=int, default=8, help="Redis connections per worker (the router's "
                                                                   "default)")
    ap.add_argument("--lease-ttl", type=float, default=15.0, help="lease TTL (heartbeat = a third of it)")
    ap.add_argument("--reap-interval", type=float, default=0.25, help="seconds between each worker's REAP calls")
    ap.add_argument("--appendonly", choices=["yes", "no"], default="yes", help="redis-server --appendonly")
    ap.add_argument("--appendfsync", choices=["always", "everysec", "no"], default="everysec")
    ap.add_argument("--redis-client", choices=["lean", "redis-py"], default="lean",
                    help="the client of the admission's calls (and of the baseline's), as the router's --redis-client")
    ap.add_argument("--cpu-list", default="", help="CPUs: the first for redis-server, then one per worker")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--json", default="", metavar="PATH", help="write every figure here as JSON")
    args = ap.parse_args(argv)
    args.rates = [float(r) for r in args.rates.split(",") if r.strip()]
    if not args.rates or min(args.rates) <= 0 or args.workers < 1 or args.seconds <= 0:
        ap.error("--rates must be positive numbers, --workers >= 1, --seconds > 0")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    cpus = cpu_list(args.cpu_list)
    if cpus:
        os.sched_setaffinity(0, set(cpus))
    worker_cpus = [cpus[1 + i % max(1, len(cpus) - 1)] if len(cpus) > 1 else None for i in range(args.workers)]
    server = RedisServer(args.appendonly, args.appendfsync, cpus[0] if cpus else None)
    cfg = {"url": server.url, "capacity": args.capacity, "max_connections": args.max_connections,
           "redis_client": args.redis_client,
           "lease_ttl": args.lease_ttl, "reap_interval": args.reap_interval, "tenants": args.tenants,
           "cost": args.cost, "service_ms": args.service_ms, "seed": args.seed}
    try:
        pool = Pool(args.workers, cfg, worker_cpus)
        try:
            rows = measure(pool, server, args)
        finally:
            pool.close()
    finally:
        server.close()
    print(f"admission cost: redis {server.version}, appendonly {args.appendonly} ({args.appendfsync}), "
          f"{args.workers} workers, {args.seconds:g} s per phase, service {args.service_ms:g} ms, capacity "
          f"{args.capacity or 'unbounded'}, cpus {args.cpu_list or 'unpinned'} (os.cpu_count {os.cpu_count()})")
    print(format_table(rows))
    print("latencies in ms; x = ratio to the baseline's (bare EVALSHA) same percentile; RT/req = Redis round "
          "trips per request from INFO commandstats (background excluded); bg = heartbeat + reap calls; err = "
          "refusals, exceptions, script failures, settles refused and leases a heartbeat found lost; x client = "
          "client CPU per request over the baseline's")
    for r in rows:
        if r["script_failures"]:
            print(f"{r['rate']:g}/s {r['phase']}: script failures and anomalies {r['script_failures']} "
                  f"(first: {json.dumps(r['anomalies'][:2])})")
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps({"args": {k: v for k, v in vars(args).items()},
                                                       "redis": server.version, "rows": rows}, indent=2) + "\n")
    # A heartbeat that calls a lease lost which this process had just settled is a known race (reported,
    # not failed); every other error, script failure or refused settle fails the run.
    bad = [r for r in rows if r["errors"] or set(r["script_failures"]) - {"beat_lease_lost"}]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
