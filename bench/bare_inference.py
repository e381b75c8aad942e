"""The floor of a router's client stream: a bare grpc.aio server of the real `Inference.Generate`.

`bench/bench_relay.py --targets bare` runs it on the router's CPU and drives it with the same client
code as the mesh, so "client messages per router CPU-second" has a baseline measured in the same run
on the same core. Per call it writes what the router writes for a reply (`accepted`, ``max_tokens``
one-token `delta`s, `done`), each delta after one asyncio wake-up: every stream waits on one shared
ticker (as the router's streams wait on the engine's step messages). The ticker fires every
``--step-ms``; at 0 (bench_relay's default) it fires on every turn of the event loop, so the server
runs flat out, as saturated as a router that one-token deltas keep busy.
Nothing else: no interceptor, no auth, no tokenizer, no engine, no Redis.

It binds its port with grpc directly on purpose (a baseline of bare grpcio; tests/test_channels.py
allows it).

    python bench/bare_inference.py --port-file /tmp/bare.port [--step-ms 0] [--event-loop uvloop]
"""

from __future__ import annotations

import argparse
import asyncio
import pathlib
import sys
from collections.abc import AsyncIterator

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

import grpc

from services.eventloop import LOOP_CHOICES, run
from services.proto.tokenrelay.v1 import common_pb2, inference_pb2, inference_pb2_grpc


class Ticker:
    """One future per tick, shared by every stream waiting for its next token. It fires only when a
    stream waits (idle, the server costs nothing: it shares the router's CPU in bench_relay)."""

    def __init__(self, step_s: float) -> None:
        self.step_s = step_s
        self.tick: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiting = asyncio.Event()

    def next(self) -> asyncio.Future[None]:
        self._waiting.set()
        return self.tick

    async def run(self) -> None:
        while True:
            await self._waiting.wait()
            self._waiting.clear()
            await asyncio.sleep(self.step_s)
            tick, self.tick = self.tick, asyncio.get_running_loop().create_future()
            tick.set_result(None)


class Bare(inference_pb2_grpc.InferenceServicer):
    def __init__(self, ticker: Ticker) -> None:
        self.ticker = ticker

    async def Generate(self, request: inference_pb2.GenerateRequest,
                       context: grpc.aio.ServicerContext) -> AsyncIterator[inference_pb2.GenerateResponse]:
        n = max(1, request.sampling.max_tokens)
        yield inference_pb2.GenerateResponse(accepted=inference_pb2.Accepted(request_id="bare"))
        for _ in range(n):
            await self.ticker.next()
            yield inference_pb2.GenerateResponse(delta=inference_pb2.Delta(text="x"))
        yield inference_pb2.GenerateResponse(done=inference_pb2.Done(
            usage=common_pb2.Usage(completion_tokens=n)))


async def serve(port_file: str, step_ms: float) -> None:
    ticker = Ticker(step_ms / 1000)
    server = grpc.aio.server()
    inference_pb2_grpc.add_InferenceServicer_to_server(Bare(ticker), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    task = asyncio.create_task(ticker.run())
    pathlib.Path(port_file).write_text(str(port))
    try:
        await server.wait_for_termination()
    finally:
        task.cancel()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--port-file", required=True, help="where the bound port is written")
    p.add_argument("--step-ms", type=float, default=0.0, help="the ticker's period: one delta per stream per tick "
                   "(0: every turn of the event loop)")
    p.add_argument("--event-loop", choices=LOOP_CHOICES, default="asyncio",
                   help="the loop it runs on (services/eventloop.py): the floor of grpc.aio on either loop")
    args = p.parse_args(argv)
    run(serve(args.port_file, args.step_ms), args.event_loop)
    return 0


if __name__ == "__main__":
    sys.exit(main())
