"""Round trip of one small message each way between two processes at light load (GAP seconds between
round trips): a grpc.aio bidirectional stream kept open (grpc), a new grpc.aio unary-stream call per round
trip to its first message (call), and asyncio streams on TCP loopback (raw), on uvloop when installed.
`grpc` against `raw`: what the router's open stream to its engine costs per message against the socket
underneath it (docs/benchmarks.md, twelfth session); `call` (added in the thirteenth session): what a
Generate call per request costs against a request on an open Stream call.
    python docs/relay/2026-12-07c/cpu/pingpong.py grpc|call|raw [N] [GAP]
"""

import asyncio
import multiprocessing as mp
import os
import statistics
import struct
import sys
import time

N = int(sys.argv[2]) if len(sys.argv) > 2 else 300
GAP = float(sys.argv[3]) if len(sys.argv) > 3 else 0.05
PAYLOAD = b"x" * 40


def _loop() -> None:
    try:
        import uvloop
        uvloop.install()
    except ImportError:
        pass


def grpc_server(port_q) -> None:
    import grpc
    _loop()

    async def echo(it, context):
        async for m in it:
            yield m

    async def one(req, context):
        yield req

    async def main() -> None:
        server = grpc.aio.server()
        handler = grpc.method_handlers_generic_handler("pp.PP", {"Echo": grpc.stream_stream_rpc_method_handler(echo),
            "One": grpc.unary_stream_rpc_method_handler(one)})
        server.add_generic_rpc_handlers((handler,))
        port_q.put(server.add_insecure_port("127.0.0.1:0"))
        await server.start()
        await server.wait_for_termination()
    asyncio.run(main())


async def grpc_client(port: int) -> list[float]:
    import grpc
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
        call = ch.stream_stream("/pp.PP/Echo")()
        out = []
        for _ in range(N):
            t = time.perf_counter()
            await call.write(PAYLOAD)
            await call.read()
            out.append(time.perf_counter() - t)
            await asyncio.sleep(GAP)
        await call.done_writing()
    return out


async def call_client(port: int) -> list[float]:
    import grpc
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
        m = ch.unary_stream("/pp.PP/One")
        out = []
        for _ in range(N):
            t = time.perf_counter()
            call = m(PAYLOAD)
            await call.read()
            out.append(time.perf_counter() - t)
            await call.read()
            await asyncio.sleep(GAP)
    return out


def raw_server(port_q) -> None:
    _loop()

    async def conn(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        while True:
            try:
                (n,) = struct.unpack("!I", await r.readexactly(4))
                data = await r.readexactly(n)
            except asyncio.IncompleteReadError:
                return
            w.write(struct.pack("!I", n) + data)

    async def main() -> None:
        server = await asyncio.start_server(conn, "127.0.0.1", 0)
        port_q.put(server.sockets[0].getsockname()[1])
        await server.serve_forever()
    asyncio.run(main())


async def raw_client(port: int) -> list[float]:
    r, w = await asyncio.open_connection("127.0.0.1", port)
    out = []
    for _ in range(N):
        t = time.perf_counter()
        w.write(struct.pack("!I", len(PAYLOAD)) + PAYLOAD)
        (n,) = struct.unpack("!I", await r.readexactly(4))
        await r.readexactly(n)
        out.append(time.perf_counter() - t)
        await asyncio.sleep(GAP)
    w.close()
    return out


def main() -> None:
    kind = sys.argv[1]
    q: mp.Queue = mp.Queue()
    p = mp.Process(target=raw_server if kind == "raw" else grpc_server, args=(q,), daemon=True)
    p.start()
    port = q.get()
    _loop()
    rtt = asyncio.run({"grpc": grpc_client, "call": call_client, "raw": raw_client}[kind](port))[20:]
    p.kill()
    q_ = statistics.quantiles(rtt, n=10)
    print(f"{kind:5s} gap {GAP * 1e3:.0f} ms  round trip p50 {statistics.median(rtt) * 1e3:.3f} ms  "
          f"p10 {q_[0] * 1e3:.3f}  p90 {q_[-1] * 1e3:.3f}  ({len(rtt)}, pid {os.getpid()})")


if __name__ == "__main__":
    main()
