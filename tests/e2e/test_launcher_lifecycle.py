"""`tokenrelay up` never leaves orphan servers: SIGTERM stops it cleanly, and even kill -9 of the
launcher takes every child down with it. It never harms another mesh: a second `up` in the same run
directory is refused at once (it used to delete the first mesh's Redis socket, so the first answered
REDIS_UNAVAILABLE), and a port in use is one line naming the fix, before anything is started.
`tokenrelay chat`: Ctrl-C stops only the reply in progress; Ctrl-C at the prompt, or end of input, quits."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import psutil
import pytest

from services.channels import open_channel
from services.client import Client
from services.proto.tokenrelay.v1 import common_pb2, inference_pb2, inference_pb2_grpc
from tests.meshkit import start_mesh, stop_mesh
from tests.waiting import poll
from tokenrelay_tools.cli.preflight import bind_failure


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_no_orphans_after_the_launcher_stops(tmp_path, model_dir, sig):
    mesh = start_mesh(tmp_path, model_dir, "sim")
    children = psutil.Process(mesh.proc.pid).children(recursive=True)
    names = " ".join(" ".join(c.cmdline()) for c in children)
    for part in ("redis-server", "tokenizer_svc", "engine_svc", "router_svc"):
        assert part in names
    mesh.proc.send_signal(sig)
    code = mesh.proc.wait(60)
    if sig == signal.SIGTERM:
        assert code == 0, mesh.log.read_text()[-2000:]
    _, alive = psutil.wait_procs(children, timeout=30)
    assert alive == []


def _up(model_dir, *argv: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "tokenrelay_tools.cli.main", "up", "--model", str(model_dir),
                           "--engine", "sim", *argv], capture_output=True, text=True, timeout=timeout)


async def _serves(address: str, api_key: str) -> int:
    async with Client(address, api_key, timeout=30) as client:
        result = await client.generate("Once upon a time", max_tokens=4)
    return result.finished.completion_tokens


async def test_a_second_up_in_the_same_run_dir_is_refused_and_the_first_keeps_serving(tmp_path, model_dir):
    first = start_mesh(tmp_path, model_dir, "sim")
    try:
        sock = tmp_path / "run" / "redis.sock"
        assert sock.exists()
        port = first.address.rsplit(":", 1)[1]
        # As the issue saw it: the same run dir and the same (default) port as the running mesh.
        second = _up(model_dir, "--port", port, "--run-dir", str(tmp_path / "run"),
                     "--state-file", str(tmp_path / "second.json"))
        # The harm first: the first mesh keeps its Redis socket and serves.
        assert sock.exists(), second.stderr
        assert await _serves(first.address, first.api_key) == 4
        assert second.returncode == 2, second.stderr
        lines = second.stderr.strip().splitlines()
        assert lines[-1] == (f"[tokenrelay] error: tokenrelay up is already running in {tmp_path / 'run'} "
                             f"(pid {first.proc.pid}): stop it, or pass --run-dir (and --port 0 or another "
                             "--port) to run a second mesh beside it")
        assert "Traceback" not in second.stderr and "starting" not in second.stderr
        assert not (tmp_path / "second.json").exists()
    finally:
        assert stop_mesh(first) == 0, first.log.read_text()[-2000:]


def test_a_port_in_use_is_one_line_before_anything_starts(tmp_path, model_dir):
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        started = time.monotonic()
        out = _up(model_dir, "--port", str(port), "--run-dir", str(tmp_path / "run"),
                  "--state-file", str(tmp_path / "state.json"), timeout=60)
        took = time.monotonic() - started
    assert out.returncode == 2, out.stderr
    assert out.stderr.strip().splitlines() == [
        f"[tokenrelay] error: port 127.0.0.1:{port} is in use (Address already in use): pass --port 0 (any "
        "free port; `generate` and `chat` find it in the state file) or another --port, or stop what holds it"]
    # Refused before any service started (it used to load the engines first, then fail after ~15 s).
    assert not (tmp_path / "run" / "logs").exists()
    assert took < 30


def test_a_router_that_failed_to_bind_is_recognised_in_its_log():
    tail = ("Traceback (most recent call last):\n  ...\nOSError: could not bind 127.0.0.1:50051: Failed to bind "
            "to address 127.0.0.1:50051; set GRPC_VERBOSITY=debug environment variable to see detailed error")
    assert bind_failure(tail) == "127.0.0.1:50051"
    assert bind_failure("OSError: could not bind [::1]:7000\n") == "[::1]:7000"
    assert bind_failure("RuntimeError: engine failed to load") is None


CHATML = ("--tokenizer-arg=--chat-template=chatml",)   # the test models ship no chat template


class _Chat:
    """`tokenrelay chat` as a process, its output collected by a thread."""

    def __init__(self, state_file, *argv: str) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", "tokenrelay_tools.cli.main", "chat", "--state-file",
                                      str(state_file), *argv], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE)
        self.out = bytearray()
        self.err = bytearray()
        for stream, buffer in ((self.proc.stdout, self.out), (self.proc.stderr, self.err)):
            threading.Thread(target=self._pump, args=(stream, buffer), daemon=True).start()

    @staticmethod
    def _pump(stream, buffer: bytearray) -> None:
        while chunk := os.read(stream.fileno(), 4096):
            buffer.extend(chunk)

    def say(self, line: str) -> None:
        self.proc.stdin.write(line.encode() + b"\n")
        self.proc.stdin.flush()

    def text(self) -> str:
        return self.out.decode(errors="replace")


async def test_chat_ctrl_c_stops_the_reply_and_ctrl_c_at_the_prompt_quits(tmp_path, model_dir):
    # 0.1 s per token: a 300-token reply would take 30 s, so it is surely streaming when Ctrl-C comes.
    mesh = start_mesh(tmp_path, model_dir, "sim", "--engine-arg=--sim-decode-step-time=0.1", *CHATML)
    chat = _Chat(tmp_path / "state.json", "--max-tokens", "300")
    try:
        await poll(lambda: b"[session " in chat.err, 60, "the session banner")
        chat.say("hello")
        await poll(lambda: len(chat.text()) > len("> ") + 3, 30, "the reply to start")
        assert "[turn failed" not in chat.text(), chat.text()
        chat.proc.send_signal(signal.SIGINT)
        await poll(lambda: "[cancelled, " in chat.text(), 30, "the reply to stop")
        await poll(lambda: chat.text().endswith("> "), 10, "the next prompt")
        assert chat.proc.poll() is None, chat.err.decode()               # the session goes on
        assert "reply stopped; Ctrl-C at the prompt or Ctrl-D quits" in chat.text()
        chat.proc.send_signal(signal.SIGINT)                               # at the prompt: quit
        assert chat.proc.wait(30) == 0, chat.err.decode()
        assert "Traceback" not in chat.err.decode()
    finally:
        if chat.proc.poll() is None:
            chat.proc.kill()
        assert stop_mesh(mesh) == 0


async def test_chat_ends_at_the_end_of_input_and_a_raw_request_gets_the_default_max_tokens(tmp_path, model_dir):
    mesh = start_mesh(tmp_path, model_dir, "sim", *CHATML)
    try:
        out = await asyncio.to_thread(
            subprocess.run, [sys.executable, "-m", "tokenrelay_tools.cli.main", "chat", "--state-file",
                             str(tmp_path / "state.json"), "--max-tokens", "3"], input="hi\n", capture_output=True,
            text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        assert "[length, 3 tokens]" in out.stdout
        # A raw gRPC request that sets no max_tokens: served with the router's --default-max-tokens
        # (256), where it used to be INVALID_MAX_TOKENS. ignore_eos: the sim may draw an EOS earlier.
        async with open_channel(mesh.address) as channel:
            call = inference_pb2_grpc.InferenceStub(channel).Generate(
                inference_pb2.GenerateRequest(prompt="Once upon a time",
                                              sampling=common_pb2.SamplingParams(ignore_eos=True)),
                metadata=(("authorization", f"Bearer {mesh.api_key}"),), timeout=60)
            events = [msg async for msg in call]
        assert events[-1].WhichOneof("event") == "done", events[-1]
        assert events[-1].done.usage.completion_tokens == 256
    finally:
        assert stop_mesh(mesh) == 0


async def test_up_serves_a_given_tenants_file_and_refuses_a_bad_one_before_starting(tmp_path, model_dir):
    import hashlib

    bad = tmp_path / "bad.yaml"
    bad.write_text("tenants:\n  - name: a\n    api_key_sha256: nothex\n    max_in_flight: 2\n")
    r = _up(model_dir, "--tenants-file", str(bad), "--port", "0", "--run-dir", str(tmp_path / "badrun"))
    assert r.returncode == 2 and "api_key_sha256" in r.stderr and len(r.stderr.strip().splitlines()) <= 3, r.stderr
    assert not (tmp_path / "badrun" / "logs").exists()            # nothing was started
    good = tmp_path / "tenants.yaml"
    key = "team-key-" + "k" * 20
    good.write_text(f"tenants:\n  - name: team\n    api_key_sha256: {hashlib.sha256(key.encode()).hexdigest()}\n"
                    "    max_in_flight: 2\n    max_queued: 0\n")
    mesh = start_mesh(tmp_path, model_dir, "sim", "--tenants-file", str(good))
    try:
        assert mesh.state["api_key"] == ""                        # no key of the user's file is known to `up`
        assert await _serves(mesh.address, key) == 4
    finally:
        assert stop_mesh(mesh) == 0, mesh.log.read_text()[-2000:]
