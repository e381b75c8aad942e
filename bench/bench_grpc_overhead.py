"""Server CPU per message of bare grpcio (asyncio): a unary call vs a message on a bidirectional
stream, with a Tokenize-sized payload (8 prompts of 2k tokens in, their packed ids out).

An echo server runs in a child process pinned to the last core; the client (2 concurrent callers,
as the router's coalescer keeps 2 calls in flight) on the first. The figure is the server process's
CPU time divided by the messages it answered.

It measures bare grpcio on purpose, so it opens its channel and port with grpc directly instead
of through `services.channels` (the one exception tests/test_channels.py allows).

    python bench/bench_grpc_overhead.py [--request-bytes 72000] [--response-bytes 64000] [--seconds 4]
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import time

import grpc
import psutil


def _server(ports: mp.Queue, cpu: int, response_bytes: int) -> None:
    os.sched_setaffinity(0, {cpu})
    response = b"x" * response_bytes

    async def unary(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        return response

    async def stream(requests: object, context: grpc.aio.ServicerContext) -> object:
        async for _ in requests:  # type: ignore[attr-defined]
            yield response

    async def main() -> None:
        server = grpc.aio.server()
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("echo.Echo", {
            "Unary": grpc.unary_unary_rpc_method_handler(unary),
            "Stream": grpc.stream_stream_rpc_method_handler(stream)}),))
        ports.put(server.add_insecure_port("127.0.0.1:0"))
        await server.start()
        await server.wait_for_termination()

    asyncio.run(main())


async def _measure(port: int, pid: int, args: argparse.Namespace) -> None:
    proc = psutil.Process(pid)
    request = b"y" * args.request_bytes
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        unary = channel.unary_unary("/echo.Echo/Unary")
        stream = channel.stream_stream("/echo.Echo/Stream")

        async def unary_loop() -> int:
            n, end = 0, time.perf_counter() + args.seconds
            while time.perf_counter() < end:
                await unary(request)
                n += 1
            return n

        async def stream_loop() -> int:
            call, n, end = stream(), 0, time.perf_counter() + args.seconds
            while time.perf_counter() < end:
                await call.write(request)
                await call.read()
                n += 1
            await call.done_writing()
            return n

        for name, loop in (("unary", unary_loop), ("stream", stream_loop)) * 2:
            cpu0, t0 = sum(proc.cpu_times()[:2]), time.perf_counter()
            messages = sum(await asyncio.gather(loop(), loop()))
            cpu = sum(proc.cpu_times()[:2]) - cpu0
            print(f"{name:>6}: {messages / (time.perf_counter() - t0):8,.0f} messages/s, "
                  f"server CPU {cpu / messages * 1e6:6.0f} µs per message")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--request-bytes", type=int, default=72_000)
    parser.add_argument("--response-bytes", type=int, default=64_000)
    parser.add_argument("--seconds", type=float, default=4.0)
    args = parser.parse_args()
    cpus = sorted(os.sched_getaffinity(0))
    ports: mp.Queue = mp.Queue()
    server = mp.Process(target=_server, args=(ports, cpus[-1], args.response_bytes), daemon=True)
    server.start()
    try:
        port = ports.get(timeout=30)
        if len(cpus) > 1:
            os.sched_setaffinity(0, set(cpus[:-1]))
        asyncio.run(_measure(port, server.pid or 0, args))
    finally:
        server.kill()


if __name__ == "__main__":
    main()
