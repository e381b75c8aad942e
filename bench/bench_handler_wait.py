"""How long calls wait before the router's handler starts, at high concurrency.

The router times a request from its handler's first line (`Timings.ttft_seconds`); the client times
it from sending the call. The difference is what the process cannot see: the call waiting in gRPC's
queues (and the router's event loop) before the handler task runs, plus the first delta's way back.
This runs N closed-loop streams against a sim mesh (`tokenrelay up --engine sim`, started here
unless --address is given) and prints both TTFTs, their difference, and the router's loop lag.

    python bench/bench_handler_wait.py --streams 16 64 256 --seconds 8 --max-tokens 256
    taskset -c 4-11 python bench/bench_handler_wait.py --mesh-cpus 0-3 ...     # client and mesh apart
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import pathlib
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from services.channels import CHANNEL_OPTIONS, open_channel
from services.client import Accepted, Client, Finished, TextDelta
from services.proto.tokenrelay.v1 import inference_pb2_grpc


def _pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(p / 100 * len(xs)))] * 1000 if xs else float("nan")


def _client(address: str, api_key: str, i: int) -> Client:
    """A Client with a connection of its own (channels of one process share connections otherwise)."""
    client = Client(address, api_key=api_key)
    client._channel = open_channel(address, options=[*CHANNEL_OPTIONS, ("grpc.use_local_subchannel_pool", 1),
                                                     ("tokenrelay.bench_connection", i)])
    client._stub = inference_pb2_grpc.InferenceStub(client._channel)
    return client


def _metric(url: str, name: str) -> float:
    for line in urllib.request.urlopen(url, timeout=5).read().decode().splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return float("nan")


async def run(address: str, api_key: str, streams: int, seconds: float, max_tokens: int,
              metrics_url: str, channels: int = 1) -> None:
    client_ttft: list[float] = []
    router_ttft: list[float] = []
    gap: list[float] = []
    errors: dict[str, int] = {}
    lag_max: list[float] = []
    own_lag: list[float] = []
    to_accepted: list[float] = []
    end = time.monotonic() + seconds
    probe0 = [_metric(metrics_url, f"tokenrelay_router_accept_wait_seconds_{k}") for k in ("sum", "count")]
    clients = [_client(address, api_key, i) for i in range(channels)]
    async with contextlib.AsyncExitStack() as stack:
        for c in clients:
            await stack.enter_async_context(c)

        async def one(client: Client) -> None:
            while time.monotonic() < end:
                t0 = time.perf_counter()
                first = accepted = None
                try:
                    async for ev in client.stream("a probe of the handler wait", max_tokens=max_tokens, timeout=60):
                        if accepted is None and isinstance(ev, Accepted):
                            accepted = time.perf_counter() - t0
                        elif first is None and isinstance(ev, TextDelta):
                            first = time.perf_counter() - t0
                        elif isinstance(ev, Finished) and first is not None:
                            client_ttft.append(first)
                            router_ttft.append(ev.ttft_seconds)
                            gap.append(first - ev.ttft_seconds)
                            if accepted is not None:   # the router yields Accepted once tokenized
                                to_accepted.append(accepted - ev.tokenize_seconds)
                except Exception as exc:  # noqa: BLE001 - counted
                    reason = getattr(exc, "reason", type(exc).__name__)
                    errors[reason] = errors.get(reason, 0) + 1

        async def client_lag() -> None:   # the client's own loop: what it adds to the client's TTFT
            while time.monotonic() < end:
                t = time.perf_counter()
                await asyncio.sleep(0.01)
                own_lag.append(time.perf_counter() - t - 0.01)

        async def sample_lag() -> None:
            while time.monotonic() < end:
                await asyncio.sleep(0.5)
                lag_max.append(await asyncio.to_thread(_metric, metrics_url,
                                                       "tokenrelay_router_loop_lag_max_seconds"))

        await asyncio.gather(sample_lag(), client_lag(), *(one(clients[i % channels]) for i in range(streams)))
    probe1 = [_metric(metrics_url, f"tokenrelay_router_accept_wait_seconds_{k}") for k in ("sum", "count")]
    probe_mean = (probe1[0] - probe0[0]) / max(probe1[1] - probe0[1], 1) * 1000
    print(f"{streams:5d} streams on {channels:2d} connection(s): {len(gap):5d} requests; "
          f"client TTFT p50/p99 {_pct(client_ttft, 50):7.1f}/"
          f"{_pct(client_ttft, 99):7.1f} ms; router TTFT {_pct(router_ttft, 50):7.1f}/{_pct(router_ttft, 99):7.1f} ms; "
          f"unseen (client - router) {_pct(gap, 50):7.1f}/{_pct(gap, 99):7.1f} ms; router loop lag max "
          f"p50/max {_pct(lag_max, 50):6.1f}/{max(lag_max, default=float('nan')) * 1000:6.1f} ms; client loop lag "
          f"p50/p99 {_pct(own_lag, 50):6.1f}/{_pct(own_lag, 99):6.1f} ms; router accept-wait self-probe mean "
          f"{probe_mean:6.1f} ms; client time to Accepted minus router tokenize p50/p99 {_pct(to_accepted, 50):6.1f}/"
          f"{_pct(to_accepted, 99):6.1f} ms; errors {errors}",
          flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--streams", type=int, nargs="+", default=[16, 64, 256])
    ap.add_argument("--seconds", type=float, default=8.0)
    ap.add_argument("--channels", type=int, nargs="+", default=[1], help="client connections the streams share")
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--mesh-cpus", default="", help="taskset cores of the mesh it starts (run this under "
                                                    "taskset on others)")
    ap.add_argument("--state-file", default="", help="a running mesh's state file (default: start one)")
    args = ap.parse_args()
    proc = None
    state_file = args.state_file
    if not state_file:
        tmp = pathlib.Path(tempfile.mkdtemp(prefix="handler-wait-"))
        state_file = str(tmp / "state.json")
        env = {**os.environ, "TOKENRELAY_ROUTER_MAX_LOOP_LAG_MS": "0", "TOKENRELAY_ROUTER_MAX_REQUESTS_IN_FLIGHT": "0"}
        pin = ["taskset", "-c", args.mesh_cpus] if args.mesh_cpus else []
        argv = [*pin, sys.executable, "-m", "tokenrelay_tools.cli.main", "up", "--engine", "sim", "--port", "0",
                "--max-in-flight", "100000", "--state-file", state_file, "--run-dir", str(tmp / "run")]
        proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=open(tmp / "up.log", "wb"), env=env)
        while not pathlib.Path(state_file).exists():
            if proc.poll() is not None:
                sys.exit((tmp / "up.log").read_text())
            time.sleep(0.05)
    state = json.loads(pathlib.Path(state_file).read_text())
    try:
        for n in args.streams:
            for k in args.channels:
                asyncio.run(run(state["router"], state["api_key"], n, args.seconds, args.max_tokens,
                                state["metrics"]["router"], k))
    finally:
        if proc is not None:
            proc.send_signal(signal.SIGINT)
            proc.wait(60)


if __name__ == "__main__":
    main()
