"""One owner of a request's state, and the in-process request registry.

`RequestState` is what every stage of the pipeline reads and updates: who asked (tenant-scoped
id), how urgent (priority, absolute deadline), what it costs (prompt + max_tokens), what was
generated, where it runs (replica, attempts) and when things happened (t_arrival is when the
servicer got the call, so TTFT and queue time include any wait before the handler ran).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from services.errors import Reason, TokenrelayError

from .types import GenerateInput, Sampling, Timings, Usage


@dataclass
class RequestState:
    tenant: str
    request_id: str
    inp: GenerateInput
    priority: int
    deadline: float                       # absolute, time.monotonic()
    t_arrival: float                      # when the servicer got the call
    prompt_ids: list[int] = field(default_factory=list)
    generated: list[int] = field(default_factory=list)
    usage: Usage = field(default_factory=Usage)
    timings: Timings = field(default_factory=Timings)
    replica: str = ""                     # the attempt's replica address ("" before placement)
    attempts: list[str] = field(default_factory=list)   # replicas tried, in order
    pool: str = ""                        # the engine pool chosen for it ("" = any)
    migrations: int = 0                   # times it moved to another replica after its first token
    migration_reason: str = ""            # why the last move happened (a registry reason)
    migration_tokens: int = 0             # tokens generated before the last move
    last_error: TokenrelayError | None = None
    error: TokenrelayError | None = None  # how the engine stage failed, if it did
    engine_done: bool = False
    finish_reason: str = "length"
    t_tokenized: float = 0.0
    t_claimed: float = 0.0                # when its id claim was answered (0: not claimed)
    t_admitted: float = 0.0
    t_first: float | None = None
    cancelled: asyncio.Event = field(default_factory=asyncio.Event)
    # The session's replica, asked for when the request arrived (a Redis round trip with several
    # routers), so that placement does not wait for it after tokenization and admission.
    sticky: asyncio.Future[str] | None = field(default=None, repr=False)
    # The id on the engine and detokenizer streams: unique per request, so two tenants' (or two
    # routers') identical client ids never meet upstream.
    upstream_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    # The texts of its client deltas, kept when its chat will be tokenized ahead of its next turn
    # (`Router._prefetch`); None otherwise.
    reply: list[str] | None = field(default=None, repr=False)

    @property
    def key(self) -> tuple[str, str]:
        """The tenant-scoped id."""
        return (self.tenant, self.request_id)

    @property
    def cost(self) -> int:
        """Tokens this request may occupy: prompt + max_tokens (an estimate before tokenizing)."""
        return len(self.prompt_ids) + self.inp.sampling.max_tokens

    @property
    def is_cancelled(self) -> bool:
        return self.cancelled.is_set()

    @property
    def first_token_seen(self) -> bool:
        return bool(self.generated)

    def continuation(self) -> tuple[list[int], Sampling]:
        """What an attempt submits: the prompt and sampling, or after a migration the prompt plus
        every token already generated with the token budget that is left."""
        if not self.generated:
            return self.prompt_ids, self.inp.sampling
        return ([*self.prompt_ids, *self.generated],
                replace(self.inp.sampling, max_tokens=self.inp.sampling.max_tokens - len(self.generated)))

    def remaining(self) -> float:
        return max(0.0, self.deadline - time.monotonic())

    def check_deadline(self) -> None:
        if time.monotonic() >= self.deadline:
            raise Reason.DEADLINE_EXCEEDED.error("the request's deadline passed")

    def cancel(self) -> None:
        self.cancelled.set()


class PromptEstimate:
    """A text or chat request's prompt tokens before it is tokenized, from the tokens per character
    this router has seen for that kind of input (an exponential average over the last ~`1/alpha`):
    admission can then run while the prompt is tokenized. None until `warm` inputs of the kind were
    seen, and for token-id input (its count is known)."""

    def __init__(self, warm: int = 16, alpha: float = 0.1) -> None:
        self.warm, self.alpha = warm, alpha
        self._ratio: dict[str, float] = {}
        self._seen: dict[str, int] = {}

    @staticmethod
    def _chars(inp: GenerateInput) -> tuple[str, int]:
        if inp.prompt is not None:
            return "text", len(inp.prompt)
        if inp.messages is not None:
            return "chat", sum(len(role) + len(content) for role, content in inp.messages)
        return "", 0

    def observe(self, inp: GenerateInput, tokens: int) -> None:
        kind, chars = self._chars(inp)
        if not kind or chars <= 0:
            return
        ratio = tokens / chars
        old = self._ratio.get(kind)
        self._ratio[kind] = ratio if old is None else old + self.alpha * (ratio - old)
        self._seen[kind] = self._seen.get(kind, 0) + 1

    def tokens(self, inp: GenerateInput) -> int | None:
        kind, chars = self._chars(inp)
        if not kind or self._seen.get(kind, 0) < self.warm:
            return None
        return max(1, round(self._ratio[kind] * chars))


class _Held:
    """One held id: its stages' cancel callbacks, and whether it was cancelled already (a stage
    that registers later is told at once: a Cancel may come between the claim and the first
    registration)."""

    __slots__ = ("callbacks", "cancelled")

    def __init__(self) -> None:
        self.callbacks: list[Callable[[], None]] = []
        self.cancelled = False


class LocalRequestRegistry:
    """`ports.RequestRegistry` for one router process: (tenant, id) → cancel callbacks.

    Atomic by construction (one event loop, no await between test and set). Tenants never see
    each other's ids: the key is the pair."""

    remote = False      # claims are answered here, at once

    def __init__(self) -> None:
        self._held: dict[tuple[str, str], _Held] = {}

    def __len__(self) -> int:
        return len(self._held)

    def pairs(self) -> list[tuple[str, str]]:
        return list(self._held)

    # The synchronous steps, shared with the Redis-backed registry (router_svc.cluster), which keeps
    # its local view in one of these.
    def take(self, tenant: str, request_id: str) -> bool:
        key = (tenant, request_id)
        if key in self._held:
            return False
        self._held[key] = _Held()
        return True

    def holds(self, tenant: str, request_id: str) -> bool:
        return (tenant, request_id) in self._held

    def drop(self, tenant: str, request_id: str) -> bool:
        """Forget the id; whether it was held."""
        return self._held.pop((tenant, request_id), None) is not None

    def clear(self) -> None:
        self._held.clear()

    def cancel_held(self, tenant: str, request_id: str) -> bool:
        held = self._held.get((tenant, request_id))
        if held is None:
            return False
        held.cancelled = True
        for callback in list(held.callbacks):
            callback()
        return True

    async def claim(self, tenant: str, request_id: str) -> bool:
        return self.take(tenant, request_id)

    async def release(self, tenant: str, request_id: str, wait: bool = True) -> None:
        self.drop(tenant, request_id)

    async def cancel(self, tenant: str, request_id: str) -> bool:
        return self.cancel_held(tenant, request_id)

    def on_cancel(self, tenant: str, request_id: str, callback: Callable[[], None]) -> None:
        held = self._held.get((tenant, request_id))
        if held is not None:
            held.callbacks.append(callback)
            if held.cancelled:
                callback()
