"""What a bench drives: the mesh (router, through `services.client`) or one engine_svc directly.

Both targets run *sessions* (one completion, or the turns of a chat that each extend the
conversation so far) and report every streamed delta to an observer callback as it arrives, so
the runner timestamps tokens the moment they reach the client. A target raises the typed
`services.errors` exception of a failure; the runner counts it by status and reason.
"""

from __future__ import annotations

import itertools
import random
import time
import zlib
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import grpc

from services.channels import open_channel
from services.client import Client, Finished, RequestStream, TextDelta
from services.errors import Reason, in_band_error
from services.mux import MuxClient, StreamBroken
from services.proto.tokenrelay.v1 import common_pb2, engine_pb2, engine_pb2_grpc
from services.wire import FINISH_NAMES

from .prompts import IdSynth, TextSynth, calibrate_chars_per_token, nonce
from .workload import SessionPlan, TurnPlan

# Called once per delta with the number of tokens it carries (None when the API does not say).
Observer = Callable[[int | None], None]


@dataclass
class TurnResult:
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    finish_reason: str
    queue_seconds: float | None     # None where the target does not measure it (engine)
    context_tokens: int             # the conversation's length after this turn
    finished_at: float = field(default_factory=time.monotonic)  # when the final message arrived
    server_ttft: float | None = None    # the mesh's own view: request received -> first token sent
    tokenize_seconds: float | None = None


class TargetSession(ABC):
    """One session's conversation state on a target."""

    context_tokens = 0

    async def __aenter__(self) -> TargetSession:
        return self

    async def __aexit__(self, *exc: object) -> None:
        return None

    @abstractmethod
    async def turn(self, turn: TurnPlan, observe: Observer, timeout: float) -> TurnResult: ...


class Target(ABC):
    name: str = ""
    max_context: int = 0            # 0 = unknown: requests are sent as planned

    async def start(self) -> None:
        return None

    async def close(self) -> None:
        return None

    def margin(self, new_tokens: int) -> int:
        """Tokens to allow beyond a turn's planned new tokens when fitting it into the context."""
        return 0

    @abstractmethod
    def session(self, plan: SessionPlan, run_id: str, unique: bool) -> TargetSession: ...

    def describe(self) -> dict[str, Any]:
        return {"target": self.name, "max_context": self.max_context}


def _system_seed(plan: SessionPlan) -> int:
    # A shared system prompt is the same for every session of the class (and run), hence cacheable.
    return zlib.crc32(f"system:{plan.cls}".encode()) if plan.shared_system else plan.seed


# -------------------------------------------------------------------------------------- mesh
class MeshTarget(Target):
    """The router, through the typed client. ``keys`` maps tenant names to API keys."""

    name = "mesh"
    CHAT_APIS = ("messages", "chat", "text")
    CALLS = ("call", "stream")    # a Generate call per request, or every request on one open Stream call

    def __init__(self, address: str, keys: Mapping[str, str], default_key: str, *, chat_api: str = "messages",
                 chars_per_token: float = 0.0, max_context: int = 0, calls: str = "call") -> None:
        if chat_api not in self.CHAT_APIS:
            raise ValueError(f"chat_api must be one of {self.CHAT_APIS}")
        if calls not in self.CALLS:
            raise ValueError(f"calls must be one of {self.CALLS}")
        self.calls = calls
        self._streams: dict[Client, RequestStream] = {}
        self.address = address
        self._keys = dict(keys)
        self._default_key = default_key
        self._clients: dict[str, Client] = {}
        self.chat_api = chat_api
        self.chars_per_token = chars_per_token
        self.max_context = max_context
        self.synth: TextSynth | None = None
        # Largest prompt growth seen beyond the planned new tokens (chat template, re-tokenized
        # replies); a guess until the first turn has been measured.
        self.overhead = 32
        self._overhead_measured = False

    def client(self, tenant: str) -> Client:
        key = self._keys.get(tenant, self._default_key)
        if key not in self._clients:
            self._clients[key] = Client(self.address, key)
        return self._clients[key]

    async def start(self) -> None:
        if self.chars_per_token <= 0:
            client = self.client(next(iter(self._keys), ""))

            async def count(text: str) -> int:
                done = await client.generate(text, max_tokens=1)
                return done.finished.prompt_tokens

            self.chars_per_token = await calibrate_chars_per_token(count)
        self.synth = TextSynth(self.chars_per_token)

    async def requests(self, tenant: str) -> Client | RequestStream:
        """What a tenant's Generate requests go through: its client, or its client's open Stream call."""
        client = self.client(tenant)
        if self.calls == "call":
            return client
        if client not in self._streams:      # one call per client, as one client per API key
            self._streams[client] = await client.open_stream().__aenter__()
        return self._streams[client]

    async def close(self) -> None:
        for stream in self._streams.values():
            await stream.__aexit__(None, None, None)
        self._streams.clear()
        for c in self._clients.values():
            await c.close()
        self._clients.clear()

    def margin(self, new_tokens: int) -> int:
        # The conversation so far is known exactly (the last `done`); the new text is sized from
        # the calibration (a few % off), and the template and re-tokenized reply add the rest.
        return self.overhead + 4 + new_tokens // 8

    def note_overhead(self, tokens: int) -> None:
        self.overhead = max(self.overhead, tokens) if self._overhead_measured else max(0, tokens)
        self._overhead_measured = True

    def session(self, plan: SessionPlan, run_id: str, unique: bool) -> TargetSession:
        assert self.synth is not None, "start() first"
        cls = _MeshChat if plan.kind == "chat" and self.chat_api == "chat" else _MeshGenerate
        return cls(self, plan, f"{run_id}-{plan.index}", unique)

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "address": self.address, "chat_api": self.chat_api, "calls": self.calls,
                "chars_per_token": round(self.chars_per_token, 3), "prompt_overhead_tokens": self.overhead}


class _MeshSession(TargetSession):
    def __init__(self, target: MeshTarget, plan: SessionPlan, session_id: str, unique: bool) -> None:
        self.t = target
        self.plan = plan
        self.session_id = session_id
        # With unique prompts the run id keeps a repeated run (same seed) from hitting the cache
        # its predecessor filled; without, a rerun sends the very same text.
        self.rng = random.Random(f"{session_id}:{plan.seed}" if unique else plan.seed)
        self.synth: TextSynth = target.synth  # type: ignore[assignment]
        self.client = target.client(plan.tenant)
        self.system = ""
        tag = nonce(self.rng) + " " if unique else ""
        if plan.system_tokens:
            self.system = self.synth.text(plan.system_tokens, random.Random(_system_seed(plan)))
            if not plan.shared_system:
                self.system, tag = tag + self.system, ""
        self._first_tag = tag

    def user_text(self, tokens: int) -> str:
        tag, self._first_tag = self._first_tag, ""
        return tag + self.synth.text(tokens, self.rng)

    def expect(self, turn: TurnPlan) -> None:
        """Note the prompt size this turn would have without any template or tokenization effect."""
        self._expected = (self.context_tokens or self.plan.system_tokens) + turn.prompt_tokens

    def result(self, f: Finished) -> TurnResult:
        self.t.note_overhead(f.prompt_tokens - self._expected)
        self.context_tokens = f.prompt_tokens + f.completion_tokens
        return TurnResult(f.prompt_tokens, f.cached_tokens, f.completion_tokens, f.finish_reason,
                          f.queue_seconds, self.context_tokens, server_ttft=f.ttft_seconds,
                          tokenize_seconds=f.tokenize_seconds)


class _MeshGenerate(_MeshSession):
    """Completions, and chats as Generate calls carrying the whole conversation + session id."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.messages: list[tuple[str, str]] = [("system", self.system)] if self.system else []

    async def turn(self, turn: TurnPlan, observe: Observer, timeout: float) -> TurnResult:
        self.expect(turn)
        user = self.user_text(turn.prompt_tokens)
        chat = self.plan.kind == "chat"
        self.messages.append(("user", user))
        kwargs: dict[str, Any] = {"priority": self.plan.priority, "return_token_ids": True, "timeout": timeout,
                                  "max_tokens": turn.output_tokens, "ignore_eos": True}
        if chat and self.t.chat_api == "messages":
            kwargs.update(messages=list(self.messages), session_id=self.session_id)
        else:
            kwargs["prompt"] = "\n\n".join(text for _, text in self.messages)
            if chat:
                kwargs["session_id"] = self.session_id
        reply: list[str] = []
        result: TurnResult | None = None
        # Read to the end of the stream, past `done`: leaving early would cancel the call, and the
        # router would count an already finished request as cancelled.
        async for event in (await self.t.requests(self.plan.tenant)).stream(**kwargs):
            if isinstance(event, TextDelta):
                observe(len(event.token_ids))
                reply.append(event.text)
            elif isinstance(event, Finished):
                self.messages.append(("assistant", "".join(reply)))
                result = self.result(event)
        if result is None:
            raise Reason.INCOMPLETE_STREAM.error("stream ended without `done`")
        return result


class _MeshChat(_MeshSession):
    """Chats over the bidirectional Chat API (deltas carry their token ids, so ITL is exact)."""

    async def __aenter__(self) -> TargetSession:
        self._cm = self.client.chat(session_id=self.session_id, system=self.system or None,
                                    priority=self.plan.priority, return_token_ids=True)
        self.chat = await self._cm.__aenter__()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._cm.__aexit__(*exc)

    async def turn(self, turn: TurnPlan, observe: Observer, timeout: float) -> TurnResult:
        self.expect(turn)
        async for event in self.chat.send(self.user_text(turn.prompt_tokens), max_tokens=turn.output_tokens,
                                          ignore_eos=True):
            if isinstance(event, TextDelta):
                observe(len(event.token_ids) or None)
            elif isinstance(event, Finished):
                return self.result(event)
        raise Reason.INCOMPLETE_STREAM.error("stream ended without `done`")


# ------------------------------------------------------------------------------------ engine
def _build(pending: dict[str, list[Any]]) -> engine_pb2.EngineInbound:
    return engine_pb2.EngineInbound(submit=pending.get("submit", []), abort=pending.get("abort", []))


def _split(resp: engine_pb2.EngineOutbound) -> list[tuple[str, Any]]:
    return [(c.request_id, c) for c in resp.chunks]


class EngineTarget(Target):
    """One engine_svc over its multiplexed Stream, prompts as random token ids (no router)."""

    name = "engine"

    def __init__(self, address: str, vocab_size: int, *, max_context: int = 0) -> None:
        self.address = address
        self.ids = IdSynth(vocab_size)
        self.max_context = max_context
        self.model = ""
        self._ids = itertools.count()
        self._channel: grpc.aio.Channel | None = None

    async def start(self) -> None:
        self._channel = open_channel(self.address)
        self._stub = engine_pb2_grpc.EngineStub(self._channel)
        self.mux: MuxClient[Any] = MuxClient("engine", self._stub.Stream, _build, _split)
        try:
            load = await self._stub.GetLoad(engine_pb2.LoadRequest(), timeout=10)
        except Exception as exc:  # noqa: BLE001 - turned into the typed "cannot reach" error
            raise Reason.UPSTREAM_UNAVAILABLE.error(f"engine at {self.address} did not answer GetLoad: {exc}") \
                from None
        self.model = load.model
        self.max_context = self.max_context or load.max_context

    async def close(self) -> None:
        if self._channel is not None:
            await self.mux.close()
            await self._channel.close()
            self._channel = None

    def session(self, plan: SessionPlan, run_id: str, unique: bool) -> TargetSession:
        return _EngineSession(self, plan, run_id, unique)

    def next_request_id(self, run_id: str) -> str:
        return f"{run_id}-{next(self._ids)}"

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "address": self.address, "vocab_size": self.ids.vocab_size,
                "model": self.model}


class _EngineSession(TargetSession):
    # Random ids never repeat a prefix across sessions, so `unique` needs no nonce here; it only
    # decides whether a rerun with the same seed sends the same ids again.
    def __init__(self, target: EngineTarget, plan: SessionPlan, run_id: str, unique: bool) -> None:
        self.t = target
        self.plan = plan
        self.run_id = run_id
        self.rng = random.Random(f"{run_id}:{plan.seed}" if unique else plan.seed)
        self.conversation: list[int] = (target.ids.ids(plan.system_tokens, random.Random(_system_seed(plan)))
                                        if plan.system_tokens else [])

    async def turn(self, turn: TurnPlan, observe: Observer, timeout: float) -> TurnResult:
        prompt = self.conversation + self.t.ids.ids(turn.prompt_tokens, self.rng)
        rid = self.t.next_request_id(self.run_id)
        mux = self.t.mux
        queue = mux.open(rid)
        mux.post("submit", engine_pb2.EngineRequest(
            request_id=rid, prompt_token_ids=prompt, cache_salt=self.plan.tenant,
            sampling=common_pb2.SamplingParams(max_tokens=turn.output_tokens, ignore_eos=True)))
        generated: list[int] = []
        cached = 0
        finished = False
        try:
            while True:
                chunk = await queue.get()
                if isinstance(chunk, StreamBroken):
                    finished = True
                    raise chunk.error
                if chunk.error_reason:
                    finished = True
                    raise in_band_error(chunk.error_reason, chunk.error_message, Reason.ENGINE_ERROR)
                cached = cached or chunk.cached_tokens
                if chunk.token_ids:
                    generated.extend(chunk.token_ids)
                    observe(len(chunk.token_ids))
                if chunk.finished:
                    finished = True
                    break
        finally:
            if not finished:
                mux.post("abort", rid)  # cancelled or timed out: free the engine's slot
            mux.release(rid)
        self.conversation = prompt + generated
        self.context_tokens = len(self.conversation)
        return TurnResult(len(prompt), cached, len(generated), FINISH_NAMES.get(chunk.finish_reason, "unknown"),
                          None, self.context_tokens)
