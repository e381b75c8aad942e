"""A tokenizer killed mid-load: in-flight Tokenize and Detokenize calls fail UNAVAILABLE
(UPSTREAM_UNAVAILABLE, retryable), never INTERNAL ("Internal error from Core"), so clients that
retry on UNAVAILABLE do. Real tokenizer process, SIGKILL while calls are in flight."""

from __future__ import annotations

import asyncio
import os
import pathlib
import signal
import subprocess
import sys

import grpc
import pytest

from router_svc.upstreams import TokenizerUpstream
from services.errors import Reason, TokenrelayError
from services.mux import StreamBroken, stream_error
from tests.waiting import poll
from tokenrelay_tools.cli.byte_tokenizer import ensure_byte_tokenizer

REPO = pathlib.Path(__file__).resolve().parents[2]


def _spawn_tokenizer(tmp: pathlib.Path, port_file: pathlib.Path) -> subprocess.Popen[bytes]:
    tokenizer = ensure_byte_tokenizer(tmp / "cache")
    return subprocess.Popen([sys.executable, "-m", "tokenizer_svc", "--tokenizer", str(tokenizer), "--port", "0",
                             "--port-file", str(port_file), "--log-level", "WARNING"], cwd=REPO,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


async def _start_tokenizer(tmp: pathlib.Path) -> tuple[subprocess.Popen[bytes], str]:
    port_file = tmp / "tok.port"
    proc = _spawn_tokenizer(tmp, port_file)
    await poll(lambda: port_file.exists() and port_file.read_text().strip(), timeout=30, what="tokenizer port")
    return proc, f"127.0.0.1:{port_file.read_text().strip()}"


async def test_tokenizer_killed_mid_load_is_unavailable(tmp_path: pathlib.Path) -> None:
    proc, address = await _start_tokenizer(tmp_path)
    upstream = TokenizerUpstream([address], timeout=20.0)
    try:
        await poll(_ready(upstream), timeout=20, what="tokenizer info")
        text = "load " * 200_000   # ~1 MB: encoding takes long enough to be in flight at the kill
        errors: list[BaseException] = []
        stop = asyncio.Event()

        async def tokenize_forever() -> None:
            while not stop.is_set():
                try:
                    await upstream.tokenize(text=text, timeout=20.0)
                except TokenrelayError as exc:
                    errors.append(exc)
                    return

        async def detokenize_forever(i: int) -> None:
            session = upstream.detokenizer(f"d{i}")
            session.start([], False, [], {})
            n = 0
            while not stop.is_set():
                session.send([65 + n % 26], final=False)
                n += 1
                out = await session.next()
                if isinstance(out, StreamBroken):
                    errors.append(out.error)
                    return

        tasks = [asyncio.create_task(tokenize_forever()) for _ in range(6)]
        tasks += [asyncio.create_task(detokenize_forever(i)) for i in range(8)]
        batcher = upstream._replicas[0].batcher
        await poll(lambda: batcher._in_flight and batcher.calls_sent >= 2, timeout=20, what="calls in flight")
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
        await asyncio.wait_for(asyncio.gather(*tasks), 30)
        assert len(errors) == len(tasks)
        for error in errors:
            assert isinstance(error, TokenrelayError)
            assert error.code == grpc.StatusCode.UNAVAILABLE, (error.reason, error.message)
            assert error.reason == Reason.UPSTREAM_UNAVAILABLE
            assert error.retryable
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        await upstream.close()


def _ready(upstream: TokenizerUpstream):
    async def ready() -> bool:
        try:
            await upstream.info()
        except TokenrelayError:
            return False
        return True
    return ready


class _FakeRpcError(grpc.aio.AioRpcError):
    def __init__(self, code: grpc.StatusCode, details: str, trailing: tuple[tuple[str, str], ...] = ()) -> None:
        super().__init__(code, grpc.aio.Metadata(), grpc.aio.Metadata(*trailing), details)


@pytest.mark.parametrize("code", [grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN, grpc.StatusCode.UNAVAILABLE,
                                  grpc.StatusCode.CANCELLED])
def test_transport_failures_without_a_reason_are_upstream_unavailable(code: grpc.StatusCode) -> None:
    error = stream_error(_FakeRpcError(code, "Internal error from Core"), "tokenizer")
    assert error.reason == Reason.UPSTREAM_UNAVAILABLE and error.code == grpc.StatusCode.UNAVAILABLE


def test_a_peer_reason_is_kept() -> None:
    exc = _FakeRpcError(grpc.StatusCode.INTERNAL, "boom", (("tokenrelay-reason", str(Reason.TOKENIZER_ERROR)),))
    assert stream_error(exc, "tokenizer").reason == Reason.TOKENIZER_ERROR
    exc = _FakeRpcError(grpc.StatusCode.INVALID_ARGUMENT, "bad", (("tokenrelay-reason", str(Reason.EMPTY_PROMPT)),))
    assert stream_error(exc, "tokenizer").reason == Reason.EMPTY_PROMPT
