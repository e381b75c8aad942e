"""A mixed-behaviour probe of a whole mesh: what clients do besides asking and reading to the end.

`soak.py` and the chaos test drive well-behaved closed-loop streams; the defects issue 10 lists
(hangs, leaked leases, cross-tenant ids) were found by clients that misbehave. This probe starts a
`tokenrelay up --engine sim` mesh of real processes (2 routers on one port, 2 engines, Redis) with
two tenants and runs `--workers` concurrent clients for `--seconds`, each picking at random:

- `plain`: a Generate read to its end;
- `client_cancel`: a Generate the client cancels 0-80 ms in (before or after its first token);
- `deadline`: a Generate with a 1-60 ms deadline;
- `cancel_rpc`: a Generate cancelled by id through another connection (any router), and the same id
  "cancelled" by the other tenant, which must change nothing;
- `duplicate`: the same request id twice at once by one tenant (one runs, one is refused), and once
  more by the other tenant at the same time (independent: it runs);
- `chat`: a Chat session of 1-3 turns, where a turn may be cancelled (ChatCancel), followed by a
  second turn while it runs (that turn refused, the session goes on), or the whole call cut;
- `bad`: an invalid request (a bound exceeded, a value out of range) that must be refused typed;
- `flood`: tenant b sends twice its max_in_flight at once, so that some queue, and cuts a third of
  them (the client goes away, or a Cancel by id through any router), queued or not.

Checks, printed and returned (exit status 1 on any):
- no call hangs (every call has a 20 s deadline it must not reach) and none ends INTERNAL/UNKNOWN
  or without a tokenrelay reason (no process is killed here);
- every outcome is one its action allows (e.g. `plain` ends `done`; the other tenant's Cancel
  returns false and its victim still ends `done` uncancelled);
- once the load stops, nothing is left held: no lease or queue entry in Redis, every request id
  key there has a TTL, the routers' in-flight, queued, leases and shadow gauges, the engines'
  active and queued requests and KV blocks in use, the tokenizer's open Detokenize requests, all 0;
- then a burst of the tenant's max_in_flight requests is admitted at once (queue position 0).

    python bench/probe_mix.py --seconds 60 --workers 24        # a run (docs/reliability.md)
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import datetime
import hashlib
import json
import os
import pathlib
import random
import re
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import grpc

REPO = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from services.channels import CHANNEL_OPTIONS, open_channel  # noqa: E402
from services.errors import REASON_KEY  # noqa: E402
from services.proto.tokenrelay.v1 import common_pb2, inference_pb2, inference_pb2_grpc  # noqa: E402

HANG = 20.0            # every call's deadline; reaching it means the call hung
MAX_IN_FLIGHT = 16
KEYS = {"a": "trk-probe-a-0123456789", "b": "trk-probe-b-0123456789"}
CANCELLED = common_pb2.FINISH_REASON_CANCELLED
# Typed refusals any request may get while the flood keeps tenant b's queue full or the routers busy.
UNDER_LOAD = {"RESOURCE_EXHAUSTED/TENANT_QUEUE_FULL", "RESOURCE_EXHAUSTED/QUEUE_WAIT_EXCEEDS_DEADLINE",
              "UNAVAILABLE/ROUTER_OVERLOADED"}
ACTIONS = ("plain", "client_cancel", "deadline", "cancel_rpc", "duplicate", "chat", "bad", "flood")
# Lease TTL short, so that anything a bug left held would still show once leases could expire.
UNTYPED = (grpc.StatusCode.INTERNAL.name, grpc.StatusCode.UNKNOWN.name)     # never a right answer
REFUSED_BAD = {c.name for c in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.OUT_OF_RANGE,
                                grpc.StatusCode.RESOURCE_EXHAUSTED)}
# Marks the problems inferred from when this client saw messages (a busy client sees them late).
# `settle` then reads the order of events server-side from the routers' logs: a finding the logs
# explain is dropped (and listed), one they confirm is marked SERVER_TIMED; what they cannot
# decide (lines missing, e.g. a killed router's) stays marked TIMED, which the CI test reports
# without failing.
TIMED = "[client-timed]"
SERVER_TIMED = "[server-timed]"
FAULT_WINDOW = 10.0    # seconds from a fault during which its own failures are allowed
ROUTER_ARGS = ("--router-arg=--lease-ttl=3", "--router-arg=--lease-heartbeat=0.5")
SIM_ARGS = ("--engine-arg=--sim-decode-step-time=0.004", "--tokenizer-arg=--chat-template=chatml")


def tenants_yaml() -> str:
    rows = [f"  - name: {name}\n    api_key_sha256: {hashlib.sha256(key.encode()).hexdigest()}\n"
            f"    max_in_flight: {MAX_IN_FLIGHT}\n    max_queued: 64\n" for name, key in KEYS.items()]
    return "tenants:\n" + "".join(rows)


def _md(tenant: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {KEYS[tenant]}"),)


def _status(err: grpc.aio.AioRpcError) -> str:
    reason = dict(err.trailing_metadata() or ()).get(REASON_KEY, "")
    return f"{err.code().name}/{reason}"


@dataclass
class Seen:
    """How one stream ended as its client saw it."""

    ending: str = ""            # "done", "CODE/REASON" (a status), "client-cancelled"
    finish: int = 0             # the Done's finish reason
    first_token: bool = False
    details: str = ""
    t_accepted: float = 0.0     # when its `accepted` came (0: none)
    t_last_delta: float = 0.0
    t_end: float = 0.0


async def _read(call: Any, seen: Seen) -> Seen:
    try:
        async for msg in call:
            kind = msg.WhichOneof("event")
            if kind == "delta":
                seen.first_token = True
                seen.t_last_delta = time.monotonic()
            elif kind == "accepted" and not seen.t_accepted:
                seen.t_accepted = time.monotonic()
            elif kind == "done":
                seen.ending, seen.finish = "done", msg.done.finish_reason
    except asyncio.CancelledError:
        seen.ending = seen.ending or "client-cancelled"
    except grpc.aio.AioRpcError as err:
        if err.code() == grpc.StatusCode.CANCELLED and not dict(err.trailing_metadata() or ()).get(REASON_KEY):
            seen.ending = seen.ending or "client-cancelled"
        else:
            seen.ending, seen.details = _status(err), (err.details() or "")[:200]
    seen.t_end = time.monotonic()
    return seen


def _generate(rid: str = "", max_tokens: int = 16, prompt: str = "", **fields: Any) -> inference_pb2.GenerateRequest:
    sampling = fields.pop("sampling", None) or common_pb2.SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    return inference_pb2.GenerateRequest(prompt=prompt or "probe the mesh", request_id=rid, sampling=sampling, **fields)


@dataclass
class Timed:
    """A problem inferred from this client's clock, to be checked against the routers' logs."""

    kind: str           # "duplicate": two requests of one id overlapped; "cancel": a Cancel said false
    tenant: str
    request_id: str
    line: str           # its line in `Report.problems`


@dataclass
class Report:
    outcomes: collections.Counter[str] = field(default_factory=collections.Counter)
    problems: list[str] = field(default_factory=list)
    timed: list[Timed] = field(default_factory=list)
    settled: list[str] = field(default_factory=list)    # client-timed findings the logs explained
    calls: int = 0
    fault: str = ""              # "kill:router1", ... (`--fault`)
    fault_at: float = 0.0        # monotonic time it was injected (0: not yet, or none)

    def _faulted(self, ending: str) -> bool:
        """An ending the fault may explain, while its window lasts: every part of it typed (a
        status or turn error with a reason, not INTERNAL/UNKNOWN), where a killed router's own
        streams may also see their connection close (UNAVAILABLE without a reason). Within the
        window only that is checked, not which typed ending the action expects."""
        if not self.fault_at or time.monotonic() > self.fault_at + FAULT_WINDOW:
            return False
        parts = [p.split(" ")[0] for p in ending.split(",")]
        lost = self.fault.startswith("kill:router")
        return any(p != "done" for p in parts) and all(
            (p.partition("/")[2] and not p.startswith(UNTYPED)) or (lost and p == "UNAVAILABLE/")
            or p in ("done", "OK", "client-cancelled") for p in parts)

    def note(self, action: str, ending: str, ok: bool, why: str = "") -> str:
        """`ok`: the outcome is one the action allows. Refusals the load itself explains (the
        `flood` action fills tenant b's queue) are allowed to any action, and the fault's."""
        faulted = self._faulted(ending)
        ok = ok or ending in UNDER_LOAD or faulted
        self.calls += 1
        self.outcomes[f"{action}: {ending}" + (" [fault]" if faulted else "")] += 1
        bad = ending.split("/")[0] in UNTYPED or (ending.endswith("/") and ending != "done")
        if (ending.startswith("DEADLINE_EXCEEDED/") and action == "deadline") or faulted:
            bad = False     # the client's own short deadline (no reason expected), or the fault's
        if (bad or not ok) and len(self.problems) < 40:
            self.problems.append(f"{action}: {ending} {why}".strip())
            return self.problems[-1]
        return ""

    def timed_finding(self, kind: str, tenant: str, request_id: str, line: str) -> None:
        if line and TIMED in line:
            self.timed.append(Timed(kind, tenant, request_id, line))


class Probe:
    def __init__(self, address: str, seed: int) -> None:
        self.rng = random.Random(seed)
        self.report = Report()
        opts = [*CHANNEL_OPTIONS, ("grpc.use_local_subchannel_pool", 1)]
        self.channels = [open_channel(address, options=opts) for _ in range(4)]   # its own connection each
        self.stubs = [inference_pb2_grpc.InferenceStub(c) for c in self.channels]
        self.n = 0

    def stub(self) -> inference_pb2_grpc.InferenceStub:
        return self.rng.choice(self.stubs)

    def rid(self) -> str:
        self.n += 1
        return f"p{self.n}-{self.rng.randrange(1 << 30):x}"

    async def close(self) -> None:
        for c in self.channels:
            await c.close()

    # ---------------------------------------------------------------------------------- actions
    async def plain(self) -> None:
        seen = await _read(self.stub().Generate(_generate(max_tokens=self.rng.randint(1, 32)), metadata=_md("a"),
                                                timeout=HANG), Seen())
        self.report.note("plain", seen.ending, seen.ending == "done", seen.details)

    async def client_cancel(self) -> None:
        call = self.stub().Generate(_generate(max_tokens=64), metadata=_md(self.rng.choice("ab")), timeout=HANG)
        reading = asyncio.ensure_future(_read(call, Seen()))
        await asyncio.sleep(self.rng.uniform(0, 0.08))
        call.cancel()
        seen = await reading
        self.report.note("client_cancel", seen.ending, seen.ending in ("done", "client-cancelled"), seen.details)

    async def deadline(self) -> None:
        seen = await _read(self.stub().Generate(_generate(max_tokens=32), metadata=_md("a"),
                                                timeout=self.rng.uniform(0.001, 0.06)), Seen())
        ok = seen.ending == "done" or seen.ending.startswith("DEADLINE_EXCEEDED/")
        self.report.note("deadline", seen.ending, ok, seen.details)

    async def cancel_rpc(self) -> None:
        rid = self.rid()
        victim = asyncio.ensure_future(_read(self.stub().Generate(_generate(rid, max_tokens=48), metadata=_md("b"),
                                                                  timeout=HANG), Seen()))
        await asyncio.sleep(self.rng.uniform(0, 0.05))
        # The other tenant's Cancel of that id: it must not reach b's request.
        other = await self.stub().Cancel(inference_pb2.CancelRequest(request_id=rid), metadata=_md("a"), timeout=HANG)
        self.report.note("cancel_rpc(other tenant)", f"cancelled={other.cancelled}", not other.cancelled)
        mine = self.rng.random() < 0.7
        acked = False
        t_sent = t_answered = 0.0
        if mine:
            await asyncio.sleep(self.rng.uniform(0, 0.05))
            t_sent = time.monotonic()
            acked = (await self.stub().Cancel(inference_pb2.CancelRequest(request_id=rid), metadata=_md("b"),
                                              timeout=HANG)).cancelled
            t_answered = time.monotonic()
        seen = await victim
        # A Cancel sent after the request's `accepted` (it was registered) that answered "unknown"
        # while the request was still streaming: a lost Cancel. (A request is registered until
        # its last delta has been written, so one arriving after the answer, beyond this client's
        # own 5 ms of reordering, means it was.)
        lost = (mine and not acked and 0 < seen.t_accepted < t_sent and seen.t_last_delta > t_answered + 0.005
                and seen.ending == "done")
        # Cancelled by its own tenant: done (cancelled, or finished first), or CANCELLED while queued;
        # a Cancel that answered `cancelled` must have ended it so. Not cancelled: it runs to its end.
        # (A Cancel that races the request's own end may answer `cancelled` while the request
        # still ends its natural way, finished or refused: it was in flight when the Cancel came.)
        was_cancelled = seen.finish == CANCELLED or seen.ending == "CANCELLED/CANCELLED"
        ended = seen.ending == "done" or seen.ending in UNDER_LOAD or (mine and seen.ending == "CANCELLED/CANCELLED")
        ok = ended and (acked or not was_cancelled) and not lost
        late = f"(a delta {1e3 * (seen.t_last_delta - t_answered):.0f} ms after the answer) {TIMED}" if lost else ""
        line = self.report.note("cancel_rpc" + ("" if mine else "(only the other tenant)"),
                                seen.ending + ("/cancelled" if seen.finish == CANCELLED else "")
                                + (f" (Cancel said {acked})" if mine else ""), ok, seen.details + late)
        self.report.timed_finding("cancel", "b", rid, line)

    async def duplicate(self) -> None:
        rid = self.rid()

        def one(tenant: str) -> Awaitable[Seen]:
            return _read(self.stub().Generate(_generate(rid, max_tokens=24), metadata=_md(tenant), timeout=HANG),
                         Seen())
        first, second, other = await asyncio.gather(one("a"), one("a"), one("b"))
        endings = sorted([first.ending, second.ending])
        # One runs, one is refused; both may run only one after the other (an id is unique while
        # in flight). A request frees its id after its last delta was written and before its
        # `done` (which a busy router may write much later), so the second must have been
        # accepted after the first's last delta came (5 ms for this client's own reordering).
        a, b = sorted((first, second), key=lambda x: x.t_accepted)
        ok = endings == ["INVALID_ARGUMENT/DUPLICATE_REQUEST_ID", "done"] or (
            endings == ["done", "done"] and b.t_accepted > a.t_last_delta - 0.005)
        early_ms = 1e3 * (a.t_last_delta - b.t_accepted)
        overlap = "" if ok else f"(accepted {early_ms:.1f} ms before the other's last delta) {TIMED}"
        line = self.report.note("duplicate(same tenant)", " + ".join(endings), ok,
                                first.details + second.details + overlap)
        self.report.timed_finding("duplicate", "a", rid, line)
        self.report.note("duplicate(other tenant)", other.ending, other.ending == "done", other.details)

    async def chat(self) -> None:
        outgoing: asyncio.Queue[inference_pb2.ChatRequest | None] = asyncio.Queue()

        async def requests():   # type: ignore[no-untyped-def]
            while (item := await outgoing.get()) is not None:
                yield item
        call = self.stub().Chat(requests(), metadata=_md(self.rng.choice("ab")), timeout=HANG)
        turns = self.rng.randint(1, 3)
        cut = self.rng.random() < 0.2
        outgoing.put_nowait(inference_pb2.ChatRequest(start=inference_pb2.ChatStart(
            system=[common_pb2.ChatMessage(role="system", content="be brief")])))

        def turn(text: str) -> inference_pb2.ChatRequest:
            return inference_pb2.ChatRequest(turn=inference_pb2.ChatTurn(
                messages=[common_pb2.ChatMessage(role="user", content=text)],
                sampling=common_pb2.SamplingParams(max_tokens=self.rng.randint(4, 40), ignore_eos=True)))
        endings: list[str] = []
        try:
            it = call.__aiter__()
            first = await it.__anext__()
            if first.WhichOneof("event") != "started":
                endings.append("no-started")
            for t in range(turns):
                outgoing.put_nowait(turn(f"turn {t} of the probe"))
                extra = self.rng.random()
                if extra < 0.25:
                    await asyncio.sleep(self.rng.uniform(0, 0.03))
                    outgoing.put_nowait(inference_pb2.ChatRequest(cancel=inference_pb2.ChatCancel()))
                elif extra < 0.4:
                    outgoing.put_nowait(turn("a turn while one runs"))
                elif cut and t == turns - 1:
                    await asyncio.sleep(self.rng.uniform(0, 0.03))
                    call.cancel()
                # This turn's end (done or turn_error), and a turn_error for the extra turn if sent.
                want = 2 if 0.25 <= extra < 0.4 else 1
                while want:
                    msg = await it.__anext__()
                    kind = msg.WhichOneof("event")
                    if kind == "done":
                        endings.append("done/cancelled" if msg.done.finish_reason == CANCELLED else "done")
                        want -= 1
                    elif kind == "turn_error":
                        reason = msg.turn_error.reason
                        endings.append(f"turn_error/{reason}" if f"{msg.turn_error.code}/{reason}" not in UNDER_LOAD
                                       else "turn_error/(load)")
                        want -= 1
            outgoing.put_nowait(None)
            async for _ in it:
                endings.append("unexpected-message")
            endings.append("OK")
        except StopAsyncIteration:
            endings.append("OK(early)")
        except asyncio.CancelledError:
            endings.append("client-cancelled")
        except grpc.aio.AioRpcError as err:
            if err.code() == grpc.StatusCode.CANCELLED and cut:
                endings.append("client-cancelled")
            else:
                endings.append(_status(err) + " " + (err.details() or "")[:120])
        # A turn cancelled while queued ends with a CANCELLED turn error; the session goes on.
        allowed = {"done", "done/cancelled", "turn_error/TURN_IN_PROGRESS", "turn_error/CANCELLED",
                   "turn_error/(load)", "OK", "client-cancelled"}
        ok = set(endings) <= allowed and endings[-1] in ("OK", "client-cancelled")
        self.report.note("chat", ",".join(sorted(set(endings))), ok)

    async def bad(self) -> None:
        choice = self.rng.randrange(6)
        if choice == 0:
            req = _generate(sampling=common_pb2.SamplingParams(max_tokens=1 << 30))   # beyond the context
        elif choice == 1:
            req = _generate(sampling=common_pb2.SamplingParams(max_tokens=8, top_p=2.0))
        elif choice == 2:
            req = _generate(session_id="s" * (1 << 20))
        elif choice == 3:
            req = _generate(rid="r" * 5000)
        elif choice == 4:
            req = _generate(sampling=common_pb2.SamplingParams(max_tokens=8, stop=["x" * 10] * 5000))
        else:
            req = inference_pb2.GenerateRequest(token_ids=inference_pb2.TokenIds(ids=[1 << 30]),
                                                sampling=common_pb2.SamplingParams(max_tokens=8))
        seen = await _read(self.stub().Generate(req, metadata=_md("a"), timeout=HANG), Seen())
        code, _, reason = seen.ending.partition("/")
        ok = code in REFUSED_BAD and bool(reason)
        self.report.note(f"bad#{choice}", seen.ending, ok, seen.details)

    async def flood(self) -> None:
        async def one(cut: str) -> tuple[str, Seen]:
            rid = self.rid()
            call = self.stub().Generate(_generate(rid, max_tokens=32), metadata=_md("b"), timeout=HANG)
            reading = asyncio.ensure_future(_read(call, Seen()))
            if cut:
                await asyncio.sleep(self.rng.uniform(0, 0.1))
                if cut == "client":
                    call.cancel()
                else:
                    await self.stub().Cancel(inference_pb2.CancelRequest(request_id=rid), metadata=_md("b"),
                                             timeout=HANG)
            return cut, await reading
        cuts = [self.rng.choice(("", "", "", "", "client", "cancel")) for _ in range(2 * MAX_IN_FLIGHT)]
        for cut, seen in await asyncio.gather(*(one(c) for c in cuts)):
            # Not cut: done (or the tenant's queue full, typed). Cut: ended either way, no hang.
            allowed = {"done", "RESOURCE_EXHAUSTED/TENANT_QUEUE_FULL"} | ({"client-cancelled"} if cut else set())
            ending = seen.ending + ("/cancelled" if seen.finish == CANCELLED else "")
            if cut == "cancel" and seen.ending.startswith("CANCELLED/"):
                allowed.add(seen.ending)      # cancelled while queued: a status with its reason
            self.report.note(f"flood({cut or 'kept'})", ending, seen.ending in allowed and
                             (bool(cut) or seen.finish != CANCELLED), seen.details)

    # ------------------------------------------------------------------------------------- load
    async def run(self, seconds: float, workers: int, only: tuple[str, ...] = ACTIONS) -> Report:
        actions: dict[str, Callable[[], Awaitable[None]]] = {a: getattr(self, a) for a in only}
        end = time.monotonic() + seconds

        async def worker() -> None:
            while time.monotonic() < end:
                name = self.rng.choice(only)
                try:
                    await actions[name]()
                except grpc.aio.AioRpcError as err:    # a unary Cancel's status, or a stream's own
                    self.report.note(name, _status(err), False, (err.details() or "")[:200])
        await asyncio.gather(*(worker() for _ in range(workers)))
        return self.report


# ---------------------------------------------------------------------------------- quiescence
def held(state: dict[str, Any]) -> dict[str, float]:
    """What every process still holds: the gauges that must return to 0 once the load stops."""
    from tests.meshkit import scrape
    gauges = {"tokenrelay_router_in_flight", "tokenrelay_router_queued", "tokenrelay_router_process_in_flight",
              "tokenrelay_router_leases_held", "tokenrelay_router_shadow_in_flight",
              "tokenrelay_engine_active_requests", "tokenrelay_engine_queued_requests",
              "tokenrelay_engine_kv_blocks_used", "tokenrelay_tokenizer_detok_open_requests"}
    out: dict[str, float] = collections.defaultdict(float)
    for name, url in state["metrics"].items():
        for (metric, _), value in scrape(url).items():
            if metric in gauges:
                out[f"{name}:{metric}"] += value
    return dict(out)


async def redis_held(redis_url: str) -> dict[str, int]:
    import redis.asyncio as aioredis
    r = aioredis.from_url(redis_url)
    try:
        queued = 0
        async for key in r.scan_iter(match="tq:{default}:cq:*"):
            queued += int(await r.zcard(key))
        no_ttl = 0
        async for key in r.scan_iter(match="tr:{default}:rid:*"):
            no_ttl += int(await r.ttl(key)) == -1
        return {"leases": int(await r.zcard("tq:{default}:leases")), "queued": queued, "rid_keys_without_ttl": no_ttl}
    finally:
        await r.aclose()


async def _all_up(state_file: pathlib.Path, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        services = json.loads(state_file.read_text())["services"]
        if all(s["state"] == "up" for s in services.values()):
            return
        await asyncio.sleep(0.2)


async def quiesce(state: dict[str, Any], timeout: float = 15.0) -> list[str]:
    """Poll until nothing is held (or `timeout`); what is still held then, one line each."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            left = {k: v for k, v in held(state).items() if v}
            left.update({f"redis:{k}": v for k, v in (await redis_held(state["redis_url"])).items() if v})
        except Exception as exc:  # noqa: BLE001 - a restarted service not serving yet
            left = {f"unreachable ({type(exc).__name__})": 1.0}
        if not left or time.monotonic() > deadline:
            return [f"still held after the load: {k} = {v:g}" for k, v in sorted(left.items())]
        await asyncio.sleep(0.5)


async def burst(address: str) -> list[str]:
    """The tenant's max_in_flight requests at once: every one admitted at position 0, and done."""
    async with open_channel(address) as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)

        async def one(i: int) -> str:
            positions: list[int] = []
            try:
                async for msg in stub.Generate(_generate(f"burst-{i}-{time.time_ns()}", max_tokens=4),
                                               metadata=_md("a"), timeout=HANG):
                    if msg.WhichOneof("event") == "accepted":
                        positions.append(msg.accepted.queue_position)
                    elif msg.WhichOneof("event") == "done":
                        return "ok" if max(positions or [0]) == 0 else f"queued at {max(positions)}: capacity leaked"
            except grpc.aio.AioRpcError as err:
                return _status(err)
            return "no done"
        results = await asyncio.gather(*(one(i) for i in range(MAX_IN_FLIGHT)))
    return [f"burst: {r}" for r in results if r != "ok"]


async def inject(state_file: pathlib.Path, report: Report, after: float) -> None:
    """`report.fault` after `after` seconds: `kill:NAME` (SIGKILL; `tokenrelay up` restarts it) or
    `stop:NAME` (SIGSTOP for 3 s), NAME a service of the state file (router1, engine0, redis, ...)."""
    await asyncio.sleep(after)
    how, _, name = report.fault.partition(":")
    pid = int(json.loads(state_file.read_text())["services"][name]["pid"])
    report.fault_at = time.monotonic()
    if how == "kill":
        os.kill(pid, signal.SIGKILL)
    else:
        os.kill(pid, signal.SIGSTOP)
        await asyncio.sleep(3.0)
        os.kill(pid, signal.SIGCONT)


async def probe_mesh(state: dict[str, Any], seconds: float, workers: int, seed: int, fault: str = "",
                     state_file: pathlib.Path | None = None,
                     only: tuple[str, ...] = ACTIONS) -> tuple[Report, list[str]]:
    probe = Probe(state["router"], seed)
    probe.report.fault = fault
    faulting = asyncio.ensure_future(inject(state_file, probe.report, seconds / 2)) if fault and state_file else None
    try:
        report = await probe.run(seconds, workers, only)
    finally:
        await probe.close()
        if faulting is not None:
            await faulting
    if state_file is not None:   # a restarted service's metrics port is a new one
        state = {**state, **json.loads(state_file.read_text())}
        await _all_up(state_file)
    leftovers = await quiesce(state)
    return report, leftovers + (await burst(state["router"]) if not leftovers else [])


def logged_tracebacks(run_dir: pathlib.Path) -> list[str]:
    """The first traceback of each service's log (with the lines before it), if any."""
    found = []
    for f in sorted(run_dir.rglob("*.log")):
        text = f.read_text(errors="replace")
        if "Traceback" in text:
            at = text.index("Traceback")
            found.append(f"traceback in {f.name}:\n{text[max(0, at - 300):at + 2500]}")
    return found


_LOG_LINE = re.compile(r"^(\S+Z) \[\w+\s*\] (request_done|cancel_answered) (.*)$")
_FIELD = re.compile(r"(\w+)=(\S+)")


def router_events(run_dir: pathlib.Path) -> dict[tuple[str, str], list[tuple[str, float, dict[str, str]]]]:
    """Every router's `request_done` and `cancel_answered` lines, by (tenant, request id): the
    event, its wall-clock time (one host: one clock) and its fields."""
    out: dict[tuple[str, str], list[tuple[str, float, dict[str, str]]]] = collections.defaultdict(list)
    for f in sorted(run_dir.rglob("router*.log")):
        for line in f.read_text(errors="replace").splitlines():
            m = _LOG_LINE.match(line)
            if m is None:
                continue
            fields = dict(_FIELD.findall(m.group(3)))
            when = datetime.datetime.fromisoformat(m.group(1).replace("Z", "+00:00")).timestamp()
            out[(fields.get("tenant", ""), fields.get("request_id", ""))].append((m.group(2), when, fields))
    return out


def _server_order(t: Timed, events: list[tuple[str, float, dict[str, str]]]) -> float | None:
    """How long (s) before the later event the earlier one happened, server-side; negative when the
    order is wrong; None when the logs cannot tell. Duplicate: the second request's claim of the id
    after the first's end (its last delta written; its id is freed after that). Cancel: a Cancel
    answered "not in flight" after its request's end."""
    dones = [(when, fields) for event, when, fields in events if event == "request_done"]
    if t.kind == "duplicate":
        spans = []
        for when, fields in dones:
            if fields.get("claimed_ms", "None") == "None":
                return None
            arrival = when - float(fields["total_ms"]) / 1e3
            spans.append((arrival + float(fields["claimed_ms"]) / 1e3, when))
        if len(spans) != 2:
            return None
        (_, first_end), (second_claim, _) = sorted(spans)
        return second_claim - first_end
    answers = [when for event, when, fields in events
               if event == "cancel_answered" and fields.get("cancelled") == "False"]
    if len(dones) != 1 or not answers:
        return None
    return min(answers) - dones[0][0]


def settle(report: Report, run_dir: pathlib.Path) -> None:
    """Check each client-timed finding against the routers' logs (see TIMED)."""
    events = router_events(run_dir)
    for t in report.timed:
        margin = _server_order(t, events[(t.tenant, t.request_id)])
        if margin is None or t.line not in report.problems:
            continue
        i = report.problems.index(t.line)
        what, end = (("the second claimed the id", "the first request's end") if t.kind == "duplicate"
                     else ("the Cancel was answered", "its request's end"))
        if margin > 0:
            report.problems.pop(i)
            report.settled.append(f"{t.line.replace(TIMED, '').strip()}: {what} {1e3 * margin:.1f} ms after "
                                  f"{end}, in the routers' logs")
        else:
            report.problems[i] = t.line.replace(TIMED, f"{SERVER_TIMED}: {what} {-1e3 * margin:.1f} ms before {end}")


def start(tmp: pathlib.Path, model: pathlib.Path, routers: int = 2, engines: int = 2) -> Any:
    """The probe's mesh (tests.meshkit.RunningMesh): two tenants, short leases, a paced sim."""
    from tests.meshkit import start_mesh
    (tmp / "tenants.yaml").write_text(tenants_yaml())
    return start_mesh(tmp, model, "sim", "--routers", str(routers), "--engines", str(engines),
                      "--tenants-file", str(tmp / "tenants.yaml"), *ROUTER_ARGS, *SIM_ARGS)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seconds", type=float, default=30.0)
    p.add_argument("--workers", type=int, default=16)
    p.add_argument("--routers", type=int, default=2)
    p.add_argument("--engines", type=int, default=2)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--fault", default="", help="at half time: kill:NAME (SIGKILL) or stop:NAME (SIGSTOP 3 s), NAME "
                   "a service of the mesh (router, router1, engine, engine1, tokenizer, redis)")
    p.add_argument("--actions", default=",".join(ACTIONS), help="the actions to draw from, comma-separated")
    p.add_argument("--keep", default="", help="copy the mesh's logs to this directory")
    p.add_argument("--json", default="", help="write the outcomes and problems here")
    args = p.parse_args(argv)
    how, _, fault_name = args.fault.partition(":")
    if args.fault and (how not in ("kill", "stop") or not fault_name):
        p.error(f"--fault {args.fault!r}: give kill:NAME or stop:NAME")
    from tests.meshkit import stop_mesh
    from tests.tiny_model import build_model
    with tempfile.TemporaryDirectory() as tmp_s:
        tmp = pathlib.Path(tmp_s)
        mesh = start(tmp, build_model(tmp / "model"), args.routers, args.engines)
        try:
            services = sorted(json.loads((tmp / "state.json").read_text())["services"])
            if args.fault and fault_name not in services:
                p.error(f"--fault {args.fault!r}: no service {fault_name!r} in this mesh ({', '.join(services)})")
            report, leftovers = asyncio.run(probe_mesh(mesh.state, args.seconds, args.workers, args.seed,
                                                       args.fault, tmp / "state.json",
                                                       tuple(args.actions.split(","))))
        finally:
            rc = stop_mesh(mesh)
        tracebacks = logged_tracebacks(tmp / "run")
        settle(report, tmp / "run")
        if args.keep:
            shutil.copytree(tmp / "run", args.keep, dirs_exist_ok=True)
    problems = report.problems + leftovers + tracebacks + ([] if rc == 0 else [f"tokenrelay up exited {rc}"])
    for outcome, n in sorted(report.outcomes.items()):
        print(f"{n:6d}  {outcome}")
    for line in report.settled:
        print("SETTLED", line)
    print(f"{report.calls} outcomes; {len(problems)} problems")
    for line in problems:
        print("PROBLEM", line)
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps({"outcomes": report.outcomes, "problems": problems}, indent=1))
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
