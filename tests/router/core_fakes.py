"""Fakes of the request core's ports (no network): scripted engines, a detokenizer, admission."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass, field

from router_svc.pipeline import Ports, Router, RouterOptions
from router_svc.ports import AdmitRequest, ReplicaSnapshot
from router_svc.tenants import Tenant
from router_svc.types import DetokOut, EngineChunk, Sampling, TokenizerMeta, Usage
from services.errors import Reason, TokenrelayError
from services.mux import Inbox, StreamBroken

TENANT = Tenant(name="t", api_key_sha256="0" * 64)
OTHER = Tenant(name="u", api_key_sha256="1" * 64)
META = TokenizerMeta("fake", 1000, [2], None, 4096, True)


class FakeTokenizer:
    def __init__(self) -> None:
        self.meta = META
        self.gate: asyncio.Event | None = None   # when set: tokenize waits for it
        self.calls = 0
        self.cache_keys: list[str] = []

    async def tokenize(self, *, text: str | None = None, messages: list[tuple[str, str]] | None = None,
                       timeout: float | None = None, cache_key: str = "",
                       allow_special_tokens: bool = False) -> list[int]:
        self.calls += 1
        self.cache_keys.append(cache_key)
        if self.gate is not None:
            await self.gate.wait()
        source = text if text is not None else "".join(c for _, c in messages or [])
        return [10 + (ord(ch) % 50) for ch in source] or [10]


class FakeDetokSession:
    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self.queue: asyncio.Queue[object] = asyncio.Queue()
        self.closed: bool | None = None
        self.started = False

    def start(self, stop: list[str], include_stop: bool, prefix_ids: list[int],
              trace_context: dict[str, str]) -> None:
        self.started = True

    def send(self, token_ids: list[int], final: bool) -> None:
        self.queue.put_nowait(DetokOut("".join(f"<{t}>" for t in token_ids), final))

    async def next_ready(self) -> list[object]:
        items = [await self.queue.get()]
        while not self.queue.empty():
            items.append(self.queue.get_nowait())
        return items

    def fail(self, error: Exception) -> None:
        self.queue.put_nowait(StreamBroken(error))  # type: ignore[arg-type]

    def close(self, flushed: bool) -> None:
        self.closed = flushed


class FakeDetokenize:
    def __init__(self) -> None:
        self.sessions: dict[str, FakeDetokSession] = {}

    def detokenizer(self, request_id: str) -> FakeDetokSession:
        session = self.sessions[request_id] = FakeDetokSession(request_id)
        return session


class FakeSource:
    def __init__(self) -> None:
        self.queue: asyncio.Queue[object] = asyncio.Queue()

    async def get(self) -> object:
        return await self.queue.get()

    def tokens(self, *ids: int, finished: bool = False) -> None:
        self.queue.put_nowait(EngineChunk(list(ids), finished, "length" if finished else ""))

    def error(self, reason: Reason, message: str = "") -> None:
        self.queue.put_nowait(EngineChunk([], True, "", 0, str(reason), message or str(reason)))

    def broken(self) -> None:
        self.queue.put_nowait(StreamBroken(Reason.UPSTREAM_UNAVAILABLE.error("stream broke")))


class InboxSource:
    """A chunk source on a real `services.mux.Inbox`, fed the way `MuxClient._read` feeds one: an
    item goes to the consumer's sink while nothing is buffered (and the sink takes it), else it is
    buffered and the consumer woken. `sunk` counts what went through the sink."""

    def __init__(self) -> None:
        self.inbox: Inbox[EngineChunk] = Inbox()
        self.sunk = 0

    @property
    def sink(self) -> object:
        return self.inbox.sink

    @sink.setter
    def sink(self, fn: object) -> None:
        self.inbox.sink = fn  # type: ignore[assignment]

    async def get(self) -> object:
        return await self.inbox.get()

    def tokens(self, *ids: int, finished: bool = False, cached: int = 0) -> None:
        chunk = EngineChunk(list(ids), finished, "length" if finished else "", cached_tokens=cached)
        take = self.inbox.sink
        if take is not None and self.inbox.empty() and take(chunk):
            self.sunk += 1
            return
        self.inbox.put_nowait(chunk)


# What a replica does with each submitted request: "ok" (3 tokens then done), "hang", "broken",
# an in-band Reason, "manual" (the test drives the FakeSource) or "inbox" (the test drives an
# InboxSource: the sink path of the real mux).
@dataclass
class FakeReplica:
    address: str
    behaviour: list[object] = field(default_factory=lambda: ["ok"])
    healthy: bool = True
    serving: bool = True
    in_flight: int = 0
    submitted: list[str] = field(default_factory=list)
    prompts: list[tuple[list[int], int]] = field(default_factory=list)   # (prompt, max_tokens) per submit
    pushed_down: list[tuple[float, int]] = field(default_factory=list)   # (timeout, priority) per submit
    aborted: list[str] = field(default_factory=list)
    released: list[str] = field(default_factory=list)
    sources: dict[str, FakeSource] = field(default_factory=dict)


def uid(c: Core, request_id: str, tenant: str = "t") -> str:
    """The upstream id of a live request (what the engine and detokenizer see)."""
    state = c.router.live(tenant, request_id)
    assert state is not None
    return state.upstream_id


class FakeEngines:
    def __init__(self, *replicas: FakeReplica) -> None:
        self.replicas = {r.address: r for r in replicas}
        self.failed: list[str] = []

    def snapshots(self) -> Sequence[ReplicaSnapshot]:
        return [ReplicaSnapshot(r.address, r.healthy, r.serving, r.in_flight) for r in self.replicas.values()]

    @property
    def max_context(self) -> int:
        return 4096

    def submit(self, address: str, request_id: str, prompt: list[int], sampling: Sampling,
               eos_ids: list[int], cache_salt: str, trace_context: dict[str, str], *,
               timeout: float = 0.0, priority: int = 0) -> FakeSource | InboxSource:
        r = self.replicas[address]
        r.pushed_down.append((timeout, priority))
        r.submitted.append(request_id)
        r.prompts.append((list(prompt), sampling.max_tokens))
        r.in_flight += 1
        what = r.behaviour.pop(0) if len(r.behaviour) > 1 else r.behaviour[0]
        if what == "inbox":
            inbox = r.sources[request_id] = InboxSource()   # type: ignore[assignment]
            return inbox
        source = r.sources[request_id] = FakeSource()
        if what == "ok":
            source.tokens(101, 102)
            source.tokens(103, finished=True)
        elif what == "broken":
            source.broken()
        elif isinstance(what, Reason):
            source.error(what)
        return source

    def abort(self, address: str, request_id: str) -> None:
        self.replicas[address].aborted.append(request_id)

    def release(self, address: str, request_id: str) -> None:
        r = self.replicas[address]
        if request_id not in r.released:
            r.in_flight -= 1
        r.released.append(request_id)

    def mark_failed(self, address: str) -> None:
        self.failed.append(address)
        self.replicas[address].healthy = False

    def heard(self, address: str) -> float:
        return 0.0   # the fakes' streams carry nothing besides the request's own chunks


class FakeGrant:
    def __init__(self, admission: FakeAdmission, key: tuple[str, str]) -> None:
        self.admission, self.key = admission, key

    async def settle(self, usage: Usage) -> None:
        self.admission.held.discard(self.key)


class FakeAdmitting:
    """Granted at once (the fake has no queue)."""

    def __init__(self, grant: FakeGrant) -> None:
        self.grant: FakeGrant | None = grant
        self.position = 0

    async def next(self) -> None:
        raise AssertionError("a granted request does not wait")

    def cancel(self) -> None:
        return None

    async def abandon(self) -> None:
        return None


class FakeAdmission:
    def __init__(self) -> None:
        self.held: set[tuple[str, str]] = set()
        self.gate: asyncio.Event | None = None
        self.refuse: TokenrelayError | None = None
        self.requests: list[AdmitRequest] = []
        self.prechecked: list[AdmitRequest] = []
        self.known_refusal: TokenrelayError | None = None   # what precheck raises...
        self.refused_from = 0                                # ...for requests of this cost or more

    def precheck(self, request: AdmitRequest) -> None:
        self.prechecked.append(request)
        if self.known_refusal is not None and request.cost >= self.refused_from:
            raise self.known_refusal

    def predicts_refusal(self, request: AdmitRequest) -> bool:
        return self.known_refusal is not None and request.cost >= self.refused_from

    async def admit(self, request: AdmitRequest) -> FakeAdmitting:
        self.requests.append(request)
        if self.gate is not None:
            await self.gate.wait()
        if self.refuse is not None:
            raise self.refuse
        key = (request.tenant, request.request_id)
        self.held.add(key)
        return FakeAdmitting(FakeGrant(self, key))


@dataclass
class Core:
    router: Router
    tokenizer: FakeTokenizer
    detok: FakeDetokenize
    engines: FakeEngines
    admission: FakeAdmission


def core(*replicas: FakeReplica, admission: object = None, **options: object) -> Core:
    """A router over fakes; `admission` replaces the fake admission (e.g. a real queue)."""
    tok, detok = FakeTokenizer(), FakeDetokenize()
    admission = admission if admission is not None else FakeAdmission()
    engines = FakeEngines(*(replicas or (FakeReplica("e1"),)))
    router = Router(Ports(tok, detok, engines, admission), RouterOptions(**options))  # type: ignore[arg-type]
    return Core(router, tok, detok, engines, admission)
