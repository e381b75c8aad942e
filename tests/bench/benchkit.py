"""Helpers shared by the bench tests: a fake target, a fake Inference server, workload builders, polling.

The fake Inference server counts one prompt token per 3 characters (+1 for BOS, +4 per chat
message), so the bench's calibration, API-key mapping and chat prefixes can be checked exactly.
"""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import grpc

from services.errors import TokenrelayError, Unauthenticated
from services.proto.tokenrelay.v1 import common_pb2, inference_pb2, inference_pb2_grpc
from tests.waiting import poll  # noqa: F401 - re-exported for the bench tests
from tokenrelay_tools.bench.cli import add_bench_parser
from tokenrelay_tools.bench.targets import Observer, Target, TargetSession, TurnResult
from tokenrelay_tools.bench.workload import SessionPlan, TurnPlan, Workload, parse_workload


def bench_args(*argv: str) -> argparse.Namespace:
    """`tokenrelay bench ARGV` parsed as the CLI parses it."""
    parser = argparse.ArgumentParser(prog="tokenrelay")
    add_bench_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(["bench", *argv])


def workload(**spec: Any) -> Workload:
    """A workload from a mapping, as a YAML file would give it."""
    return parse_workload({"name": "test", **spec})


@dataclass
class FakeBehaviour:
    """What the fake target does per turn; every hook receives (plan, turn index, turn)."""

    chunk: int = 2                               # tokens per delta
    hang: Callable[[SessionPlan, int], bool] = lambda plan, i: False
    fail: Callable[[SessionPlan, int], TokenrelayError | None] = lambda plan, i: None
    hold: asyncio.Event | None = None            # when set, turns wait for it before streaming
    max_context: int = 0


@dataclass
class FakeTarget(Target):
    """Streams ``output_tokens`` tokens per turn in deltas of ``chunk`` tokens, no network."""

    behaviour: FakeBehaviour = field(default_factory=FakeBehaviour)
    name: str = "fake"
    in_flight: int = 0
    peak_in_flight: int = 0
    turns_seen: list[tuple[int, int, TurnPlan]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.max_context = self.behaviour.max_context

    def session(self, plan: SessionPlan, run_id: str, unique: bool) -> TargetSession:
        return _FakeSession(self, plan)


class _FakeSession(TargetSession):
    def __init__(self, target: FakeTarget, plan: SessionPlan) -> None:
        self.t = target
        self.plan = plan
        self.i = 0
        self.context_tokens = plan.system_tokens

    async def turn(self, turn: TurnPlan, observe: Observer, timeout: float) -> TurnResult:
        t, b, i = self.t, self.t.behaviour, self.i
        self.i += 1
        t.turns_seen.append((self.plan.index, i, turn))
        t.in_flight += 1
        t.peak_in_flight = max(t.peak_in_flight, t.in_flight)
        try:
            if b.hold is not None:
                await b.hold.wait()
            if b.hang(self.plan, i):
                await asyncio.Event().wait()
            error = b.fail(self.plan, i)
            if error is not None:
                raise error
            sent = 0
            while sent < turn.output_tokens:
                n = min(b.chunk, turn.output_tokens - sent)
                await asyncio.sleep(0)
                observe(n)
                sent += n
        finally:
            t.in_flight -= 1
        prompt = self.context_tokens + turn.prompt_tokens
        self.context_tokens = prompt + turn.output_tokens
        return TurnResult(prompt, 0, turn.output_tokens, "length", 0.001, self.context_tokens)



# ------------------------------------------------------------------ fake Inference server
KEYS = {"key-a": "a", "key-b": "b"}
PRIORITY_NAMES = {0: "", 1: "low", 2: "normal", 3: "high"}


@dataclass
class Seen:
    tenant: str
    priority: str
    session_id: str
    messages: list[tuple[str, str]]
    prompt: str
    return_token_ids: bool
    max_tokens: int
    ignore_eos: bool


def _tokens(text: str) -> int:
    return len(text) // 3


class FakeInference(inference_pb2_grpc.InferenceServicer):
    def __init__(self) -> None:
        self.seen: list[Seen] = []

    def _tenant(self, context: grpc.aio.ServicerContext) -> str:
        auth = dict(context.invocation_metadata()).get("authorization", "")
        tenant = KEYS.get(auth.removeprefix("Bearer "))
        if tenant is None:
            raise Unauthenticated("unknown API key", "UNKNOWN_API_KEY")
        return tenant

    def _events(self, prompt_tokens: int, max_tokens: int, ids: bool) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = [{"accepted": inference_pb2.Accepted(request_id="r", prompt_tokens=prompt_tokens)}]
        for start in range(0, max_tokens, 2):
            chunk = list(range(start, min(start + 2, max_tokens)))
            out.append({"delta": inference_pb2.Delta(text="ab" * len(chunk), token_ids=chunk if ids else [])})
        out.append({"done": inference_pb2.Done(
            finish_reason=common_pb2.FINISH_REASON_LENGTH,
            usage=common_pb2.Usage(prompt_tokens=prompt_tokens, completion_tokens=max_tokens),
            timings=common_pb2.Timings(queue_seconds=0.003))})
        return out

    async def Generate(self, request: inference_pb2.GenerateRequest,
                       context: grpc.aio.ServicerContext) -> AsyncIterator[inference_pb2.GenerateResponse]:
        tenant = self._tenant(context)
        messages = [(m.role, m.content) for m in request.messages.messages]
        self.seen.append(Seen(tenant, PRIORITY_NAMES[request.priority], request.session_id, messages, request.prompt,
                              request.return_token_ids, request.sampling.max_tokens, request.sampling.ignore_eos))
        n = 1 + (sum(4 + _tokens(c) for _, c in messages) if messages else _tokens(request.prompt))
        for event in self._events(n, request.sampling.max_tokens, request.return_token_ids):
            yield inference_pb2.GenerateResponse(**event)

    async def Chat(self, request_iterator: AsyncIterator[inference_pb2.ChatRequest],
                   context: grpc.aio.ServicerContext) -> AsyncIterator[inference_pb2.ChatResponse]:
        tenant = self._tenant(context)
        start = (await anext(request_iterator)).start
        yield inference_pb2.ChatResponse(started=inference_pb2.ChatStarted(session_id=start.session_id))
        conversation = [(m.role, m.content) for m in start.system]
        async for req in request_iterator:
            turn = req.turn
            conversation += [(m.role, m.content) for m in turn.messages]
            self.seen.append(Seen(tenant, PRIORITY_NAMES[start.priority], start.session_id, list(conversation), "",
                                  False, turn.sampling.max_tokens, turn.sampling.ignore_eos))
            n = 1 + sum(4 + _tokens(c) for _, c in conversation)
            for event in self._events(n, turn.sampling.max_tokens, False):
                yield inference_pb2.ChatResponse(**event)
            conversation.append(("assistant", "ab" * turn.sampling.max_tokens))
