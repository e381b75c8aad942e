"""Helpers shared by the engine tests: fast sim configs, event collection, polling, shared data."""

from __future__ import annotations

import asyncio
from typing import Any

from engine_svc.backends.base import GenerationEvent, GenerationRequest
from engine_svc.backends.sim import SimConfig
from tests.waiting import poll  # noqa: F401 - re-exported for the engine tests


def fast_sim(**overrides: Any) -> SimConfig:
    """A sim with zero costs (steps only yield to the loop) and a small vocabulary / cache."""
    values: dict[str, Any] = dict(profile="instant", vocab_size=1000, num_blocks=256, tokens_per_block=4,
                                  max_context=512, max_batch_size=8)
    values.update(overrides)
    return SimConfig(**values)


def req(request_id: str, prompt: list[int], max_tokens: int = 8, **kw: Any) -> GenerationRequest:
    return GenerationRequest(request_id=request_id, prompt_token_ids=list(prompt), max_tokens=max_tokens, **kw)


class Collector:
    """A sink that records events per request and lets a test await a request's end."""

    def __init__(self) -> None:
        self.events: dict[str, list[GenerationEvent]] = {}
        self._done: dict[str, asyncio.Event] = {}

    def __call__(self, event: GenerationEvent) -> None:
        self.events.setdefault(event.request_id, []).append(event)
        if event.finished:
            self._flag(event.request_id).set()

    def _flag(self, request_id: str) -> asyncio.Event:
        return self._done.setdefault(request_id, asyncio.Event())

    async def wait(self, *request_ids: str, timeout: float = 10.0) -> None:
        await asyncio.wait_for(asyncio.gather(*(self._flag(r).wait() for r in request_ids)), timeout)

    def tokens(self, request_id: str) -> list[int]:
        return [t for e in self.events.get(request_id, []) for t in e.token_ids]

    def last(self, request_id: str) -> GenerationEvent:
        return self.events[request_id][-1]

    def count(self, request_id: str) -> int:
        return len(self.tokens(request_id))



class StreamClient:
    """One Engine.Stream call driven by a test: send submits/aborts, collect chunks per id."""

    def __init__(self, stub: Any) -> None:
        from services.proto.tokenrelay.v1 import engine_pb2

        self._pb = engine_pb2
        self._out: asyncio.Queue[Any] = asyncio.Queue()
        self.call = stub.Stream(self._requests())
        self.chunks: dict[str, list[Any]] = {}
        self.messages = 0
        self.loads: list[Any] = []          # LoadReports piggybacked on the stream
        self._finished: dict[str, asyncio.Event] = {}
        self._reader = asyncio.create_task(self._read())

    async def _requests(self) -> Any:
        while True:
            message = await self._out.get()
            if message is None:
                return
            yield message

    async def _read(self) -> None:
        async for message in self.call:
            self.messages += 1
            if message.HasField("load"):
                self.loads.append(message.load)
            for chunk in message.chunks:
                self.chunks.setdefault(chunk.request_id, []).append(chunk)
                if chunk.finished:
                    self._flag(chunk.request_id).set()

    def _flag(self, request_id: str) -> asyncio.Event:
        return self._finished.setdefault(request_id, asyncio.Event())

    def submit(self, *requests: Any) -> None:
        self._out.put_nowait(self._pb.EngineInbound(submit=list(requests)))

    def abort(self, *request_ids: str) -> None:
        self._out.put_nowait(self._pb.EngineInbound(abort=list(request_ids)))

    def half_close(self) -> None:
        self._out.put_nowait(None)

    async def wait(self, *request_ids: str, timeout: float = 10.0) -> None:
        await asyncio.wait_for(asyncio.gather(*(self._flag(r).wait() for r in request_ids)), timeout)

    async def ended(self, timeout: float = 10.0) -> None:
        """The server ended the stream (normally)."""
        await asyncio.wait_for(self._reader, timeout)

    def tokens(self, request_id: str) -> list[int]:
        return [t for c in self.chunks.get(request_id, []) for t in c.token_ids]

    def last(self, request_id: str) -> Any:
        return self.chunks[request_id][-1]

    def cancel(self) -> None:
        self.call.cancel()
        self._reader.cancel()


def engine_request(request_id: str, prompt: list[int], max_tokens: int = 8, *, eos: list[int] | None = None,
                   cache_salt: str = "", **sampling: Any) -> Any:
    from services.proto.tokenrelay.v1 import common_pb2, engine_pb2

    return engine_pb2.EngineRequest(
        request_id=request_id, prompt_token_ids=prompt, eos_token_ids=eos or [], cache_salt=cache_salt,
        sampling=common_pb2.SamplingParams(max_tokens=max_tokens, **sampling))


async def run_backend(backend: Any, requests: list[GenerationRequest], timeout: float = 10.0) -> Collector:
    """Validate and submit every request to a backend, then wait until all of them finished."""
    sink = Collector()
    for r in requests:
        backend.validate(r)
        backend.submit(r, sink)
    await sink.wait(*(r.request_id for r in requests), timeout=timeout)
    return sink
