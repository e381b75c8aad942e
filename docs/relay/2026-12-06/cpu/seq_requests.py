"""Sequential requests through a running `tokenrelay up` mesh: client TTFT, the router process's CPU
per request and Redis commands per request (INFO commandstats over the Redis `up` started).

    python docs/relay/2026-12-06/cpu/seq_requests.py STATE_FILE N [MAX_TOKENS]
"""

from __future__ import annotations

import asyncio
import json
import pathlib
import statistics
import subprocess
import sys
import time

import grpc
import psutil

from services.proto.tokenrelay.v1 import common_pb2, inference_pb2, inference_pb2_grpc

TEXT = "Hello there, this is a conversation turn of moderate length. " * 8


def command_counts(redis_socket: str) -> dict[str, int]:
    out = subprocess.run(["redis-cli", "-s", redis_socket, "info", "commandstats"],
                         capture_output=True, text=True, check=True).stdout
    counts = {}
    for line in out.splitlines():
        if line.startswith("cmdstat_"):
            name, rest = line.split(":", 1)
            counts[name.removeprefix("cmdstat_")] = int(rest.split(",")[0].split("=")[1])
    return counts


async def main(state: dict, n: int, max_tokens: int) -> None:
    socket = state["redis_url"].removeprefix("unix://")
    stub = inference_pb2_grpc.InferenceStub(grpc.aio.insecure_channel(state["router"]))
    metadata = (("authorization", f"Bearer {state['api_key']}"),)

    async def one(i: int) -> float | None:
        request = inference_pb2.GenerateRequest(prompt=TEXT + str(i),
                                                sampling=common_pb2.SamplingParams(max_tokens=max_tokens))
        t0, first = time.perf_counter(), None
        async for event in stub.Generate(request, metadata=metadata):
            if first is None and event.WhichOneof("event") == "delta":
                first = time.perf_counter() - t0
        return first

    for i in range(20):                                   # warm-up
        await one(i)
    router = psutil.Process(state["services"]["router"]["pid"])
    cpu0, redis0, t0 = router.cpu_times(), command_counts(socket), time.perf_counter()
    ttfts = sorted(1000 * t for t in [await one(i) for i in range(n)] if t is not None)
    wall, cpu1, redis1 = time.perf_counter() - t0, router.cpu_times(), command_counts(socket)
    cpu = cpu1.user + cpu1.system - cpu0.user - cpu0.system
    print(f"n={n} TTFT p50 {statistics.median(ttfts):.2f} ms p90 {ttfts[int(0.9 * len(ttfts))]:.2f}; "
          f"router CPU {1000 * cpu / n:.2f} ms/request; wall {1000 * wall / n:.2f} ms/request")
    print("redis commands per request:", {k: round((v - redis0.get(k, 0)) / n, 2)
                                          for k, v in redis1.items() if v != redis0.get(k, 0)})


if __name__ == "__main__":
    state = json.loads(pathlib.Path(sys.argv[1]).read_text())
    asyncio.run(main(state, int(sys.argv[2]), int(sys.argv[3]) if len(sys.argv) > 3 else 1))
