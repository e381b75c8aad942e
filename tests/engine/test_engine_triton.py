"""The `triton` backend against a real Triton Inference Server (NVIDIA PyTriton on this CPU).

The server (`tests/fakes/triton_trtllm_server.py`) serves a decoupled Python model with the tensor
interface of TensorRT-LLM's Triton backend. It starts once per module (seconds); tests skip, saying
why, only where PyTriton cannot be installed or tritonclient (the `triton` extra) is missing.
"""

from __future__ import annotations

import asyncio
import pathlib
from collections.abc import AsyncIterator, Iterator
from typing import Any

import numpy as np
import pytest

pytest.importorskip("tritonclient.grpc.aio", reason="the triton extra (tritonclient) is not installed")

import tritonclient.grpc.aio as triton_aio

from engine_svc.backends import create_backend
from engine_svc.backends.base import FinishReason
from engine_svc.backends.events import HealthState
from engine_svc.backends.triton import TritonBackend
from engine_svc.backends.triton_config import TritonConfig
from engine_svc.config import EngineSettings
from services.errors import Reason
from tests.engine.engine_testkit import Collector, poll, req
from tests.fakes.triton_env import TritonProcess, pytriton_python, start_server

VOCAB = 1000          # the fake model's, see triton_trtllm_server.py
ERROR_AFTER_2 = 999


def expected(prompt: list[int], n: int) -> list[int]:
    return [(prompt[-1] + k + 1) % VOCAB for k in range(n)]


@pytest.fixture(scope="module")
def python() -> str:
    interpreter, why = pytriton_python()
    if interpreter is None:
        pytest.skip(f"PyTriton cannot be installed here: {why}")
    return interpreter


@pytest.fixture(scope="module")
def triton(python: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[TritonProcess]:
    server = start_server(python, tmp_path_factory.mktemp("triton"))
    yield server
    server.stop()


def config(url: str, **overrides: Any) -> TritonConfig:
    values: dict[str, Any] = {"url": url, "connect_timeout": 60.0, "health_interval": 0.0, "end_id": 2,
                              "request_id_parameter": "tokenrelay_request_id", "max_context": 4096}
    values.update(overrides)
    return TritonConfig(**values)


@pytest.fixture
async def backend(triton: TritonProcess) -> AsyncIterator[TritonBackend]:
    engine = TritonBackend(config(triton.url))
    await engine.start()
    yield engine
    await engine.close()


async def live_requests(url: str) -> int:
    """How many generations run inside the server (its ``live_requests`` model)."""
    client = triton_aio.InferenceServerClient(url)
    try:
        result = await client.infer("live_requests", inputs=[])
        return int(np.asarray(result.as_numpy("count")).reshape(-1)[0])
    finally:
        await client.close()


async def test_streams_tokens_until_max_tokens(backend: TritonBackend) -> None:
    sink = Collector()
    backend.submit(req("e", [1], max_tokens=6), sink)   # the configured end id (2) is the first token
    await sink.wait("e")
    assert sink.tokens("e") == [2] and sink.last("e").finish_reason is FinishReason.STOP
    backend.submit(req("a", [7, 8, 9], max_tokens=6), sink)
    await sink.wait("a")
    assert sink.tokens("a") == expected([9], 6)
    assert len(sink.events["a"]) == 6   # one response per token, streamed
    assert sink.last("a").finish_reason is FinishReason.LENGTH
    assert backend.load().active == 0 and backend.generated_tokens_total >= 6
    assert (backend.model, backend.max_context) == ("tensorrt_llm", 4096)


async def test_the_end_id_and_stop_ids_end_a_request_and_are_emitted(backend: TritonBackend) -> None:
    sink = Collector()
    backend.submit(req("eos", [20], max_tokens=50, eos_token_ids=[24]), sink)        # end_id
    backend.submit(req("stop", [30], max_tokens=50, stop_token_ids=[33]), sink)      # stop_words_list
    backend.submit(req("ignore", [20], max_tokens=6, eos_token_ids=[24], ignore_eos=True), sink)
    await sink.wait("eos", "stop", "ignore")
    assert sink.tokens("eos") == [21, 22, 23, 24] and sink.last("eos").finish_reason is FinishReason.STOP
    assert sink.tokens("stop") == [31, 32, 33] and sink.last("stop").finish_reason is FinishReason.STOP
    assert sink.tokens("ignore") == expected([20], 6) and sink.last("ignore").finish_reason is FinishReason.LENGTH


async def test_concurrent_requests_stream_independently(backend: TritonBackend) -> None:
    sink = Collector()
    prompts = {f"c{i}": [100 * i + 10] for i in range(6)}
    for rid, prompt in prompts.items():
        backend.submit(req(rid, prompt, max_tokens=8, temperature=0.5, top_p=0.9, top_k=4, seed=3), sink)
    assert backend.load().active == 6
    await sink.wait(*prompts)
    for rid, prompt in prompts.items():
        assert sink.tokens(rid) == expected(prompt, 8)


async def test_stop_ends_one_request_inside_the_server(backend: TritonBackend, triton: TritonProcess) -> None:
    sink = Collector()
    backend.submit(req("long", [40], max_tokens=10_000), sink)   # ~20 s at the fake's step
    backend.submit(req("short", [5], max_tokens=40), sink)
    await poll(lambda: sink.count("long") >= 2, what="the long request streaming")
    assert backend.abort("long")
    assert sink.last("long").finish_reason is FinishReason.CANCELLED   # at once
    assert not backend.abort("long")
    n = len(sink.events["long"])
    await sink.wait("short")
    assert sink.tokens("short") == expected([5], 40)   # its neighbour was not disturbed
    await poll(lambda: nothing_live(triton.url), timeout=20, what="the server to stop it")
    assert len(sink.events["long"]) == n   # nothing after the CANCELLED event
    await poll(lambda: not backend._tasks, what="the stopped stream to close")


async def nothing_live(url: str) -> bool:
    return await live_requests(url) == 0


async def test_an_error_mid_stream_fails_only_that_request(backend: TritonBackend) -> None:
    sink = Collector()
    backend.submit(req("bad", [ERROR_AFTER_2, 4], max_tokens=10), sink)
    await sink.wait("bad")
    last = sink.last("bad")
    assert sink.tokens("bad") == expected([4], 2)
    assert last.finish_reason is FinishReason.ERROR and last.error_reason == Reason.ENGINE_ERROR
    assert "fake engine failure" in last.error_message
    assert backend.health() is HealthState.SERVING
    backend.submit(req("good", [4], max_tokens=3), sink)
    await sink.wait("good")
    assert sink.last("good").finish_reason is FinishReason.LENGTH


async def test_the_engine_service_streams_from_triton(triton: TritonProcess) -> None:
    from engine_svc.app import start_engine
    from services.channels import open_channel
    from services.proto.tokenrelay.v1 import engine_pb2_grpc
    from tests.engine.engine_testkit import StreamClient, engine_request

    settings = EngineSettings(backend="triton", port=0, triton=config(triton.url).model_dump())
    engine, server = await start_engine(settings)
    channel = open_channel(server.address)
    try:
        client = StreamClient(engine_pb2_grpc.EngineStub(channel))
        client.submit(engine_request("a", [7, 8], max_tokens=5), engine_request("b", [50], max_tokens=30, eos=[53]))
        await client.wait("a", "b")
        assert client.tokens("a") == expected([8], 5) and client.tokens("b") == [51, 52, 53]
        client.half_close()
        await client.ended()
    finally:
        await channel.close()
        await server.stop(0)
        await engine.close()


async def test_a_model_that_is_not_decoupled_is_refused(triton: TritonProcess) -> None:
    engine = TritonBackend(config(triton.url, model_name="live_requests"))
    with pytest.raises(RuntimeError, match="not decoupled"):
        await engine.start()


async def test_no_server_at_start_is_one_clear_error() -> None:
    engine = TritonBackend(TritonConfig(url="127.0.0.1:1", connect_timeout=0.3))
    with pytest.raises(RuntimeError, match=r"not ready at 127\.0\.0\.1:1 "):
        await engine.start()


@pytest.mark.slow
async def test_the_server_going_away_fails_requests_retryably_and_a_restarted_one_is_served_again(
        python: str, tmp_path: pathlib.Path) -> None:
    server = start_server(python, tmp_path)   # its own server: this test stops it
    engine = TritonBackend(config(server.url, health_interval=0.05))
    try:
        await engine.start()
        sink = Collector()
        engine.submit(req("r", [40], max_tokens=10_000), sink)
        await poll(lambda: sink.count("r") >= 1, what="a first token")
        await asyncio.to_thread(server.kill)
        await sink.wait("r", timeout=30)
        assert sink.last("r").error_reason == Reason.ENGINE_UNAVAILABLE, sink.last("r").error_message[-600:]
        assert Reason.ENGINE_UNAVAILABLE.retryable
        await poll(lambda: engine.health() is HealthState.UNAVAILABLE, what="health UNAVAILABLE")
        with pytest.raises(Exception) as refused:
            engine.submit(req("r2", [1], max_tokens=1), sink)
        assert getattr(refused.value, "reason", "") == Reason.ENGINE_UNAVAILABLE
        # The server restarts on its address: the backend serves again by itself (no restart here).
        port = int(server.url.rsplit(":", 1)[1])
        (tmp_path / "again").mkdir()
        server = await asyncio.to_thread(start_server, python, tmp_path / "again", 120.0, port)
        await poll(lambda: engine.health() is HealthState.SERVING, timeout=30, what="serving again")
        assert engine.recoveries == 1
        engine.submit(req("r3", [40], max_tokens=3), sink)
        await sink.wait("r3", timeout=30)
        assert sink.last("r3").finish_reason is not FinishReason.ERROR, sink.last("r3").error_message
        assert len(sink.tokens("r3")) == 3
    finally:
        await engine.close()
        server.stop()


def test_registered_with_its_settings_section(monkeypatch: pytest.MonkeyPatch) -> None:
    settings = EngineSettings(backend="triton", triton={"url": "10.0.0.2:8001", "model_name": "ensemble_ids"})
    engine = create_backend(settings)
    assert isinstance(engine, TritonBackend) and engine.config.model_name == "ensemble_ids"
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "tritonclient" else real(name, *a))
    with pytest.raises(ValueError, match=r"needs the 'triton' extra .*tokenrelay\[triton\]"):
        create_backend(settings)
