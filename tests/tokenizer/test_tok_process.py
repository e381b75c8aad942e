"""`python -m tokenizer_svc` as a real process: port file, serving, SIGTERM; settings parsing."""

from __future__ import annotations

import asyncio
import os
import pathlib
import signal
import subprocess
import sys
import time
import urllib.request

import pytest

from services.channels import open_channel
from services.grpc_util import wait_healthy
from services.proto.tokenrelay.v1 import tokenizer_pb2, tokenizer_pb2_grpc
from tokenizer_svc.config import load_settings

REPO = pathlib.Path(__file__).resolve().parents[2]


def _env() -> dict[str, str]:
    # The repo root on the path, in case the editable install predates tokenizer_svc.
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONPATH": path}


def test_help_works() -> None:
    out = subprocess.run([sys.executable, "-m", "tokenizer_svc", "--help"], cwd=REPO, env=_env(),
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0
    assert "--chat-template" in out.stdout and "TOKENRELAY_TOKENIZER_PORT_FILE" in out.stdout


@pytest.mark.parametrize("problem", ["missing", "garbage", "bad-template"])
def test_startup_errors_are_one_clear_line(tmp_path: pathlib.Path, tiny_dirs: dict[str, pathlib.Path],
                                           problem: str) -> None:
    args = ["--tokenizer", str(tmp_path / "nowhere")]
    if problem == "garbage":
        (tmp_path / "tokenizer.json").write_text("{not json")
        args = ["--tokenizer", str(tmp_path)]
    elif problem == "bad-template":
        (tmp_path / "t.jinja").write_text("{% for %}")
        args = ["--tokenizer", str(tiny_dirs["tiny-bytelevel"]), "--chat-template", str(tmp_path / "t.jinja")]
    out = subprocess.run([sys.executable, "-m", "tokenizer_svc", *args, "--log-format", "console"], cwd=REPO,
                         env=_env(), capture_output=True, text=True, timeout=60)
    assert out.returncode == 1
    assert "tokenizer_svc: cannot start:" in out.stderr and "Traceback" not in out.stderr


def test_settings_from_flags_and_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TOKENRELAY_TOKENIZER_MAX_BATCH", "7")
    monkeypatch.setenv("TOKENRELAY_TOKENIZER_TOKENIZER", "/from/env")
    settings = load_settings(["--tokenizer", "/from/flag", "--workers", "3"])
    assert (settings.tokenizer, settings.max_batch, settings.workers) == ("/from/flag", 7, 3)
    assert settings.effective_workers() == 3
    monkeypatch.delenv("TOKENRELAY_TOKENIZER_TOKENIZER")
    with pytest.raises(SystemExit):
        load_settings([])


async def _serving(port_file: pathlib.Path, *args: str, stdout: int) -> tuple[asyncio.subprocess.Process, str]:
    """`python -m tokenizer_svc ARGS` on an ephemeral port, once healthy: (process, address)."""
    env = {k: v for k, v in _env().items() if k != "RAYON_NUM_THREADS"}
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "tokenizer_svc", "--port", "0", "--port-file", str(port_file), *args,
        cwd=REPO, env=env, stdout=stdout, stderr=asyncio.subprocess.STDOUT)
    deadline = time.monotonic() + 60
    while not port_file.exists():
        if proc.returncode is not None or time.monotonic() > deadline:
            if proc.returncode is None:
                proc.kill()
            raise AssertionError(f"tokenizer did not start: {(await proc.communicate())[0]!r}")
        await asyncio.sleep(0.05)
    address = f"127.0.0.1:{int(port_file.read_text())}"
    await wait_healthy(address, timeout=30)
    return proc, address


async def test_process_serves_and_stops_on_sigterm(tmp_path: pathlib.Path,
                                                   tiny_dirs: dict[str, pathlib.Path]) -> None:
    metrics_file = tmp_path / "metrics.port"
    proc, address = await _serving(
        tmp_path / "tok.port", "--tokenizer", str(tiny_dirs["tiny-sentencepiece"]), "--log-format", "console",
        "--shutdown-grace", "1", "--metrics-port", "0", "--metrics-port-file", str(metrics_file),
        stdout=asyncio.subprocess.PIPE)
    try:
        async with open_channel(address) as channel:
            stub = tokenizer_pb2_grpc.TokenizerStub(channel)
            info = await stub.Info(tokenizer_pb2.InfoRequest())
            assert info.name == "sentencepiece"
            resp = await stub.Tokenize(tokenizer_pb2.TokenizeRequest(
                inputs=[tokenizer_pb2.TokenizeInput(text="hello", add_special_tokens=True)]))
            assert resp.results[0].ids[0] == 1
        url = f"http://127.0.0.1:{int(metrics_file.read_text())}/metrics"
        body = await asyncio.to_thread(lambda: urllib.request.urlopen(url, timeout=10).read().decode())
        assert 'tokenrelay_tokenizer_tokenize_inputs_total{kind="text"} 1.0' in body
        proc.send_signal(signal.SIGTERM)
        output, _ = await asyncio.wait_for(proc.communicate(), timeout=30)
        assert proc.returncode == 0, output
        assert b"tokenizer_stopped" in output
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


async def _threads_after_a_batch(tmp_path: pathlib.Path, tokenizer: pathlib.Path, library_threads: int) -> int:
    """Threads of a tokenizer process started with --library-threads N, after one batched call."""
    proc, address = await _serving(tmp_path / f"lib{library_threads}.port", "--tokenizer", str(tokenizer),
                                   "--library-threads", str(library_threads), "--log-level", "WARNING",
                                   stdout=asyncio.subprocess.DEVNULL)
    try:
        async with open_channel(address) as channel:
            stub = tokenizer_pb2_grpc.TokenizerStub(channel)
            await stub.Tokenize(tokenizer_pb2.TokenizeRequest(
                inputs=[tokenizer_pb2.TokenizeInput(text=f"text number {i}") for i in range(16)]))
        return len(os.listdir(f"/proc/{proc.pid}/task"))
    finally:
        proc.kill()
        await proc.wait()


async def test_library_threads_sizes_the_library_pool(tmp_path: pathlib.Path,
                                                      tiny_dirs: dict[str, pathlib.Path]) -> None:
    """`--library-threads` (what `tokenrelay up --tokenizers N` gives each replica) sizes the
    tokenizers library's pool: everything else equal, 3 threads there make 2 more than 1."""
    tokenizer = tiny_dirs["tiny-bytelevel"]
    one = await _threads_after_a_batch(tmp_path, tokenizer, 1)
    three = await _threads_after_a_batch(tmp_path, tokenizer, 3)
    assert three - one == 2
