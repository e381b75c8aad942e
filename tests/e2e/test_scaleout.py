"""Scale-out with real processes: several routers (one address through SO_REUSEPORT, or one port
each to aim at a given process) sharing one redis-server, two sim engines and a tokenizer.

- `tokenrelay up --routers 2 --engines 2 --engine sim` serves one address from two router processes;
- Cancel sent to another router process than the one holding the stream cancels it;
- request ids are unique across router processes per tenant, and invisible to other tenants;
- a session sticks to its engine replica whichever router takes its next turn;
- kill -9 of an engine under load: streams before their first token are retried on the other
  engine, none hangs, new requests succeed; a draining engine's work is retried elsewhere with no
  client error.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import pathlib
import signal
import subprocess
import sys

import grpc
import pytest

from services.channels import CHANNEL_OPTIONS, open_channel
from services.client import Client, Finished, TextDelta
from services.errors import InvalidArgument, TokenrelayError
from services.proto.tokenrelay.v1 import common_pb2, engine_pb2, engine_pb2_grpc, inference_pb2, inference_pb2_grpc
from tests.e2e.prockit import KEYS, Procs, first_delta, outcome
from tests.meshkit import metric_sum, scrape
from tests.waiting import poll
from tokenrelay_tools.cli.launcher import engine_argv


async def _load(address: str) -> engine_pb2.LoadReport:
    async with open_channel(address) as channel:
        return await engine_pb2_grpc.EngineStub(channel).GetLoad(engine_pb2.LoadRequest(), timeout=5)


@pytest.fixture
async def two_routers(tmp_path, redis_url):
    """Two router processes on two ports (to aim at one), one Redis, two engines, one tokenizer."""
    p = Procs(tmp_path, redis_url)
    try:
        await p.upstreams()
        p.router("ra")
        p.router("rb")
        await p.ready("ra", "rb")
        yield p
    finally:
        p.stop()


# ------------------------------------------------------------------------------------ tokenrelay up
def test_up_starts_routers_sharing_one_address(tmp_path):
    state = tmp_path / "state.json"
    log = tmp_path / "up.log"
    proc = subprocess.Popen([sys.executable, "-m", "tokenrelay_tools.cli.main", "up", "--engine", "sim",
                             "--routers", "2", "--engines", "2", "--port", "0", "--state-file", str(state),
                             "--run-dir", str(tmp_path / "run"), "--engine-arg=--sim-decode-step-time=0.002"],
                            stdout=subprocess.PIPE, stderr=open(log, "wb"))
    try:
        assert proc.stdout is not None
        address = proc.stdout.readline().decode().strip()  # the one router address, once ready
        assert address, log.read_text()
        info = json.loads(state.read_text())
        assert info["router"] == address and info["routers"] == 2 and len(info["engines"]) == 2
        assert {"router", "router1", "engine", "engine1"} <= set(info["metrics"])

        async def one(api_key: str) -> int:
            # A connection of its own (grpc shares one between channels of the same target otherwise).
            options = [*CHANNEL_OPTIONS, ("grpc.use_local_subchannel_pool", 1)]
            async with open_channel(address, options=options) as channel:
                request = inference_pb2.GenerateRequest(
                    prompt="hello", sampling=common_pb2.SamplingParams(max_tokens=24, ignore_eos=True))
                call = inference_pb2_grpc.InferenceStub(channel).Generate(
                    request, metadata=(("authorization", f"Bearer {api_key}"),), timeout=30)
                return [m async for m in call][-1].done.usage.completion_tokens

        async def spread() -> None:
            assert await asyncio.gather(*(one(info["api_key"]) for _ in range(16))) == [24] * 16

        async def cancel_through_the_one_address() -> None:
            # Streams and Cancels on connections of their own: whichever router process holds a
            # stream, a Cancel reaching either one cancels it.
            options = [*CHANNEL_OPTIONS, ("grpc.use_local_subchannel_pool", 1)]
            metadata = (("authorization", f"Bearer {info['api_key']}"),)
            channels = [open_channel(address, options=options) for _ in range(8)]
            try:
                stubs = [inference_pb2_grpc.InferenceStub(c) for c in channels]
                calls = [stubs[i].Generate(inference_pb2.GenerateRequest(
                    prompt="long", request_id=f"c{i}", sampling=common_pb2.SamplingParams(
                        max_tokens=5000, ignore_eos=True)), metadata=metadata, timeout=60) for i in range(4)]
                for call in calls:
                    while (await call.read()).WhichOneof("event") != "delta":
                        pass
                answers = [await stubs[4 + i].Cancel(inference_pb2.CancelRequest(request_id=f"c{i}"),
                                                     metadata=metadata, timeout=10) for i in range(4)]
                assert [a.cancelled for a in answers] == [True] * 4
                for call in calls:
                    with contextlib.suppress(grpc.aio.AioRpcError):
                        while (msg := await call.read()) is not grpc.aio.EOF:
                            assert msg.WhichOneof("event") != "done" or msg.done.usage.completion_tokens < 5000
            finally:
                for c in channels:
                    await c.close()

        asyncio.run(spread())
        asyncio.run(asyncio.wait_for(cancel_through_the_one_address(), 60))

        def served(name: str) -> float:
            return sum(v for (n, _), v in scrape(info["metrics"][name]).items()
                       if n == "tokenrelay_router_requests_total")
        # the kernel spread the connections over both router processes (all on one: p = 2**-15)
        assert served("router") > 0 and served("router1") > 0
        assert served("router") + served("router1") == 16 + 4   # the 4 cancelled ones included
    finally:
        proc.send_signal(signal.SIGINT)
        assert proc.wait(60) == 0, log.read_text()[-3000:]


def test_up_refuses_a_port_held_by_another_reuse_port_server(tmp_path):
    # Routers binding with SO_REUSEPORT would silently share a port with another mesh's routers.
    import socket

    with socket.socket() as holder:
        holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        r = subprocess.run([sys.executable, "-m", "tokenrelay_tools.cli.main", "up", "--engine", "sim",
                            "--routers", "2", "--port", str(port), "--state-file", str(tmp_path / "s.json"),
                            "--run-dir", str(tmp_path / "run")], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2   # a refusal before anything starts (issue 14)
    assert f"port 127.0.0.1:{port} is in use" in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "run" / "logs").exists()  # refused before starting anything


# ------------------------------------------------------------------- request ids, Cancel, sessions
async def test_cancel_sent_to_another_router_process(two_routers):
    p = two_routers
    async with Client(p.addr["ra"], KEYS["t1"]) as a, Client(p.addr["rb"], KEYS["t1"]) as b:
        stream = a.stream("hold on", max_tokens=2000, ignore_eos=True, request_id="long-1")
        await first_delta(stream)                      # held by router ra
        assert await b.cancel("long-1") is True         # sent to router rb

        assert await outcome(stream) == "cancelled"
        assert await b.cancel("long-1") is False        # over: nothing left to cancel


async def test_request_ids_are_unique_across_routers_and_scoped_by_tenant(two_routers):
    p = two_routers
    async with (Client(p.addr["ra"], KEYS["t1"]) as a, Client(p.addr["rb"], KEYS["t1"]) as b,
                Client(p.addr["rb"], KEYS["t2"]) as other):
        stream = a.stream("first", max_tokens=2000, ignore_eos=True, request_id="shared-id")
        await first_delta(stream)
        with pytest.raises(InvalidArgument) as dup:       # same tenant, another router process
            await b.generate("second", max_tokens=4, request_id="shared-id")
        assert dup.value.reason == "DUPLICATE_REQUEST_ID"
        # Another tenant: the same id is its own, independent; and it cannot see or cancel t1's.
        result = await other.generate("mine", max_tokens=4, ignore_eos=True, request_id="shared-id")
        assert result.finished.completion_tokens == 4
        assert await other.cancel("shared-id") is False
        async with Client(p.addr["ra"], KEYS["t2"]) as other_on_a:
            assert await other_on_a.cancel("shared-id") is False
        assert await b.cancel("shared-id") is True        # its own tenant can
        await stream.aclose()


async def test_after_a_router_crash_the_same_id_is_accepted_by_another(two_routers):
    p = two_routers
    async with Client(p.addr["ra"], KEYS["t1"]) as a, Client(p.addr["rb"], KEYS["t1"]) as b:
        stream = a.stream("doomed", max_tokens=2000, ignore_eos=True, request_id="retry-me")
        await first_delta(stream)
        p.procs["ra"].send_signal(signal.SIGKILL)  # dies holding the id (its key lives for the TTL)
        p.procs["ra"].wait(10)
        with pytest.raises(TokenrelayError):
            async for _ in stream:
                pass
        # The client retries on the other router at once: the dead router's id does not block it.
        result = await b.generate("again", max_tokens=4, ignore_eos=True, request_id="retry-me")
        assert result.finished.completion_tokens == 4


async def test_a_session_sticks_to_its_engine_across_routers(two_routers):
    p = two_routers
    e0, e1 = p.addr["e0"], p.addr["e1"]
    async with Client(p.addr["ra"], KEYS["t1"]) as a, Client(p.addr["rb"], KEYS["t1"]) as b:
        # Occupy e0 (the first choice of an idle router) so the session's first turn lands on e1.
        busy = a.stream("busy", max_tokens=2000, ignore_eos=True, request_id="busy")
        await first_delta(busy)
        assert (await _load(e0)).active_requests == 1
        first = await a.generate("turn 1", max_tokens=5, ignore_eos=True, session_id="sess-1")
        assert first.finished.completion_tokens == 5
        await busy.aclose()
        await poll(lambda: _idle(e0), timeout=10, what="e0 idle")
        before = [(await _load(e)).generated_tokens_total for e in (e0, e1)]
        # Both engines idle now: router rb would pick e0, but the session holds e1.
        for i in range(3):
            r = await b.generate(f"turn {i + 2}", max_tokens=7, ignore_eos=True, session_id="sess-1")
            assert r.finished.completion_tokens == 7
        after = [(await _load(e)).generated_tokens_total for e in (e0, e1)]
        assert after[1] - before[1] == 21 and after[0] == before[0]
        # ... while a new session on rb goes to the idle first choice.
        await b.generate("other", max_tokens=3, ignore_eos=True, session_id="sess-2")
        assert (await _load(e0)).generated_tokens_total == before[0] + 3


async def _idle(address: str) -> bool:
    return (await _load(address)).active_requests == 0


# ------------------------------------------------------------------------------ engines failing
async def _run(client: Client, prompt: str, got_delta: dict[int, bool], i: int) -> str:
    """One streamed request: 'ok', or the error; never more than the test's bound."""
    try:
        async for event in client.stream(prompt, max_tokens=30, ignore_eos=True):
            if isinstance(event, TextDelta):
                got_delta[i] = True
            elif isinstance(event, Finished):
                return "ok"
        return "no done"
    except TokenrelayError as exc:
        return f"{type(exc).__name__}:{exc.reason}"


# The engines' streams over gRPC, and over their frame ports (services/frames.py): the same guarantees.
TRANSPORTS = pytest.mark.parametrize("transport", ["grpc", "frames"])


def _frame_flags(transport: str) -> tuple[str, ...]:
    return ("--frame-port", "0") if transport == "frames" else ()


def _used(p: Procs, transport: str) -> None:
    """The router opened its engine streams over `transport` only."""
    streams = {t: metric_sum(p.metrics["r"], "tokenrelay_router_engine_streams_total", transport=t)
               for t in ("grpc", "frames")}
    other = "grpc" if transport == "frames" else "frames"
    assert streams[transport] >= 2 and streams[other] == 0, streams


@TRANSPORTS
async def test_kill_9_an_engine_under_load(tmp_path, redis_url, transport):
    p = Procs(tmp_path, redis_url)
    try:
        await p.upstreams(*_frame_flags(transport))
        p.router("r")
        await p.ready("r")
        async with Client(p.addr["r"], KEYS["t1"]) as client:
            got: dict[int, bool] = {}
            prompt = "x" * 400  # ~0.2 s of prefill each: most requests wait before their first token
            tasks = [asyncio.create_task(_run(client, prompt, got, i)) for i in range(16)]
            await poll(lambda: got, timeout=30, what="a first token")
            before_kill = dict(got)
            p.procs["e0"].send_signal(signal.SIGKILL)
            outcomes = await asyncio.wait_for(asyncio.gather(*tasks), 60)   # none hangs
            for i, outcome in enumerate(outcomes):
                # a failure is only ever shown after the request's first token
                assert outcome == "ok" or got.get(i), (i, outcome, before_kill)
            assert outcomes.count("ok") >= 8, outcomes
            for _ in range(4):                                              # new requests succeed
                result = await client.generate("after", max_tokens=5, ignore_eos=True)
                assert result.finished.completion_tokens == 5
        _used(p, transport)
    finally:
        p.stop()


@TRANSPORTS
async def test_a_draining_engines_work_is_retried_elsewhere(tmp_path, redis_url, transport):
    p = Procs(tmp_path, redis_url)
    try:
        await p.upstreams("--shutdown-grace", "30", *_frame_flags(transport))
        p.router("r", "--engine-poll-interval", "5")  # the poll must not hide the in-band refusal
        await p.ready("r")
        async with Client(p.addr["r"], KEYS["t1"]) as client:
            # One long request on each engine: the router's next choice is e0 (ties go first) ...
            held = [client.stream("long", max_tokens=300, ignore_eos=True) for _ in range(2)]
            for s in held:
                await first_delta(s)
            assert [(await _load(p.addr[e])).active_requests for e in ("e0", "e1")] == [1, 1]
            # ... which now drains: new submits refused in-band (SHUTTING_DOWN), then NOT_SERVING.
            # Requests sent as it starts meet the refusal (retried on e1); later ones are placed on
            # e1 at once (the router has heard). Neither is ever a client error.
            p.procs["e0"].send_signal(signal.SIGTERM)
            racing = [asyncio.create_task(client.generate(f"race {i}", max_tokens=5, ignore_eos=True))
                      for i in range(8)]
            await poll(lambda: _draining(p.addr["e0"]), timeout=10, what="e0 draining")
            results = await asyncio.gather(*racing, *(client.generate(f"new {i}", max_tokens=5, ignore_eos=True)
                                                      for i in range(8)))
            assert all(r.finished.completion_tokens == 5 for r in results)      # no client error
            for s in held:  # the draining engine still finishes what it had
                async for event in s:
                    if isinstance(event, Finished):
                        assert event.completion_tokens == 300
            _used(p, transport)
        assert p.procs["e0"].wait(30) == 0, p.log("e0")
    finally:
        p.stop()


async def _draining(address: str) -> bool:
    """Draining: it says so, or its server already refuses new calls (its open streams go on)."""
    try:
        return (await _load(address)).draining
    except grpc.aio.AioRpcError:
        return True


def test_engine_replicas_share_the_cores() -> None:
    model = pathlib.Path("/models/m")
    assert "--hf-threads" not in engine_argv(model, "hf", 1, [], cores=16)     # one engine: torch decides
    argv = engine_argv(model, "hf", 4, [], cores=16)
    assert argv[argv.index("--hf-threads") + 1] == "4"
    assert engine_argv(model, "hf", 3, [], cores=2)[-1] == "1"                  # never below one thread
    assert engine_argv(model, "hf", 2, ["--hf-threads=6"], cores=8)[-1] == "--hf-threads=6"  # the user wins
