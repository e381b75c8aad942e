"""Fuzz every RPC of every service (issue 15) with generated and malformed messages.

Real processes, started once for the module: a byte-level tokenizer, a sim engine (no pacing) and
a router with a real redis-server. Every RPC they serve — Inference.Generate / Chat / Cancel / Stream,
Tokenizer.Tokenize / Detokenize / Info, Engine.Stream / Abort / GetLoad / SubscribeKvEvents, and on
each process grpc.health.v1 Check / Watch / List and server reflection — gets hypothesis-generated
messages built from its proto descriptors (`protofuzz.messages`: bounds, NaN / inf, huge strings and
lists, unicode and control tokens, unknown enum numbers), valid requests with a few fields replaced by
such values (`protofuzz.near`, so that the deeper paths run) and malformed bytes
(`protofuzz.malformed`); streams get 1-4 of these, half of them after the RPC's first valid message.
Every call has a deadline; the checks:

- no crash: every process is still running after every call, and serving at the end;
- no hang: no call ends in DEADLINE_EXCEEDED (the server answered before the deadline);
- no INTERNAL / UNKNOWN (nor UNAVAILABLE / DATA_LOSS, nor UNIMPLEMENTED but for health's List) status, and
  no traceback logged.

Calls go through grpc's sync client, which reports the status the server sent: grpc.aio's client
can replace it with INTERNAL "Internal error from Core" when one of its writes races the server's
status (docs/reliability.md, "## Fuzzing").

CI runs TOKENRELAY_FUZZ_EXAMPLES (default 30) examples per RPC with a fixed seed (derandomized);
TOKENRELAY_FUZZ_RANDOM=1 draws new cases. TOKENRELAY_FUZZ_REPORT=path writes the counts by RPC and
status as JSON. A big run: docs/reliability.md gives the command.
"""

from __future__ import annotations

import asyncio
import collections
import json
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import grpc
import pytest
from google.protobuf.descriptor import MethodDescriptor
from grpc_health.v1 import health_pb2
from grpc_reflection.v1alpha import reflection_pb2
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from services.channels import CHANNEL_OPTIONS
from services.errors import REASON_KEY
from services.proto.tokenrelay.v1 import common_pb2, engine_pb2, inference_pb2, tokenizer_pb2
from tests.e2e.prockit import KEYS, Procs
from tests.fuzz.protofuzz import malformed, messages, near

EXAMPLES = int(os.environ.get("TOKENRELAY_FUZZ_EXAMPLES", "30"))
RANDOM = os.environ.get("TOKENRELAY_FUZZ_RANDOM") == "1"
REPORT = os.environ.get("TOKENRELAY_FUZZ_REPORT", "")
DEADLINE = 15.0   # seconds per call: generous for a loaded 2-core CI box; the slowest calls take < 2 s
FORBIDDEN = {grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN, grpc.StatusCode.DEADLINE_EXCEEDED,
             grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DATA_LOSS}
# A router whose event loop lagged (a 4 MB prompt just went through it, or the box is busy) refuses
# work for a moment: the right answer to overload, retryable elsewhere; counted in the report.
OVERLOAD = {(grpc.StatusCode.UNAVAILABLE, "ROUTER_OVERLOADED")}
# grpc.health.v1 List is in the health proto but not in grpcio-health-checking's servicer.
UNIMPLEMENTED = {"/grpc.health.v1.Health/List"}
# Server streams that never end by themselves: the first message is the answer, then the call is cancelled.
ENDLESS = {"/grpc.health.v1.Health/Watch", "/tokenrelay.v1.Engine/SubscribeKvEvents"}
# Fast sim (no pacing) with a context that long requests reach quickly.
ENGINE_FLAGS = ("--sim-time-scale", "0", "--sim-max-context", "2048")


@dataclass(frozen=True)
class Rpc:
    proc: str
    method: MethodDescriptor

    @property
    def path(self) -> str:
        return f"/{self.method.containing_service.full_name}/{self.method.name}"

    @property
    def id(self) -> str:
        return f"{self.proc}:{self.method.containing_service.name}.{self.method.name}"


def _rpcs() -> list[Rpc]:
    own = {"r": inference_pb2.DESCRIPTOR.services_by_name["Inference"],
           "tok": tokenizer_pb2.DESCRIPTOR.services_by_name["Tokenizer"],
           "e0": engine_pb2.DESCRIPTOR.services_by_name["Engine"]}
    shared = [health_pb2.DESCRIPTOR.services_by_name["Health"],
              reflection_pb2.DESCRIPTOR.services_by_name["ServerReflection"]]
    return [Rpc(proc, m) for proc, service in own.items() for s in (service, *shared) for m in s.methods]


RPCS = _rpcs()
COUNTS: collections.Counter[tuple[str, str, str, str]] = collections.Counter()
SLOWEST: dict[str, float] = {}


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory, redis_url: str) -> Iterator[Procs]:
    p = Procs(tmp_path_factory.mktemp("fuzz"), redis_url)
    try:
        asyncio.run(p.upstreams(*ENGINE_FLAGS, engines=1))
        p.router("r")
        asyncio.run(p.ready("r"))
        yield p
    finally:
        p.stop()
        if REPORT:
            rows = [{"rpc": k[0], "input": k[1], "status": k[2], "reason": k[3], "count": n}
                    for k, n in sorted(COUNTS.items())]
            with open(REPORT, "w") as f:
                json.dump({"examples_per_rpc": EXAMPLES, "calls": sum(COUNTS.values()), "counts": rows,
                           "slowest_seconds": SLOWEST}, f, indent=1)


@pytest.fixture(scope="module")
def channels(mesh: Procs) -> Iterator[dict[str, grpc.Channel]]:
    chans = {name: grpc.insecure_channel(mesh.addr[name], options=CHANNEL_OPTIONS) for name in ("r", "tok", "e0")}
    yield chans
    for c in chans.values():
        c.close()


def _ident(b: bytes) -> bytes:
    return b


# (gRPC metadata values are printable ASCII: the client refuses anything else before sending.)
METADATA = [
    (("x-api-key", KEYS["t1"]),), (("x-api-key", KEYS["t2"]),), (("authorization", f"Bearer {KEYS['t1']}"),),
    (), (("x-api-key", "nope"),), (("authorization", "Basic xyz"),), (("x-api-key", "k" * 4000),),
    (("x-api-key", KEYS["t1"]), ("traceparent", "00-zz-bad")),
    (("x-api-key", KEYS["t1"]), ("traceparent", "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01")),
]


def _metadata(rpc: Rpc) -> st.SearchStrategy[Any]:
    if rpc.path == "/grpc.health.v1.Health/Watch":
        # A traceparent makes services/tracing.py wrap Watch as an async generator: INTERNAL
        # (tests/test_bad_input.py::test_health_watch_with_a_trace_context, xfail until fixed there).
        return st.sampled_from([md for md in METADATA if not any(k == "traceparent" for k, _ in md)])
    return st.sampled_from(METADATA)


def _seeds() -> dict[str, list[Any]]:
    """Valid requests of each RPC, for `near` to start from (the key: the method's name, or the service's
    and the method's where two services share a method name)."""
    sampling = common_pb2.SamplingParams(max_tokens=8)
    user = [common_pb2.ChatMessage(role="user", content="hello")]
    ir, tk, en = inference_pb2, tokenizer_pb2, engine_pb2
    return {
        "Generate": [ir.GenerateRequest(prompt="hello", sampling=sampling),
                     ir.GenerateRequest(messages=ir.Messages(messages=user), sampling=sampling, session_id="s1"),
                     ir.GenerateRequest(token_ids=ir.TokenIds(ids=[72, 105]), sampling=sampling, request_id="r1")],
        "Chat": [ir.ChatRequest(start=ir.ChatStart()),
                 ir.ChatRequest(turn=ir.ChatTurn(messages=user, sampling=sampling)),
                 ir.ChatRequest(cancel=ir.ChatCancel())],
        "Cancel": [ir.CancelRequest(request_id="r1")],
        "Inference.Stream": [ir.StreamRequest(submit=[ir.StreamSubmit(request=ir.GenerateRequest(
                                 prompt="hello", sampling=sampling, request_id="s1"), timeout_ms=5000)]),
                             ir.StreamRequest(cancel=["s1"])],
        "Tokenize": [tk.TokenizeRequest(inputs=[tk.TokenizeInput(text="hello")]),
                     tk.TokenizeRequest(inputs=[tk.TokenizeInput(chat=tk.ChatMessages(messages=user,
                                                                                    add_generation_prompt=True))],
                                        packed_ids=True)],
        "Detokenize": [tk.DetokenizeRequest(open=[tk.DetokOpen(request_id="a", stop=["lo"])]),
                       tk.DetokenizeRequest(tokens=[tk.DetokTokens(request_id="a", token_ids=[104, 105], final=True)]),
                       tk.DetokenizeRequest(close=[tk.DetokClose(request_id="a")])],
        "Info": [tk.InfoRequest()],
        "Stream": [en.EngineInbound(submit=[en.EngineRequest(request_id="a", prompt_token_ids=[1, 2, 3],
                                                             sampling=sampling, eos_token_ids=[256])]),
                   en.EngineInbound(abort=["a"])],
        "Abort": [en.EngineAbortRequest(request_ids=["a"])],
        "GetLoad": [en.LoadRequest()], "SubscribeKvEvents": [en.KvEventsRequest()],
        "Check": [health_pb2.HealthCheckRequest(), health_pb2.HealthCheckRequest(service="tokenrelay.v1.Engine")],
        "Watch": [health_pb2.HealthCheckRequest()], "List": [health_pb2.HealthListRequest()],
        "ServerReflectionInfo": [reflection_pb2.ServerReflectionRequest(list_services=""),
                                 reflection_pb2.ServerReflectionRequest(file_containing_symbol="tokenrelay.v1.Engine")],
    }


SEEDS = _seeds()


def _seed(rpc: Rpc) -> list[Any]:
    return SEEDS.get(f"{rpc.method.containing_service.name}.{rpc.method.name}") or SEEDS[rpc.method.name]


def _payloads(rpc: Rpc) -> st.SearchStrategy[tuple[str, bytes]]:
    desc = rpc.method.input_type
    kinds = {"near-valid": near(_seed(rpc)).map(lambda m: m.SerializeToString()),
             "generated": messages(desc).map(lambda m: m.SerializeToString()), "malformed": malformed(desc)}
    # Half near-valid (the deeper paths), a fifth generated from scratch, the rest malformed.
    return st.sampled_from(["near-valid"] * 5 + ["generated"] * 2 + ["malformed"] * 3).flatmap(
        lambda kind: kinds[kind].map(lambda data: (kind, data)))


def _inputs(rpc: Rpc) -> st.SearchStrategy[list[tuple[str, bytes]]]:
    payloads = _payloads(rpc)
    if not rpc.method.client_streaming:
        return payloads.map(lambda p: [p])
    # Half the streams open with the RPC's first valid message (a chat's `start`), so later ones count.
    opening = ("near-valid", _seed(rpc)[0].SerializeToString())
    return st.tuples(st.booleans(), st.lists(payloads, min_size=1, max_size=4)).map(
        lambda t: [opening, *t[1]] if t[0] else t[1])


def _call(channel: grpc.Channel, rpc: Rpc, payloads: list[bytes], metadata: Any) -> grpc.StatusCode | grpc.RpcError:
    m = rpc.method
    kw = {"request_serializer": _ident, "response_deserializer": _ident}
    args = {"metadata": metadata, "timeout": DEADLINE}
    if not m.client_streaming and not m.server_streaming:
        channel.unary_unary(rpc.path, **kw)(payloads[0], **args)
        return grpc.StatusCode.OK
    if m.client_streaming and not m.server_streaming:
        channel.stream_unary(rpc.path, **kw)(iter(payloads), **args)
        return grpc.StatusCode.OK
    if m.server_streaming and not m.client_streaming:
        call = channel.unary_stream(rpc.path, **kw)(payloads[0], **args)
    else:
        call = channel.stream_stream(rpc.path, **kw)(iter(payloads), **args)
    for _ in call:
        if rpc.path in ENDLESS:
            call.cancel()
            return grpc.StatusCode.OK
    return grpc.StatusCode.OK


def _one(mesh: Procs, channels: dict[str, grpc.Channel], rpc: Rpc, inputs: list[tuple[str, bytes]],
         metadata: Any) -> None:
    kinds = "+".join(sorted({k for k, _ in inputs}))
    started = time.monotonic()
    try:
        code, reason, details = _call(channels[rpc.proc], rpc, [b for _, b in inputs], metadata), "", ""
    except grpc.RpcError as err:
        code = err.code()
        reason = dict(err.trailing_metadata() or ()).get(REASON_KEY, "")
        details = err.details() or ""
    elapsed = time.monotonic() - started
    SLOWEST[rpc.id] = round(max(SLOWEST.get(rpc.id, 0.0), elapsed), 3)
    COUNTS[(rpc.id, kinds, code.name, reason)] += 1
    dead = [name for name, proc in mesh.procs.items() if proc.poll() is not None]
    assert not dead, f"{dead} exited after {rpc.id}:\n" + "\n".join(mesh.log(n) for n in dead)
    allowed = (code not in FORBIDDEN or (code, reason) in OVERLOAD) and (
        code != grpc.StatusCode.UNIMPLEMENTED or rpc.path in UNIMPLEMENTED)
    assert allowed, (f"{rpc.id} answered {code.name} {reason!r} {details!r} after {elapsed:.2f}s "
                     f"to {[(k, b[:200]) for k, b in inputs]} with {metadata}")


SETTINGS = settings(max_examples=EXAMPLES, deadline=None, derandomize=not RANDOM, database=None,
                    suppress_health_check=list(HealthCheck), print_blob=True)


@pytest.mark.parametrize("rpc", RPCS, ids=[r.id for r in RPCS])
def test_fuzz_rpc(mesh: Procs, channels: dict[str, grpc.Channel], rpc: Rpc) -> None:
    @SETTINGS
    @given(inputs=_inputs(rpc), metadata=_metadata(rpc))
    def run(inputs: list[tuple[str, bytes]], metadata: Any) -> None:
        _one(mesh, channels, rpc, inputs, metadata)

    run()


def test_every_service_still_serves_and_logged_no_traceback(mesh: Procs, channels: dict[str, grpc.Channel]) -> None:
    for name, channel in channels.items():
        check = channel.unary_unary("/grpc.health.v1.Health/Check",
                                    request_serializer=health_pb2.HealthCheckRequest.SerializeToString,
                                    response_deserializer=health_pb2.HealthCheckResponse.FromString)
        assert check(health_pb2.HealthCheckRequest(), timeout=5).status == health_pb2.HealthCheckResponse.SERVING
        log = (mesh.tmp / f"{name}.log").read_text(errors="replace")
        # Known, not a status defect: services/tracing.py detaches a traced server stream's context in
        # its finaliser, which may run in another context when the client cancels; opentelemetry then
        # logs "Failed to detach context" with a two-part traceback (seen in about half of the runs).
        detach_failures = log.count("Failed to detach context")
        assert "unhandled_error" not in log and log.count("Traceback") == 2 * detach_failures, log[-5000:]
