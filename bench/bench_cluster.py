"""Cost of router_svc/cluster.py on the request path: a request-id claim + release through Redis.

Starts a private redis-server on a unix socket and one `RedisCluster` member, then measures
(1) a lone claim's latency (nothing else in flight: one round trip plus the pipeline's task hop),
and (2) claims + releases with ``--in-flight`` requests at once: rate, CPU-microseconds of this
process per claim+release (the router's cost), and operations per Redis round trip (the
coalescing pipeline); the same loop over the in-process `LocalRequestRegistry` is the baseline.

    python bench/bench_cluster.py --in-flight 256 --per-worker 80
"""

from __future__ import annotations

import argparse
import asyncio
import pathlib
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Any

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

from router_svc.cluster import RedisCluster
from router_svc.request import LocalRequestRegistry
from services.redis_client import unix_socket_listening


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


async def _loop(registry: Any, in_flight: int, per_worker: int) -> tuple[float, float]:
    async def worker(w: int) -> None:
        for j in range(per_worker):
            rid = f"w{w}-{j}"
            assert await registry.claim("t", rid)
            await asyncio.sleep(0)
            await registry.release("t", rid)
    c0, t0 = _cpu(), time.perf_counter()
    await asyncio.gather(*(worker(w) for w in range(in_flight)))
    return time.perf_counter() - t0, _cpu() - c0


def _redis_server(tmp: pathlib.Path, sock: pathlib.Path) -> subprocess.Popen[bytes]:
    return subprocess.Popen([shutil.which("redis-server") or "redis-server", "--port", "0", "--unixsocket",
                             str(sock), "--save", "", "--appendonly", "no", "--dir", str(tmp)],
                            stdout=subprocess.DEVNULL)


async def main(args: argparse.Namespace) -> None:
    tmp = pathlib.Path(tempfile.mkdtemp())
    sock = tmp / "redis.sock"
    server = _redis_server(tmp, sock)
    try:
        while not unix_socket_listening(sock):
            await asyncio.sleep(0.01)
        member = RedisCluster(f"unix://{sock}", "bench", router_id="bench")
        await member.start()
        lat = []
        for i in range(args.lone):
            t = time.perf_counter()
            await member.registry.claim("t", f"lone{i}")
            lat.append(time.perf_counter() - t)
            await member.registry.release("t", f"lone{i}")
        lat.sort()
        print(f"lone claim: p50 {lat[len(lat) // 2] * 1e6:.0f} us, p99 {lat[int(len(lat) * 0.99)] * 1e6:.0f} us")
        batches = 0
        send = member.pipe._send

        async def counting(batch: Any) -> None:
            nonlocal batches
            batches += 1
            await send(batch)
        member.pipe._send = counting  # type: ignore[method-assign]
        n = args.in_flight * args.per_worker
        wall, cpu = await _loop(member.registry, args.in_flight, args.per_worker)
        print(f"redis: {n} claim+release at {args.in_flight} in flight: {n / wall:.0f}/s, "
              f"{cpu / n * 1e6:.1f} us CPU each, {2 * n / max(batches, 1):.0f} operations per round trip")
        await member.close()
        wall, cpu = await _loop(LocalRequestRegistry(), args.in_flight, args.per_worker)
        print(f"local (baseline): {n / wall:.0f}/s, {cpu / n * 1e6:.1f} us CPU each")
    finally:
        server.kill()
        server.wait()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--in-flight", type=int, default=256, help="requests claiming and releasing at once")
    p.add_argument("--per-worker", type=int, default=80, help="claim+release cycles per in-flight request")
    p.add_argument("--lone", type=int, default=300, help="lone claims timed one by one")
    asyncio.run(main(p.parse_args()))
