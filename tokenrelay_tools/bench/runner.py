"""Drive one target with one workload, open or closed loop, and record every request's timings.

The runner owns every task it starts (one per open-loop session, or ``concurrency`` closed-loop
workers) and ends them itself: it stops issuing requests when the duration passes, the request
budget is spent or the workload (a trace) runs out; in-flight requests then get
``drain_timeout`` seconds to finish before they are cancelled and recorded as such. Timings are
taken on the client: TTFT from send to the first delta, inter-token latency from the gaps
between deltas divided by the tokens each delta carries, end-to-end to the final message.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import random
import time
import uuid
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import grpc

from services.errors import Reason, TokenrelayError

from .arrivals import open_loop_times
from .targets import Target, TargetSession, TurnResult
from .workload import SessionPlan, SessionSampler, TurnPlan, Workload


@dataclass
class RunConfig:
    duration: float | None = 60.0       # stop issuing after this many seconds (None = no time limit)
    requests: int | None = None         # stop after issuing this many requests (None = no limit)
    seed: int | None = None             # None = the workload's seed
    length_scale: float = 1.0
    request_timeout: float = 60.0
    drain_timeout: float = 30.0
    max_sessions: int = 10_000          # open loop: sessions alive at once before arrivals are dropped
    unique_prompts: bool | None = None  # None = the workload's choice
    # Session index -> that session's records from an earlier run: replay its token counts (--compare).
    replay: Mapping[int, Sequence[RequestRecord]] | None = None


@dataclass
class RequestRecord:
    index: int
    session: int
    turn: int
    tenant: str
    priority: str
    cls: str
    start: float                        # seconds from the run start when sent
    end: float | None = None            # seconds from the run start when it finished or failed
    status: str = "OK"                  # "OK" or the gRPC status name
    reason: str = ""
    ttft: float | None = None
    e2e: float | None = None
    tpot: float | None = None           # this request's mean time per output token after the first
    queue: float | None = None
    server_ttft: float | None = None    # mesh only: the router's TTFT (request received -> first token)
    tokenize: float | None = None       # mesh only: the router's tokenize time
    itl: list[float] = field(default_factory=list)
    itl_estimated: bool = False         # deltas carried no token counts (Chat API): even split assumed
    planned_prompt_tokens: int = 0
    planned_output_tokens: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    finish_reason: str = ""
    deltas: list[tuple[float, int]] = field(default_factory=list)  # (offset from run start, tokens)

    @property
    def ok(self) -> bool:
        return self.status == "OK"

    def to_json(self) -> dict[str, Any]:
        d = {k: v for k, v in self.__dict__.items() if k not in ("itl", "deltas")}
        d["deltas"] = len(self.deltas)
        return d


@dataclass
class RunResult:
    target: dict[str, Any]
    workload: str
    mode: str
    seed: int
    records: list[RequestRecord]
    wall: float                         # run start -> last request finished
    sessions: int = 0
    truncated_sessions: int = 0         # chats ended early: the next turn would not fit the context
    clipped_requests: int = 0           # first turns shortened to fit the context
    dropped_sessions: int = 0           # open-loop arrivals over --max-sessions (client-side limit)
    stopped_by: str = ""
    stopped_at: float | None = None     # seconds from the run start when issuing stopped (then: drain)
    client_errors: list[str] = field(default_factory=list)  # unexpected exceptions in the bench itself


def records_by_session(records: Sequence[RequestRecord]) -> dict[int, list[RequestRecord]]:
    out: dict[int, list[RequestRecord]] = {}
    for r in sorted(records, key=lambda r: (r.session, r.turn)):
        out.setdefault(r.session, []).append(r)
    return out


def matched_plan(plan: SessionPlan, sent: Sequence[RequestRecord]) -> SessionPlan:
    """The plan with the token counts another target actually saw for it, turn by turn.

    A chat turn's prompt is the conversation so far plus new tokens; what a mesh adds (chat
    template, tokenization of the text) shows up as new tokens, so an engine replaying these
    counts processes prompts of the same length, and the session has the turns the mesh sent.
    """
    turns: list[TurnPlan] = []
    context = plan.system_tokens
    for r, planned in zip(sent, plan.turns, strict=False):
        if not r.ok:
            turns.append(planned)
            break
        turns.append(replace(planned, prompt_tokens=max(1, r.prompt_tokens - context),
                             output_tokens=max(1, r.completion_tokens)))
        context = r.prompt_tokens + r.completion_tokens
    return replace(plan, turns=tuple(turns)) if turns else plan


class _Timing:
    """The observer a target calls on every delta: timestamps are taken here, on arrival."""

    __slots__ = ("counts", "sent", "times")

    def __init__(self) -> None:
        self.sent = time.monotonic()
        self.times: list[float] = []
        self.counts: list[int | None] = []

    def __call__(self, tokens: int | None) -> None:
        self.times.append(time.monotonic())
        self.counts.append(tokens)

    def partial(self, rec: RequestRecord) -> None:
        """A failed request's tokens served before it failed: those streamed (a delta without a
        count as one), and its planned prompt once the first token came (prefill ran)."""
        if self.counts:
            rec.completion_tokens = sum(1 if c is None else c for c in self.counts)
            rec.prompt_tokens = rec.planned_prompt_tokens

    def fill(self, rec: RequestRecord, res: TurnResult, t0: float) -> None:
        rec.e2e = res.finished_at - self.sent
        rec.prompt_tokens, rec.cached_tokens = res.prompt_tokens, res.cached_tokens
        rec.completion_tokens, rec.finish_reason = res.completion_tokens, res.finish_reason
        rec.queue, rec.server_ttft, rec.tokenize = res.queue_seconds, res.server_ttft, res.tokenize_seconds
        if not self.times:
            return
        rec.ttft = self.times[0] - self.sent
        if res.completion_tokens > 1:
            rec.tpot = (self.times[-1] - self.times[0]) / (res.completion_tokens - 1)
        rec.itl_estimated = any(c is None for c in self.counts)
        even = res.completion_tokens / len(self.times)
        counts = [even if rec.itl_estimated else c or 0 for c in self.counts]
        rec.deltas = [(t - t0, round(c)) for t, c in zip(self.times, counts, strict=True)]
        last = self.times[0]
        for t, c in zip(self.times[1:], counts[1:], strict=True):
            if c <= 0:
                continue  # a text-only flush: the gap runs on to the next token-bearing delta
            gap = (t - last) / c
            rec.itl.extend([gap] * max(1, round(c)))
            last = t


class Runner:
    def __init__(self, target: Target, workload: Workload, config: RunConfig) -> None:
        self.target = target
        self.workload = workload
        self.cfg = config
        self.sampler = SessionSampler(workload, config.seed, config.length_scale)
        self.unique = workload.unique_prompts if config.unique_prompts is None else config.unique_prompts
        self.run_id = uuid.uuid4().hex[:8]
        self.records: list[RequestRecord] = []
        self.issued = 0
        self.in_flight = 0
        self.ok = 0
        self.errors = 0
        self.client_errors: list[str] = []
        self._tasks: set[asyncio.Task[None]] = set()
        self._stop = asyncio.Event()
        self._stopped_by = ""
        self._stopped_at: float | None = None
        self._next_index = 0
        self._t0 = 0.0
        self._stats = {"sessions": 0, "truncated": 0, "clipped": 0, "dropped": 0}

    # ------------------------------------------------------------------ public
    @property
    def elapsed(self) -> float:
        return time.monotonic() - self._t0 if self._t0 else 0.0

    def stop(self, why: str) -> None:
        if not self._stop.is_set():
            self._stopped_by = why
            self._stopped_at = self.elapsed
            self._stop.set()

    async def run(self) -> RunResult:
        """Run until a bound is reached, then drain; the target must already be started."""
        loop = asyncio.get_running_loop()
        self._t0 = time.monotonic()
        timer = loop.call_later(self.cfg.duration, self.stop, "duration") if self.cfg.duration else None
        try:
            await self._dispatch()
            await self._settle()
            await self._drain()
        finally:
            if timer is not None:
                timer.cancel()
            await self._cancel_all()
        self.records.sort(key=lambda r: r.index)
        ends = [r.end if r.end is not None else r.start + (r.e2e or 0.0) for r in self.records]
        return RunResult(
            target=self.target.describe(), workload=self.workload.name, mode=self.workload.arrival.mode,
            seed=self.sampler.seed, records=self.records, wall=max(ends, default=self.elapsed),
            sessions=self._stats["sessions"], truncated_sessions=self._stats["truncated"],
            clipped_requests=self._stats["clipped"], dropped_sessions=self._stats["dropped"],
            stopped_by=self._stopped_by, stopped_at=self._stopped_at, client_errors=self.client_errors)

    # --------------------------------------------------------------- dispatch
    async def _dispatch(self) -> None:
        """Start sessions until a bound stops the run or the workload runs out."""
        spec = self.workload.arrival
        if spec.mode == "closed":
            sessions = self._replayed((None, p) for p in self.sampler)
            plans = (plan for _, plan in sessions)
            for _ in range(spec.concurrency):
                self._spawn(self._worker(plans))
            return
        for at, plan in self._replayed(self._arrivals(iter(self.sampler))):
            if not await self._wait_until(at or 0.0):
                return
            if len(self._tasks) >= self.cfg.max_sessions:
                self._stats["dropped"] += 1
                continue
            self._spawn(self._session(plan))
        if spec.mode != "trace" and self.cfg.duration:
            # Arrivals end at the horizon; running chats keep going until the duration is up.
            await self._wait_until(self.cfg.duration)

    def _replayed(self, arrivals: Iterable[tuple[float | None, SessionPlan]]
                  ) -> Iterator[tuple[float | None, SessionPlan]]:
        """With a replay, only the sessions the earlier run sent, as it sent them, then the end.

        Sessions it never started keep their arrival slot (so arrival times stay aligned) but
        are skipped, which makes both runs issue exactly the same requests.
        """
        replay = self.cfg.replay
        if replay is None:
            yield from arrivals
            return
        left = set(replay)
        for at, plan in arrivals:
            if not left:
                return
            if plan.index in left:
                left.discard(plan.index)
                yield at, matched_plan(plan, replay[plan.index])
    async def _settle(self) -> None:
        """Let running sessions end by themselves unless a bound stops the run first."""
        waiter = asyncio.ensure_future(self._stop.wait())
        try:
            while self._tasks and not self._stop.is_set():
                await asyncio.wait([*self._tasks, waiter], return_when=asyncio.FIRST_COMPLETED)
        finally:
            waiter.cancel()
        self.stop("replay complete" if self.cfg.replay is not None else "workload exhausted")

    def _arrivals(self, sessions: Iterator[SessionPlan]) -> Iterator[tuple[float | None, SessionPlan]]:
        spec = self.workload.arrival
        if spec.mode == "trace":
            for plan in sessions:
                yield (plan.start or 0.0) * spec.time_scale, plan
            return
        horizon = self.cfg.duration or math.inf
        times = open_loop_times(spec, random.Random(self.sampler.seed + 1), horizon)
        yield from zip(times, sessions, strict=False)  # both may be endless

    async def _worker(self, sessions: Iterator[SessionPlan]) -> None:
        for plan in sessions:
            if self._stop.is_set():
                return
            await self._session(plan)

    def _spawn(self, coro: Any) -> asyncio.Task[None]:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def _wait_until(self, offset: float) -> bool:
        """Wait for a scheduled offset; False if the run was stopped first."""
        delay = self._t0 + offset - time.monotonic()
        if delay > 0:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._stop.wait(), delay)
        return not self._stop.is_set()

    async def _drain(self) -> None:
        if self._tasks:
            await asyncio.wait(set(self._tasks), timeout=self.cfg.drain_timeout)

    async def _cancel_all(self) -> None:
        tasks = list(self._tasks)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    # ---------------------------------------------------------------- sessions
    def _take_ticket(self) -> bool:
        if self._stop.is_set():
            return False
        self.issued += 1
        if self.cfg.requests and self.issued >= self.cfg.requests:
            self.stop("requests")
        return True

    def _fit(self, s: TargetSession, turn: TurnPlan, first: bool, system: int) -> TurnPlan | None:
        """The turn, shortened to fit the target's context (first turn), or None (ends the chat)."""
        limit = self.target.max_context
        if not limit:
            return turn
        used = s.context_tokens or system
        need = used + turn.prompt_tokens + turn.output_tokens
        if need + self.target.margin(turn.prompt_tokens) <= limit:
            return turn
        if not first:
            self._stats["truncated"] += 1
            return None
        self._stats["clipped"] += 1
        output = min(turn.output_tokens, max(1, limit // 4))
        room = limit - used - output - self.target.margin(limit - used - output)
        return replace(turn, prompt_tokens=max(1, room), output_tokens=output)

    async def _session(self, plan: SessionPlan) -> None:
        if not self._take_ticket():
            return
        self._stats["sessions"] += 1
        cm = self.target.session(plan, self.run_id, self.unique)
        try:
            s = await cm.__aenter__()
        except TokenrelayError as exc:  # opening the session (Chat start) failed: that is turn 0's error
            self._record_failure(self._new_record(plan, 0, plan.turns[0]), exc.code.name, exc.reason)
            return
        try:
            for i, planned in enumerate(plan.turns):
                if i and not await self._pause(planned):
                    return
                turn = self._fit(s, planned, i == 0, plan.system_tokens)
                # The first turn's ticket was taken before opening the session.
                if turn is None or (i and not self._take_ticket()):
                    return
                if not await self._request(s, plan, i, turn):
                    return
        finally:
            with contextlib.suppress(TokenrelayError):
                await cm.__aexit__(None, None, None)

    async def _pause(self, turn: TurnPlan) -> bool:
        """Wait before a later turn of a chat: its think time, or its recorded time in a trace."""
        if turn.at is not None:
            return await self._wait_until(turn.at * self.workload.arrival.time_scale)
        if turn.think_time > 0:
            return await self._wait_until(self.elapsed + turn.think_time)
        return True

    def _new_record(self, plan: SessionPlan, i: int, turn: TurnPlan) -> RequestRecord:
        self._next_index += 1
        return RequestRecord(index=self._next_index - 1, session=plan.index, turn=i, tenant=plan.tenant,
                             priority=plan.priority or "default", cls=plan.cls, start=time.monotonic() - self._t0,
                             planned_prompt_tokens=turn.prompt_tokens, planned_output_tokens=turn.output_tokens)

    def _record_failure(self, rec: RequestRecord, status: str, reason: str, timing: _Timing | None = None) -> None:
        rec.status, rec.reason = status, reason
        if timing is not None:
            timing.partial(rec)
        rec.end = time.monotonic() - self._t0
        self.errors += 1
        self.records.append(rec)

    async def _request(self, s: TargetSession, plan: SessionPlan, i: int, turn: TurnPlan) -> bool:
        rec = self._new_record(plan, i, turn)
        timing = _Timing()
        self.in_flight += 1
        try:
            res = await asyncio.wait_for(s.turn(turn, timing, self.cfg.request_timeout), self.cfg.request_timeout)
        except asyncio.TimeoutError:
            self._record_failure(rec, Reason.BENCH_TIMEOUT.code.name, Reason.BENCH_TIMEOUT, timing)
            return False
        except TokenrelayError as exc:
            self._record_failure(rec, exc.code.name, exc.reason, timing)
            return False
        except asyncio.CancelledError:
            self._record_failure(rec, Reason.BENCH_DRAIN_TIMEOUT.code.name, Reason.BENCH_DRAIN_TIMEOUT,
                                 timing)
            raise
        except Exception as exc:  # noqa: BLE001 - one broken request must not end the whole run
            self._record_failure(rec, grpc.StatusCode.UNKNOWN.name, f"CLIENT_{type(exc).__name__.upper()}",
                                 timing)
            if len(self.client_errors) < 3:  # kept for the report: a bench bug must not hide as a count
                self.client_errors.append(repr(exc))
            return False
        finally:
            self.in_flight -= 1
        timing.fill(rec, res, self._t0)
        rec.end = res.finished_at - self._t0
        self.records.append(rec)
        self.ok += 1
        return True
