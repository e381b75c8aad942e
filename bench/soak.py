"""Soak: a `tokenrelay up --engine sim` mesh of real processes under N concurrent streams for a while.

Checks (issue 15, "Proof"): no request fails; the RSS of every service (router, tokenizer, engine,
Redis) grows less than `--max-growth` (5%) between the end of the warm-up and the end; file
descriptors of every service and Redis's connected clients stay flat (at most
max(`--fd-slack`, 5%) more at the end than at the end of the warm-up); no service restarts.
Exit status 0 when all hold, 1 on a breach (each printed), 2 when the mesh does not start.

The load is closed loop: `--streams` streams kept open at once, spread over `--clients` client
processes (this script run with `--worker`), each stream a Generate call of `--max-tokens`
tokens (ignore_eos) of a short unique prompt, followed at once by the next. The sim engine's
decode step is slowed (`--step-time`) so that the token rate stays within what this machine's
cores carry: the soak looks for leaks and for errors, not for throughput.

Every `--sample-every` seconds it prints one row per service (RSS MB, fds, threads) and
Redis's clients, then a summary: the figures at the end of the warm-up and at the end, their
ratio, and the requests done and failed (by reason).

    python bench/soak.py --streams 2000 --duration 300 --warmup 60      # the issue-15 soak
    python bench/soak.py --streams 200 --duration 30 --warmup 10        # a quick run
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import json
import pathlib
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any

REPO = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


# ------------------------------------------------------------------------------------------ worker
async def _worker(address: str, api_key: str, streams: int, duration: float, max_tokens: int,
                  index: int, min_delta_tokens: int, ramp: float) -> None:
    """Keep `streams` Generate streams open until `duration` has passed; print counts as JSON lines."""
    from services.client import Accepted, Client, Finished, TextDelta
    from services.errors import TokenrelayError

    counts: collections.Counter[str] = collections.Counter()
    errors: list[str] = []   # the first few failures, with when (seconds into the run) and why
    tokens = 0
    begin = time.monotonic()
    end = begin + duration
    async with Client(address, api_key) as client:
        async def stream_loop(slot: int) -> None:
            nonlocal tokens
            n = 0
            await asyncio.sleep(ramp * slot / streams)   # the first wave's opens spread over the ramp
            rng = random.Random(index * 100_003 + slot)
            while time.monotonic() < end:
                n += 1
                prompt = f"soak worker {index} slot {slot} request {n}: tell me a story."
                finished = False
                # Lengths spread over [max/2, 3 max/2] so the streams do not end (and start) in
                # lockstep, as no production load does.
                want = rng.randint(max(1, max_tokens // 2), max(1, max_tokens * 3 // 2))
                try:
                    async for event in client.stream(prompt, max_tokens=want, ignore_eos=True,
                                                     timeout=120.0, min_delta_tokens=min_delta_tokens):
                        if isinstance(event, TextDelta):
                            tokens += 1
                        elif isinstance(event, Finished):
                            finished = event.completion_tokens == want
                        elif not isinstance(event, Accepted):
                            pass
                    counts["ok" if finished else "incomplete"] += 1
                except TokenrelayError as exc:
                    counts[f"error:{exc.reason}"] += 1
                    if len(errors) < 20:
                        errors.append(f"{time.monotonic() - begin:.1f}s {exc.reason}: {exc}")
                    await asyncio.sleep(0.5)
                except Exception as exc:  # noqa: BLE001 - anything else is a finding too: count it, go on
                    counts[f"error:{type(exc).__name__}"] += 1
                    await asyncio.sleep(0.5)

        async def report() -> None:
            while True:
                print(json.dumps({"worker": index, "counts": counts, "deltas": tokens, "errors": errors}), flush=True)
                await asyncio.sleep(2.0)

        reporter = asyncio.create_task(report())
        await asyncio.gather(*(stream_loop(i) for i in range(streams)))
        reporter.cancel()
    print(json.dumps({"worker": index, "counts": counts, "deltas": tokens, "errors": errors, "done": True}),
          flush=True)


# ------------------------------------------------------------------------------------------ sampling
@dataclass
class Sample:
    t: float
    rss: dict[str, float]                 # MB per service
    fds: dict[str, int]
    threads: dict[str, int]
    cpu: dict[str, float]                 # CPU seconds (user + system) so far
    redis_clients: int
    restarts: dict[str, int]


@dataclass
class Workers:
    procs: list[subprocess.Popen[str]]
    latest: dict[int, dict[str, Any]] = field(default_factory=dict)

    def poll(self) -> None:
        for proc in self.procs:
            assert proc.stdout is not None
            while True:
                line = _read_line(proc)
                if line is None:
                    break
                with contextlib.suppress(ValueError):
                    data = json.loads(line)
                    self.latest[int(data["worker"])] = data

    def totals(self) -> tuple[collections.Counter[str], int]:
        counts: collections.Counter[str] = collections.Counter()
        deltas = 0
        for data in self.latest.values():
            counts.update(data["counts"])
            deltas += int(data["deltas"])
        return counts, deltas


def _read_line(proc: subprocess.Popen[str]) -> str | None:
    import select

    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], 0)
    if not ready:
        return None
    line = proc.stdout.readline()
    return line or None


def _services(state: dict[str, Any]) -> dict[str, int]:
    """name -> pid of every service process the launcher supervises, plus Redis."""
    out: dict[str, int] = {}
    for name, info in (state.get("services") or {}).items():
        if info.get("pid"):
            out[name] = int(info["pid"])
    return out


def _sample(state_file: pathlib.Path, redis_client: Any, redis_pid: int | None, t: float) -> Sample:
    import psutil

    state = json.loads(state_file.read_text())
    pids = _services(state)
    if redis_pid:
        pids.setdefault("redis", redis_pid)
    rss, fds, threads, cpu = {}, {}, {}, {}
    for name, pid in sorted(pids.items()):
        try:
            proc = psutil.Process(pid)
            with proc.oneshot():
                rss[name] = proc.memory_info().rss / 2**20
                fds[name] = proc.num_fds()
                threads[name] = proc.num_threads()
                times = proc.cpu_times()
                cpu[name] = times.user + times.system
        except psutil.Error:
            rss[name], fds[name], threads[name], cpu[name] = float("nan"), -1, -1, 0.0
    clients = int(redis_client.info("clients")["connected_clients"]) if redis_client is not None else -1
    restarts = {n: int(i.get("restarts", 0)) for n, i in (state.get("services") or {}).items()}
    return Sample(t, rss, fds, threads, cpu, clients, restarts)


def _fallbacks(state: dict[str, Any]) -> dict[str, float]:
    """The routers' `tokenrelay_router_cluster_fallbacks_total` by op: cluster operations answered
    from a router's own view because Redis failed or was slow (not a client error, but a finding)."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = collections.defaultdict(float)
    for name, url in (state.get("metrics") or {}).items():
        if not name.startswith("router"):
            continue
        url = url if url.endswith("/metrics") else url.rstrip("/") + "/metrics"
        try:
            text = urllib.request.urlopen(url, timeout=5).read().decode()
        except OSError:
            continue
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                if s.name == "tokenrelay_router_cluster_fallbacks_total":
                    out[s.labels.get("op", "")] += s.value
    return dict(out)


def _row(sample: Sample, prev: Sample | None, counts: collections.Counter[str], deltas: int) -> str:
    def cpu(name: str) -> float:
        if prev is None or name not in prev.cpu or sample.t <= prev.t:
            return 0.0
        return 100 * (sample.cpu[name] - prev.cpu[name]) / (sample.t - prev.t)
    parts = [f"{name} {sample.rss[name]:6.1f}MB {sample.fds[name]:3d}fd {cpu(name):3.0f}%"
             for name in sample.rss]
    done = sum(v for k, v in counts.items() if k == "ok")
    bad = sum(v for k, v in counts.items() if k != "ok")
    return (f"{sample.t:6.0f}s  " + " | ".join(parts) + f" | redis clients {sample.redis_clients}"
            f" | done {done} failed {bad} deltas {deltas}")


def _verdict(samples: list[Sample], warmup: float, max_growth: float, fd_slack: int) -> tuple[list[str], list[str]]:
    """(table lines, breaches): the figures at the end of the warm-up (mean of the 3 samples
    closest after it) and at the end (mean of the last 3), per service."""
    after = [s for s in samples if s.t >= warmup]
    if len(after) < 6:
        return [], [f"too few samples after the warm-up ({len(after)}): run longer"]
    base, end = after[:3], after[-3:]
    lines = [f"{'service':<14} {'RSS MB warm':>12} {'RSS MB end':>11} {'ratio':>7} {'max MB':>8} "
             f"{'fds warm':>9} {'fds end':>8} {'fds max':>8}"]
    breaches = []
    for name in samples[-1].rss:
        if any(name not in s.rss for s in base + end):
            breaches.append(f"{name}: not sampled throughout (restarted?)")
            continue
        r0 = statistics.fmean(s.rss[name] for s in base)
        r1 = statistics.fmean(s.rss[name] for s in end)
        f0, f1 = max(s.fds[name] for s in base), max(s.fds[name] for s in end)
        peak = max(s.rss[name] for s in after)
        fmax = max(s.fds[name] for s in after)
        lines.append(f"{name:<14} {r0:12.1f} {r1:11.1f} {r1 / r0:7.3f} {peak:8.1f} {f0:9d} {f1:8d} {fmax:8d}")
        if r1 > r0 * (1 + max_growth):
            breaches.append(f"{name}: RSS grew {100 * (r1 / r0 - 1):.1f}% ({r0:.1f} -> {r1:.1f} MB)")
        if f1 > f0 + max(fd_slack, 0.05 * f0):
            breaches.append(f"{name}: file descriptors grew {f0} -> {f1}")
    c0, c1 = max(s.redis_clients for s in base), max(s.redis_clients for s in end)
    lines.append(f"{'redis clients':<14} {c0:>12} {c1:>11}")
    if c1 > c0 + max(fd_slack, 0.05 * c0):
        breaches.append(f"redis: connected clients grew {c0} -> {c1}")
    restarted = {n: r for n, r in samples[-1].restarts.items() if r}
    if restarted:
        breaches.append(f"services restarted: {restarted}")
    return lines, breaches


# ------------------------------------------------------------------------------------------ main
def _start_mesh(args: argparse.Namespace, tmp: pathlib.Path) -> tuple[subprocess.Popen[bytes], dict[str, Any]]:
    state_file = tmp / "state.json"
    engine_args = [f"--sim-max-batch-size={max(256, args.streams)}", f"--max-queued={max(1024, args.streams)}",
                   f"--sim-decode-step-time={args.step_time}", "--sim-decode-time-per-seq=0",
                   "--sim-decode-time-per-context-token=0", f"--sim-num-blocks={args.sim_blocks}"]
    argv = [sys.executable, "-m", "tokenrelay_tools.cli.main", "up", "--engine", "sim", "--port", "0",
            "--state-file", str(state_file), "--run-dir", str(tmp / "run"),
            "--max-in-flight", str(2 * args.streams), "--tokenizers", str(args.tokenizers),
            "--routers", str(args.routers), "--engines", str(args.engines),
            *(f"--engine-arg={a}" for a in engine_args), *(f"--router-arg={a}" for a in args.router_arg)]
    log = open(tmp / "up.log", "wb")  # lives as long as the mesh
    proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
    deadline = time.monotonic() + 240
    while not state_file.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            print(f"soak: the mesh did not start:\n{(tmp / 'up.log').read_text()[-3000:]}", file=sys.stderr)
            sys.exit(2)
        time.sleep(0.1)
    return proc, json.loads(state_file.read_text())


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--streams", type=int, default=2000, help="concurrent streams")
    p.add_argument("--duration", type=float, default=300.0, help="seconds of load (warm-up included)")
    p.add_argument("--warmup", type=float, default=60.0, help="seconds before the baseline sample")
    p.add_argument("--ramp", type=float, default=20.0, help="seconds over which the streams are first opened "
                   "(a router refuses calls while its loop lags; a burst of 2,000 opens at once is a spike test)")
    p.add_argument("--sample-every", type=float, default=5.0, help="seconds between samples")
    p.add_argument("--clients", type=int, default=2, help="client processes the streams are spread over")
    p.add_argument("--max-tokens", type=int, default=64, help="mean tokens per request (each draws from [half, 1.5x])")
    p.add_argument("--min-delta-tokens", type=int, default=0, help="coarser deltas (0: one per token batch)")
    p.add_argument("--step-time", type=float, default=0.25, help="the sim engine's seconds per decode step")
    p.add_argument("--tokenizers", type=int, default=1)
    p.add_argument("--routers", type=int, default=1)
    p.add_argument("--engines", type=int, default=1)
    p.add_argument("--router-arg", action="append", default=[], help="extra router flag (repeatable)")
    p.add_argument("--sim-blocks", type=int, default=8192,
                   help="the sim engine's KV blocks: a bounded prefix cache that fills during the warm-up "
                        "(with the default 25,000 it was still filling at the end of a 5-minute soak)")
    p.add_argument("--max-growth", type=float, default=0.05, help="largest RSS growth allowed (0.05 = 5%%)")
    p.add_argument("--fd-slack", type=int, default=4, help="fds (and Redis clients) a service may gain")
    p.add_argument("--json-out", type=pathlib.Path, help="write samples and verdict here")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--address", help=argparse.SUPPRESS)
    p.add_argument("--api-key", help=argparse.SUPPRESS)
    p.add_argument("--index", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        asyncio.run(_worker(args.address, args.api_key, args.streams, args.duration, args.max_tokens, args.index,
                            args.min_delta_tokens, args.ramp))
        return 0

    import redis

    tmp = pathlib.Path(tempfile.mkdtemp(prefix="tokenrelay-soak-"))
    mesh, state = _start_mesh(args, tmp)
    state_file = tmp / "state.json"
    rc = 1
    workers: Workers | None = None
    try:
        redis_client = redis.Redis.from_url(state["redis_url"]) if state.get("redis_url") else None
        redis_pid = int(redis_client.info("server")["process_id"]) if redis_client is not None else None
        print(f"soak: mesh up ({', '.join(sorted(_services(state)))}, redis pid {redis_pid}); "
              f"{args.streams} streams over {args.clients} clients for {args.duration:.0f}s, "
              f"warm-up {args.warmup:.0f}s; run dir {tmp}", flush=True)
        per = [args.streams // args.clients + (i < args.streams % args.clients) for i in range(args.clients)]
        procs = [subprocess.Popen(
            [sys.executable, __file__, "--worker", "--address", state["router"], "--api-key", state["api_key"],
             "--streams", str(n), "--duration", str(args.duration), "--max-tokens", str(args.max_tokens),
             "--index", str(i), "--min-delta-tokens", str(args.min_delta_tokens), "--ramp", str(args.ramp)],
            stdout=subprocess.PIPE, text=True, cwd=REPO) for i, n in enumerate(per)]
        workers = Workers(procs)
        start = time.monotonic()
        samples: list[Sample] = []
        while any(w.poll() is None for w in procs):
            t = time.monotonic() - start
            workers.poll()
            sample = _sample(state_file, redis_client, redis_pid, t)
            samples.append(sample)
            counts, deltas = workers.totals()
            print(_row(sample, samples[-2] if len(samples) > 1 else None, counts, deltas), flush=True)
            time.sleep(max(0.0, args.sample_every - (time.monotonic() - start - t)))
        workers.poll()
        counts, deltas = workers.totals()
        lines, breaches = _verdict([s for s in samples if s.t <= args.duration], args.warmup,
                                   args.max_growth, args.fd_slack)
        failed = {k: v for k, v in counts.items() if k != "ok"}
        if failed:
            breaches.append(f"requests failed: {failed}")
            for data in workers.latest.values():
                lines.extend(f"  client {data['worker']}: {e}" for e in data.get("errors", []))
        if any(w.returncode for w in procs):
            breaches.append(f"client exit statuses: {[w.returncode for w in procs]}")
        fallbacks = _fallbacks(json.loads(state_file.read_text()))
        lines.append(f"router cluster fallbacks to its own view (Redis failed or slow): {fallbacks or 'none'}")
        print("\n".join(["", *lines, "", f"requests ok {counts.get('ok', 0)}, failed {sum(failed.values())}; "
                         f"text deltas {deltas}; wall {time.monotonic() - start:.0f}s"]))
        print("\n".join(f"BREACH: {b}" for b in breaches) if breaches else "soak: no breach")
        if args.json_out:
            args.json_out.write_text(json.dumps({"args": {k: v for k, v in vars(args).items() if k != "json_out"},
                                                 "samples": [s.__dict__ for s in samples], "counts": counts,
                                                 "fallbacks": fallbacks, "breaches": breaches},
                                                indent=1, default=str))
        rc = 1 if breaches else 0
    finally:
        if workers is not None:
            for w in workers.procs:
                if w.poll() is None:
                    w.kill()
        mesh.send_signal(signal.SIGINT)
        try:
            mesh.wait(60)
        except subprocess.TimeoutExpired:
            mesh.kill()
    return rc


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        sys.exit(130)
