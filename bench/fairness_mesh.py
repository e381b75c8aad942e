"""The mesh bench_fairness.py measures, as real processes: redis-server, one tokenizer_svc (the
byte-level tokenizer of `up --engine sim`), N `sim` engines, N router processes sharing one
admission pool, with one tenants file for every scenario; pinned per role like bench_relay.py."""

from __future__ import annotations

import argparse
import hashlib
import itertools
import pathlib
import shutil
import sys
import time
from dataclasses import dataclass
from typing import Any

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

from bench_relay import Procs, cpu_list, cpu_share
from fairness_load import api_key

from services.redis_client import unix_socket_listening

POOL = "fair"
VOCAB = 128      # ids below 128: one character per token, so a delta's length is its token count


@dataclass
class Roles:
    routers: list[int]
    redis: list[int]
    tokenizer: list[int]
    engines: list[int]
    clients: list[int]


def roles(args: argparse.Namespace) -> Roles:
    """CPUs per role: --cpu-list split in order (routers one each, Redis, the tokenizer, engines one
    each, the rest for the load processes), then any explicit --ROLE-cpus over it."""
    cpus = cpu_list(args.cpu_list)
    r = Roles([], [], [], [], [])
    if cpus:
        it = iter(cpus)
        def take(n: int) -> list[int]:
            return list(itertools.islice(it, n))
        r = Roles(take(args.routers), take(1), take(1), take(args.engines), list(it))
        r.clients = r.clients or cpus[-1:]
    for role in ("routers", "redis", "tokenizer", "engines", "clients"):
        explicit = getattr(args, f"{role.rstrip('s')}_cpus", "")
        if explicit:
            setattr(r, role, cpu_list(explicit))
    return r


def tenants_yaml(tenants: list[dict[str, Any]]) -> str:
    lines = ["tenants:"]
    for t in tenants:
        lines.append(f"  - name: {t['name']}")
        lines.append(f"    api_key_sha256: {hashlib.sha256(api_key(t['name']).encode()).hexdigest()}")
        for key, value in t.items():
            if key != "name":
                lines.append(f"    {key}: {value}")
    return "\n".join(lines) + "\n"


def _cpu_s(pid: int) -> float:
    import psutil

    t = psutil.Process(pid).cpu_times()
    return float(t.user + t.system)


def _histogram(samples: list[Any]) -> tuple[float, float, dict[str, float]]:
    """A histogram's count, sum and buckets by bound (each counts what is at or below it), summed
    over its other labels."""
    count = total = 0.0
    buckets: dict[str, float] = {}
    for x in samples:
        if x.name.endswith("_count"):
            count += x.value
        elif x.name.endswith("_sum"):
            total += x.value
        elif x.name.endswith("_bucket"):
            buckets[x.labels["le"]] = buckets.get(x.labels["le"], 0.0) + x.value
    return count, total, buckets


class Mesh:
    """The running mesh: its router addresses, the pool's capacity, and Redis for drain checks."""

    def __init__(self, args: argparse.Namespace, work: pathlib.Path, tenants: list[dict[str, Any]]) -> None:
        from tokenrelay_tools.cli.byte_tokenizer import ensure_byte_tokenizer

        self.procs = Procs(work)
        self.work = work
        self.cpus = roles(args)
        tokenizer = ensure_byte_tokenizer(work / "cache")
        sock = work / "redis.sock"
        self.redis_url = f"unix://{sock}"
        self.procs.spawn("redis", [shutil.which("redis-server") or "redis-server", "--port", "0", "--unixsocket",
                                   str(sock), "--save", "", "--appendonly", "no", "--dir", str(work)],
                         self.cpus.redis)
        tok = self.procs.service("tokenizer", "tokenizer_svc", ["--tokenizer", str(tokenizer)], self.cpus.tokenizer)
        sim = ["--backend", "sim", "--max-queued", "100000", "--sim-vocab-size", "259",
               "--sim-sample-ids-below", str(VOCAB),
               "--sim-profile", args.profile, "--sim-max-batch-size", str(args.batch),
               "--sim-time-scale", str(args.time_scale), *args.engine_arg]
        engs = [self.procs.service(f"engine{i}", "engine_svc", sim, cpu_share(self.cpus.engines, i, args.engines))
                for i in range(args.engines)]
        (work / "tenants.yaml").write_text(tenants_yaml(tenants))
        deadline = time.monotonic() + 20
        while not unix_socket_listening(sock):
            if time.monotonic() > deadline:
                raise SystemExit("redis-server did not start")
            time.sleep(0.02)
        tok_addr = self.procs.wait_port("tokenizer", tok)
        eng_addrs = [self.procs.wait_port(f"engine{i}", p) for i, p in enumerate(engs)]
        ports = [self.procs.service(f"router{i}", "router_svc", [
            "--tokenizers", tok_addr, "--engines", ",".join(eng_addrs), "--redis-url", self.redis_url,
            "--tenants-file", str(work / "tenants.yaml"), "--pool", POOL, "--router-id", f"router{i}",
            "--tokenizer-files", str(tokenizer),   # for --router-arg=--detokenize=local / --tokenize-local-bytes
            "--engine-poll-interval", "0.2", "--queue-poll", "0.5", *args.router_arg],
            cpu_share(self.cpus.routers, i, args.routers)) for i in range(args.routers)]
        self.routers = [self.procs.wait_port(f"router{i}", p) for i, p in enumerate(ports)]
        self.capacity = args.batch * args.engines

    def router_stats(self) -> dict[str, float]:
        """The routers' own counters, summed: CPU seconds, event-loop lag samples (10 ms timer) and
        late ones, cyclic-GC collections and those over 10 ms, refusals (handler to status) and those
        over 10 ms. Two snapshots around a phase say
        whether a latency tail is the routers' (a busy or stalled loop) or the clients'."""
        import urllib.request

        from prometheus_client.parser import text_string_to_metric_families

        out = {"tokenizer_cpu_s": _cpu_s(self.procs.procs["tokenizer"].pid),
               "redis_cpu_s": _cpu_s(self.procs.procs["redis"].pid),
               "cpu_s": 0.0, "lag_samples": 0.0, "lag_over_10ms": 0.0, "lag_over_50ms": 0.0, "gc": 0.0,
               "gc_over_10ms": 0.0, "gc_s": 0.0, "local_refusals": 0.0, "enqueue_calls": 0.0,
               "refusals": 0.0, "refusals_over_10ms": 0.0}
        for i in range(len(self.routers)):
            out["cpu_s"] += _cpu_s(self.procs.procs[f"router{i}"].pid)
            port = (self.work / f"router{i}.metrics-port").read_text().strip()
            text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
            for family in text_string_to_metric_families(text):
                if family.name == "tokenrelay_router_loop_lag_seconds":
                    count, _, le = _histogram(family.samples)
                    out["lag_samples"] += count
                    out["lag_over_10ms"] += count - le["0.01"]
                    out["lag_over_50ms"] += count - le["0.05"]
                elif family.name == "tokenrelay_gc_pause_seconds":
                    count, seconds, le = _histogram(family.samples)
                    out["gc"] += count
                    out["gc_over_10ms"] += count - le["0.01"]
                    out["gc_s"] += seconds
                elif family.name == "tokenrelay_router_refusal_seconds":
                    count, _, le = _histogram(family.samples)
                    out["refusals"] += count
                    out["refusals_over_10ms"] += count - le.get("0.01", 0.0)
                elif family.name == "tokenrelay_router_admission_local_refusals":
                    out["local_refusals"] += sum(x.value for x in family.samples if x.name.endswith("_total"))
                elif family.name == "tokenrelay_router_redis_seconds":
                    out["enqueue_calls"] += sum(x.value for x in family.samples
                                                if x.name.endswith("_count") and x.labels.get("op") == "enqueue")
        return out

    def _redis(self) -> Any:
        import redis

        return redis.Redis.from_url(self.redis_url)

    def pool_state(self) -> dict[str, Any]:
        """In flight, queued, the capacity the routers last stored, and the mean lease seconds."""
        r = self._redis()
        try:
            p = f"tq:{{{POOL}}}:"
            queued = sum(int(r.zcard(k)) for k in r.scan_iter(match=p + "cq:*"))
            svc = r.hget(p + "stats", "svc")
            cap = r.get(p + "cap")
            return {"in_flight": int(r.zcard(p + "leases")), "queued": queued,
                    # stored as "CAP:HEADROOM:HOLD_MS" (slots dispatched freely, those for tenants under share)
                    "capacity": sum(int(x or 0) for x in cap.decode().split(":")[:2]) if cap else None,
                    "lease_s": int(svc) / 1000 if svc else None}
        finally:
            r.close()

    def drain(self, timeout: float = 30.0) -> None:
        """Wait until the pool holds no lease and no queued request (the previous phase is gone)."""
        deadline = time.monotonic() + timeout
        while True:
            state = self.pool_state()
            if state["in_flight"] == 0 and state["queued"] == 0:
                return
            if time.monotonic() > deadline:
                print(f"# warning: pool not drained after {timeout}s: {state}", file=sys.stderr)
                return
            time.sleep(0.1)

    def stop(self) -> None:
        self.procs.stop()
