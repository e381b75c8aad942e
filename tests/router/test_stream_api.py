"""The `Stream` API: many generations on one open call, over real gRPC, a real tokenizer, a real sim
engine (or a mute one) and real Redis leases (`router_mesh`). Raw stubs where the wire is the
point, the typed client's `RequestStream` elsewhere."""

from __future__ import annotations

import asyncio
import pathlib
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest

from router_svc.metrics import STREAM_CALLS
from router_svc.stream_call import _Call
from router_svc.tenants import Tenant
from router_svc.types import Accepted, Delta, Migrated
from router_svc.validation import Bounds
from services.client import Client, DeadlineExceeded, InvalidArgument, ResourceExhausted, TextDelta
from services.errors import REASON_KEY, Reason
from services.proto.tokenrelay.v1 import common_pb2, inference_pb2, inference_pb2_grpc
from tests.router.test_request_defects import TENANTS, Keys, MuteEngine, _md, _no_leases, router_mesh
from tests.waiting import poll


def _submit(request_id: str, max_tokens: int = 8, timeout_ms: int = 0, **sampling: Any) -> inference_pb2.StreamSubmit:
    return inference_pb2.StreamSubmit(request=inference_pb2.GenerateRequest(
        prompt="hello world", request_id=request_id, return_token_ids=True,
        sampling=common_pb2.SamplingParams(max_tokens=max_tokens, ignore_eos=True, **sampling)), timeout_ms=timeout_ms)


class _Raw:
    """One raw Stream call: messages sent when asked, every response kept."""

    def __init__(self, stub: Any, key: str = "key-a") -> None:
        self.outbox: asyncio.Queue[inference_pb2.StreamRequest | None] = asyncio.Queue()
        self.call = stub.Stream(self._send(), metadata=_md(key))
        self.responses: list[inference_pb2.StreamResponse] = []
        self.events: dict[str, list[inference_pb2.StreamEvent]] = {}

    async def _send(self) -> AsyncIterator[inference_pb2.StreamRequest]:
        while (msg := await self.outbox.get()) is not None:
            yield msg

    def send(self, *submits: inference_pb2.StreamSubmit, cancel: tuple[str, ...] = ()) -> None:
        self.outbox.put_nowait(inference_pb2.StreamRequest(submit=submits, cancel=cancel))

    async def until_ended(self, *request_ids: str, timeout: float = 20, done: tuple[str, ...] = ()) -> None:
        """Read until every one of these requests has its `done` or `error`, and those in `done` their `done`."""
        async with asyncio.timeout(timeout):
            while not (all(self.ended(r) for r in request_ids) and all(self.done(r) for r in done)):
                response = await self.call.read()
                assert response is not grpc.aio.EOF, "the call ended early"
                self.responses.append(response)
                for e in response.events:
                    self.events.setdefault(e.request_id, []).append(e)

    def ended(self, request_id: str) -> bool:
        return any(e.WhichOneof("event") in ("done", "error") for e in self.events.get(request_id, []))

    def done(self, request_id: str) -> bool:
        return any(e.WhichOneof("event") == "done" for e in self.events.get(request_id, []))

    def last(self, request_id: str) -> inference_pb2.StreamEvent:
        return self.events[request_id][-1]

    def tokens(self, request_id: str) -> int:
        return sum(len(e.delta.token_ids) for e in self.events[request_id] if e.WhichOneof("event") == "delta")


async def test_many_requests_on_one_call_each_complete_and_responses_carry_several(tmp_path: pathlib.Path,
                                                                                    redis_url: str) -> None:
    open_before = STREAM_CALLS.labels("a")._value.get()
    async with router_mesh(tmp_path, redis_url) as (stub, admission, router):
        raw = _Raw(stub)
        ids = [f"r{i}" for i in range(24)]
        raw.send(*(_submit(r, max_tokens=12) for r in ids))
        await raw.until_ended(*ids)
        for r in ids:
            kinds = [e.WhichOneof("event") for e in raw.events[r]]
            assert kinds[0] == "accepted" and kinds[-1] == "done", kinds
            assert raw.tokens(r) == 12 and raw.last(r).done.usage.completion_tokens == 12
        # Requests stepped together by the engine share response messages.
        assert max(len({e.request_id for e in resp.events}) for resp in raw.responses) >= 2
        assert STREAM_CALLS.labels("a")._value.get() == open_before + 1
        # A half-close ends the call with OK once nothing is in flight.
        raw.outbox.put_nowait(None)
        assert await raw.call.read() is grpc.aio.EOF
        assert await raw.call.code() == grpc.StatusCode.OK
        assert STREAM_CALLS.labels("a")._value.get() == open_before
        await poll(lambda: router.in_flight == 0)
        assert await poll(lambda: _no_leases(admission, "a"), what="the leases released")


async def test_a_half_close_waits_for_the_requests_in_flight(tmp_path: pathlib.Path, redis_url: str) -> None:
    async with router_mesh(tmp_path, redis_url) as (stub, _, _):
        raw = _Raw(stub)
        raw.send(_submit("a", max_tokens=30), _submit("b", max_tokens=5))
        raw.outbox.put_nowait(None)
        await raw.until_ended("a", "b")
        assert raw.tokens("a") == 30 and raw.tokens("b") == 5
        assert await raw.call.read() is grpc.aio.EOF
        assert await raw.call.code() == grpc.StatusCode.OK


async def test_a_bad_request_fails_alone_with_its_typed_reason(tmp_path: pathlib.Path, redis_url: str) -> None:
    async with router_mesh(tmp_path, redis_url) as (stub, _, _):
        raw = _Raw(stub)
        raw.send(_submit("long", max_tokens=40), _submit(""), _submit("x" * 129), _submit("hot", temperature=-1.0))
        raw.send(_submit("long"))                 # the same id again, while it runs
        await raw.until_ended("", "hot", done=("long",))
        errors = [(e.error.code, e.error.reason) for e in raw.events[""]]
        assert sorted(errors) == [("INVALID_ARGUMENT", "INVALID_REQUEST_ID"),
                                  ("INVALID_ARGUMENT", "MISSING_REQUEST_ID")]
        assert (raw.last("hot").error.code, raw.last("hot").error.reason) == ("INVALID_ARGUMENT", "INVALID_TEMPERATURE")
        long_errors = [e.error.reason for e in raw.events["long"] if e.WhichOneof("event") == "error"]
        assert long_errors == ["DUPLICATE_REQUEST_ID"]
        assert raw.last("long").WhichOneof("event") == "done" and raw.tokens("long") == 40   # it went on
        raw.send(_submit("after"))                # the call goes on
        await raw.until_ended("after")
        assert raw.last("after").WhichOneof("event") == "done"
        raw.call.cancel()


async def test_more_requests_than_the_call_allows_are_refused_stream_full(tmp_path: pathlib.Path,
                                                                          redis_url: str) -> None:
    async with router_mesh(tmp_path, redis_url, bounds=Bounds(max_stream_requests=2)) as (stub, _, _):
        raw = _Raw(stub)
        raw.send(_submit("a", max_tokens=20), _submit("b", max_tokens=20), _submit("c"))
        await raw.until_ended("a", "b", "c")
        c = raw.last("c").error
        assert (c.code, c.reason) == ("RESOURCE_EXHAUSTED", "STREAM_FULL") and c.retry_after_ms > 0
        assert raw.last("a").WhichOneof("event") == raw.last("b").WhichOneof("event") == "done"
        raw.send(_submit("c"))                    # room again
        await raw.until_ended(done=("c",))
        assert raw.last("c").WhichOneof("event") == "done"
        raw.call.cancel()


async def test_a_cancel_ends_that_request_only(tmp_path: pathlib.Path, redis_url: str) -> None:
    async with router_mesh(tmp_path, redis_url) as (stub, admission, router):
        raw = _Raw(stub)
        raw.send(_submit("stop-me", max_tokens=500), _submit("keep", max_tokens=30))
        async with asyncio.timeout(10):
            while "stop-me" not in raw.events or raw.tokens("stop-me") == 0:
                raw.responses.append(r := await raw.call.read())
                for e in r.events:
                    raw.events.setdefault(e.request_id, []).append(e)
        raw.send(cancel=("stop-me", "not-mine"))
        await raw.until_ended("stop-me", "keep")
        assert raw.last("stop-me").done.finish_reason == common_pb2.FINISH_REASON_CANCELLED
        assert raw.tokens("stop-me") < 500 and raw.tokens("keep") == 30
        await poll(lambda: router.in_flight == 0)
        assert await poll(lambda: _no_leases(admission, "a"), what="the leases released")
        raw.call.cancel()


async def test_a_client_gone_cancels_its_requests_aborts_engine_work_releases_leases(
        tmp_path: pathlib.Path, redis_url: str) -> None:
    mute = MuteEngine()
    async with router_mesh(tmp_path, redis_url, mute=mute, progress_timeout=30) as (stub, admission, router):
        raw = _Raw(stub)
        raw.send(*(_submit(f"s{i}") for i in range(3)))
        await poll(lambda: len(mute.submitted) == 3, what="the requests submitted")
        raw.call.cancel()
        await poll(lambda: router.in_flight == 0, what="the requests ended")
        await poll(lambda: sorted(mute.aborted) == sorted(mute.submitted), what="the engine work aborted")
        assert await poll(lambda: _no_leases(admission, "a"), what="the leases released")


async def test_a_request_timeout_ends_that_request_with_deadline_exceeded(tmp_path: pathlib.Path,
                                                                          redis_url: str) -> None:
    mute = MuteEngine()
    async with router_mesh(tmp_path, redis_url, mute=mute, progress_timeout=30) as (stub, admission, router):
        raw = _Raw(stub)
        raw.send(_submit("late", timeout_ms=400))
        await raw.until_ended("late", timeout=10)
        late = raw.last("late").error
        assert (late.code, late.reason) == ("DEADLINE_EXCEEDED", "DEADLINE_EXCEEDED")
        await poll(lambda: len(mute.submitted) == 1 and mute.aborted == mute.submitted, what="the engine work aborted")
        await poll(lambda: router.in_flight == 0)
        assert await poll(lambda: _no_leases(admission, "a"), what="the lease released")
        raw.call.cancel()


async def test_the_calls_deadline_bounds_its_requests(tmp_path: pathlib.Path, redis_url: str) -> None:
    mute = MuteEngine()
    async with router_mesh(tmp_path, redis_url, mute=mute, progress_timeout=30) as (stub, admission, router):
        call = stub.Stream(iter([inference_pb2.StreamRequest(submit=[_submit("x", timeout_ms=60_000)])]),
                           metadata=_md(), timeout=0.5)
        with pytest.raises(grpc.aio.AioRpcError) as info:
            async with asyncio.timeout(10):
                async for _ in call:
                    pass
        assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        await poll(lambda: router.in_flight == 0)
        assert await poll(lambda: _no_leases(admission, "a"), what="the lease released")


async def test_another_tenants_id_on_a_stream_is_independent(tmp_path: pathlib.Path, redis_url: str) -> None:
    async with router_mesh(tmp_path, redis_url) as (stub, _, _):
        a, b = _Raw(stub, "key-a"), _Raw(stub, "key-b")
        a.send(_submit("shared", max_tokens=30))
        b.send(_submit("shared", max_tokens=5), cancel=("shared",))   # b's cancel names b's own request
        await asyncio.gather(a.until_ended("shared"), b.until_ended("shared"))
        assert a.last("shared").done.finish_reason != common_pb2.FINISH_REASON_CANCELLED and a.tokens("shared") == 30
        a.call.cancel()
        b.call.cancel()


@pytest.mark.parametrize("garbage", [b"\xff\xff\xff\xff", b"\x0a\x05\x0a\x03\x0a\x01\xff"],
                         ids=["corrupt-wire-format", "invalid-utf8"])
async def test_an_undecodable_message_ends_the_call_with_invalid_argument(tmp_path: pathlib.Path, redis_url: str,
                                                                          garbage: bytes) -> None:
    async with router_mesh(tmp_path, redis_url) as (stub, _, router):
        channel = stub.channel  # type: ignore[attr-defined]
        method = channel.stream_stream("/tokenrelay.v1.Inference/Stream", request_serializer=None,
                                       response_deserializer=inference_pb2.StreamResponse.FromString)

        async def send() -> AsyncIterator[bytes]:
            yield inference_pb2.StreamRequest(submit=[_submit("first", max_tokens=300)]).SerializeToString()
            yield garbage
            await asyncio.Event().wait()   # keep the call open: the server must end it

        with pytest.raises(grpc.aio.AioRpcError) as info:
            async with asyncio.timeout(10):
                async for _ in method(send(), metadata=_md()):
                    pass
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert dict(info.value.trailing_metadata() or ())[REASON_KEY] == "MALFORMED_MESSAGE"
        await poll(lambda: router.in_flight == 0, what="the call's request cancelled")


async def test_a_call_without_a_valid_key_is_unauthenticated(tmp_path: pathlib.Path, redis_url: str,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    def authenticate(self: Keys, api_key: str | None) -> Tenant:
        if api_key not in TENANTS:
            raise Reason.INVALID_API_KEY.error("the API key matches no tenant")
        return TENANTS[api_key]

    monkeypatch.setattr(Keys, "authenticate", authenticate)
    def call(address: str) -> grpc.RpcError:
        # grpc's sync client: grpc.aio's may report INTERNAL "Internal error from Core" when its write
        # races the server's status (docs/reliability.md); the server's status is what is checked here.
        with grpc.insecure_channel(address) as channel:
            stream = inference_pb2_grpc.InferenceStub(channel).Stream(
                iter([inference_pb2.StreamRequest(submit=[_submit("x")])]), metadata=_md("no-such-key"), timeout=10)
            with pytest.raises(grpc.RpcError) as info:
                list(stream)
            return info.value

    async with router_mesh(tmp_path, redis_url) as (stub, _, router):
        for _ in range(5):
            error = await asyncio.to_thread(call, stub.address)  # type: ignore[attr-defined]
            assert error.code() == grpc.StatusCode.UNAUTHENTICATED  # type: ignore[attr-defined]
            assert dict(error.trailing_metadata() or ())[REASON_KEY] == "INVALID_API_KEY"  # type: ignore[attr-defined]
        assert router.in_flight == 0


def test_a_requests_unwritten_deltas_merge_in_order_around_its_other_events() -> None:
    call = _Call(None, None, None, 8)  # type: ignore[arg-type]   (emit and take need no router)
    call.emit("a", Accepted("a", 3, 0))
    call.emit("a", Delta("he", [1, 2]))
    call.emit("b", Delta("x", [9]))
    call.emit("a", Delta("llo", [3]))
    call.emit("a", Migrated(1, 3, "ENGINE_STALLED"))
    call.emit("a", Delta(" wo", [4]))
    call.emit("a", Delta("rld", [5]))
    call.emit("b", Delta("y", [10]))
    assert call.take() == [("a", Accepted("a", 3, 0)), ("a", Delta("hello", [1, 2, 3])), ("b", Delta("xy", [9, 10])),
                           ("a", Migrated(1, 3, "ENGINE_STALLED")), ("a", Delta(" world", [4, 5]))]
    assert not call.wake.is_set()
    call.emit("a", Delta("!", [6]))          # after a take, a new delta is a new message's
    assert call.take() == [("a", Delta("!", [6]))]


# ---------------------------------------------------------------------------------- typed client
async def test_the_typed_client_runs_many_requests_and_raises_each_ones_error(tmp_path: pathlib.Path,
                                                                              redis_url: str) -> None:
    async with router_mesh(tmp_path, redis_url) as (stub, _, router):
        async with Client(stub.address, "key-a") as client, client.open_stream() as many:  # type: ignore[attr-defined]
            results = await asyncio.gather(*(many.generate(f"prompt {i}", max_tokens=6 + i, ignore_eos=True)
                                             for i in range(10)))
            assert [r.finished.completion_tokens for r in results] == [6 + i for i in range(10)]
            with pytest.raises(InvalidArgument) as info:
                await many.generate("bad", max_tokens=4, temperature=-1.0)
            assert info.value.reason == Reason.INVALID_TEMPERATURE
            # Breaking out cancels that request at the router; the call goes on.
            async for event in many.stream("long", max_tokens=500, ignore_eos=True):
                if isinstance(event, TextDelta):
                    break
            await poll(lambda: router.in_flight == 0, what="the abandoned request cancelled")
            again = await many.generate("still there?", max_tokens=4, ignore_eos=True)
            assert again.finished.completion_tokens == 4


async def test_the_typed_clients_requests_fail_when_the_call_ends(tmp_path: pathlib.Path, redis_url: str) -> None:
    mute = MuteEngine()
    async with router_mesh(tmp_path, redis_url, mute=mute, progress_timeout=30) as (stub, _, _):
        async with Client(stub.address, "key-a") as client:  # type: ignore[attr-defined]
            many = client.open_stream(timeout=0.5)
            async with many:
                with pytest.raises(DeadlineExceeded):
                    await asyncio.wait_for(many.generate("never answered", max_tokens=4), 10)
            with pytest.raises(DeadlineExceeded):    # and a request after it ended
                await many.generate("too late", max_tokens=4)


async def test_the_typed_client_timeout_is_the_requests_own(tmp_path: pathlib.Path, redis_url: str) -> None:
    mute = MuteEngine()
    async with router_mesh(tmp_path, redis_url, mute=mute, progress_timeout=30,
                           bounds=Bounds(max_stream_requests=1)) as (stub, _, _):
        async with Client(stub.address, "key-a") as client, client.open_stream() as many:  # type: ignore[attr-defined]
            first = asyncio.ensure_future(many.generate("never answered", max_tokens=4, timeout=0.5))
            await asyncio.sleep(0.1)
            with pytest.raises(ResourceExhausted) as info:
                await many.generate("one too many", max_tokens=4)
            assert info.value.reason == Reason.STREAM_FULL
            with pytest.raises(DeadlineExceeded) as late:
                await asyncio.wait_for(first, 10)
            assert late.value.reason == Reason.DEADLINE_EXCEEDED
