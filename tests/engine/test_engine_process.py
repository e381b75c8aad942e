"""`python -m engine_svc` as a real process: --port-file, serving, SIGTERM shutdown."""

from __future__ import annotations

import asyncio
import json
import os
import pathlib
import signal
import subprocess
import sys
import time

from services.channels import open_channel
from services.grpc_util import wait_healthy
from services.proto.tokenrelay.v1 import common_pb2, engine_pb2, engine_pb2_grpc
from tests.engine.engine_testkit import StreamClient, engine_request, poll

REPO = pathlib.Path(__file__).resolve().parents[2]


async def test_engine_process_serves_and_stops_cleanly_on_sigterm(tmp_path: pathlib.Path) -> None:
    port_file = tmp_path / "engine.port"
    env = {**os.environ, "TOKENRELAY_ENGINE_SIM_DECODE_STEP_TIME": "0.001"}
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "engine_svc", "--backend", "sim", "--port", "0", "--port-file", str(port_file),
        "--sim-vocab-size", "5000", "--shutdown-grace", "30",
        cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        port = await poll(lambda: port_file.exists() and port_file.read_text().strip(), timeout=30,
                          what="port file")
        address = f"127.0.0.1:{int(port)}"
        await wait_healthy(address, timeout=10)
        async with open_channel(address) as channel:
            stub = engine_pb2_grpc.EngineStub(channel)
            client = StreamClient(stub)
            client.submit(engine_request("p1", [1, 2, 3], 20), engine_request("p2", [4, 5], 20))
            await client.wait("p1", "p2", timeout=20)
            assert len(client.tokens("p1")) == 20 and all(t < 5000 for t in client.tokens("p1"))
            assert client.last("p2").finish_reason == common_pb2.FINISH_REASON_LENGTH
            load = await stub.GetLoad(engine_pb2.LoadRequest())
            assert load.backend == "sim" and load.generated_tokens_total == 40
            # SIGTERM while a request is in flight: it still completes, later submits are refused,
            # and the stream then ends by itself so the process exits without waiting out the grace.
            client.submit(engine_request("in-flight", [6, 7], 300))
            await poll(lambda: client.tokens("in-flight"), what="in-flight request running")
            proc.send_signal(signal.SIGTERM)
            t_term = time.monotonic()
            await client.wait("in-flight", timeout=20)
            assert len(client.tokens("in-flight")) == 300
            assert client.last("in-flight").finish_reason == common_pb2.FINISH_REASON_LENGTH
            await client.ended(timeout=20)
        _, err = await asyncio.wait_for(proc.communicate(), timeout=30)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    stderr = err.decode()
    assert proc.returncode == 0, stderr
    events = [json.loads(line) for line in stderr.splitlines() if line.startswith("{")]
    listening = [e for e in events if e.get("event") == "listening"]
    assert len(listening) == 1 and listening[0]["address"] == address
    assert listening[0]["service"] == "engine"
    assert any(e.get("event") == "shutting_down" for e in events)
    assert time.monotonic() - t_term < 20  # well under the 30 s grace: nothing was left to wait for


def test_help_works_without_starting_anything() -> None:
    out = subprocess.run([sys.executable, "-m", "engine_svc", "--help"], cwd=REPO, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0
    assert "--backend" in out.stdout and "TOKENRELAY_ENGINE_PORT" in out.stdout


def test_bad_settings_exit_with_a_message() -> None:
    for argv, needle in [(["--backend", "nope"], "--backend (TOKENRELAY_ENGINE_BACKEND; file backend)"),
                         (["--backend", "hf"], "the hf backend needs --model")]:
        out = subprocess.run([sys.executable, "-m", "engine_svc", *argv], cwd=REPO, capture_output=True,
                             text=True, timeout=60)
        assert out.returncode == 2
        assert needle in out.stderr and "Traceback" not in out.stderr
