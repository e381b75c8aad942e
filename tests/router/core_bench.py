"""CPU per token of the transport-free request core, with the fake ports of `core_fakes` (no gRPC).

    python -m tests.router.core_bench 256 256            # streams, tokens per reply
    python -m tests.router.core_bench 256 256 --per-chunk-timeout   # the asyncio.timeout variant

Every engine chunk carries one token and each is detokenized alone, so every client delta holds
one token: the worst case for per-delta costs. The figure includes the fakes' own work.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import time
from typing import Any

import structlog

from router_svc import engine_stage
from router_svc.types import Delta, GenerateInput, Sampling
from tests.router.core_fakes import TENANT, FakeEngines, FakeReplica, core


def _streaming(tokens: int) -> type[FakeEngines]:
    class Streaming(FakeEngines):
        def submit(self, address: str, request_id: str, *args: Any, **kw: Any) -> Any:
            source = super().submit(address, request_id, *args, **kw)

            async def feed() -> None:
                for i in range(tokens - 1):
                    source.tokens(100 + i % 50)
                    await asyncio.sleep(0)
                source.tokens(7, finished=True)

            asyncio.get_running_loop().create_task(feed())
            return source
    return Streaming


async def _per_chunk_timeout(self: Any, state: Any, source: Any, address: str, watchdog: Any) -> Any:
    async with asyncio.timeout(self.progress_timeout):
        item = await source.get()
    watchdog.last = watchdog.loop.time()   # keep the (idle) watchdog quiet
    return item


async def main(streams: int, tokens: int) -> None:
    c = core(FakeReplica("e1", ["manual"]))
    engines = _streaming(tokens)(FakeReplica("e1", ["manual"]))
    c.router.ports.engines = c.router.stage.engines = engines
    deltas = 0

    async def one(i: int) -> None:
        nonlocal deltas
        inp = GenerateInput(Sampling(max_tokens=tokens), prompt="hi", request_id=str(i))
        async for event in c.router.generate(TENANT, inp):
            deltas += isinstance(event, Delta)

    t0, c0 = time.perf_counter(), time.process_time()
    await asyncio.gather(*(one(i) for i in range(streams)))
    cpu = time.process_time() - c0
    print(f"{streams} streams x {tokens} tokens: {streams * tokens / cpu:,.0f} tokens per CPU-second, "
          f"{deltas} deltas, {cpu / streams * 1e3:.2f} ms CPU per request, wall {time.perf_counter() - t0:.2f} s")


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("streams", type=int, nargs="?", default=256)
    p.add_argument("tokens", type=int, nargs="?", default=256)
    p.add_argument("--per-chunk-timeout", action="store_true", help="an asyncio.timeout around every chunk read")
    args = p.parse_args()
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    if args.per_chunk_timeout:
        engine_stage.EngineStage._next = _per_chunk_timeout  # type: ignore[method-assign,assignment]
    asyncio.run(main(args.streams, args.tokens))
