"""Services of one test as real processes on ephemeral ports (tokenizer, sim engines, routers
sharing one Redis), killed at the end."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import pathlib
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from services.channels import CHANNEL_OPTIONS, open_channel
from services.client import Finished, TextDelta
from services.errors import REASON_KEY, RETRY_AFTER_KEY, Cancelled
from services.grpc_util import wait_healthy
from services.proto.tokenrelay.v1 import inference_pb2_grpc
from tests.meshkit import metric_sum
from tests.redisproc import RedisProc
from tests.waiting import poll
from tokenrelay_tools.cli.byte_tokenizer import ensure_byte_tokenizer
from tokenrelay_tools.cli.launcher import CACHE, engine_args_for

KEYS = {"t1": "key-one-" + "a" * 16, "t2": "key-two-" + "b" * 16}
# Slow enough to catch requests before their first token and mid-stream; fast enough for 2 cores.
SIM = ["--sim-decode-step-time", "0.01", "--sim-prefill-time-per-token", "0.0005"]


def refusal_of(exc: Any) -> tuple[str, int]:
    """A failed call's machine-readable reason and retry-after (ms; -1 when none) from its trailers."""
    md = dict(exc.trailing_metadata() or ())
    return str(md.get(REASON_KEY)), int(md.get(RETRY_AFTER_KEY, -1))


class Procs:
    """Services of one test as real processes on ephemeral ports, killed at the end."""

    def __init__(self, tmp: pathlib.Path, redis_url: str, tenants: str = "") -> None:
        self.tmp = tmp
        self.redis_url = redis_url
        self.pool = uuid.uuid4().hex[:12]
        self.model = ensure_byte_tokenizer(CACHE)
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.addr: dict[str, str] = {}
        self.metrics: dict[str, str] = {}
        self.stubs: dict[str, Any] = {}     # Inference stubs by router name (`routers_on_redis`)
        path = tmp / "tenants.yaml"
        path.write_text(tenants or "tenants:\n" + "".join(
            f"  - name: {t}\n    api_key_sha256: {hashlib.sha256(k.encode()).hexdigest()}\n    max_in_flight: 64\n"
            for t, k in KEYS.items()))
        self.tenants = path

    def spawn(self, name: str, module: str, *args: str, port: int = 0) -> None:
        port_file, metrics_file = self.tmp / f"{name}.port", self.tmp / f"{name}.mport"
        port_file.unlink(missing_ok=True)   # a restarted process: `ready` waits for its new port
        metrics_file.unlink(missing_ok=True)
        argv = [sys.executable, "-m", module, "--port", str(port), "--port-file", str(port_file),
                "--metrics-port", "0", "--metrics-port-file", str(metrics_file), "--log-format", "console", *args]
        log = open(self.tmp / f"{name}.log", "ab")
        self.procs[name] = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT,
                                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
        log.close()

    async def ready(self, *names: str) -> None:
        async def one(name: str) -> None:
            port_file = self.tmp / f"{name}.port"
            await poll(lambda: port_file.exists() or self.procs[name].poll() is not None, timeout=60,
                       what=f"{name} to start")
            assert self.procs[name].poll() is None, self.log(name)
            self.addr[name] = f"127.0.0.1:{port_file.read_text().strip()}"
            self.metrics[name] = f"http://127.0.0.1:{(self.tmp / f'{name}.mport').read_text().strip()}/metrics"
            await wait_healthy(self.addr[name], timeout=60)
        await asyncio.gather(*(one(n) for n in names))

    def counted(self, name: str, **labels: str) -> dict[str, float]:
        """Per process with a metrics page, the sum of its samples `name` with `labels`."""
        return {proc: metric_sum(url, name, **labels) for proc, url in self.metrics.items()}

    async def asked_by_each_router(self, ask: Callable[[Any, str], Awaitable[Any]], n: int,
                                   local_reason: str) -> tuple[dict[str, list[Any]], float, dict[str, float],
                                                               dict[str, float]]:
        """`n` requests to each router, one at a time (`ask(stub, request_id)`): their answers per
        router, the seconds they took, and per router the ENQUEUE calls made meanwhile and the
        refusals it decided itself for `local_reason` (the memos' e2e tests)."""
        enqueues = self.counted("tokenrelay_router_redis_seconds_count", op="enqueue")
        t0 = time.monotonic()
        answers = {name: [await ask(stub, f"{name}{i}") for i in range(n)] for name, stub in self.stubs.items()}
        elapsed = time.monotonic() - t0
        after = self.counted("tokenrelay_router_redis_seconds_count", op="enqueue")
        calls = {name: after[name] - enqueues[name] for name in self.stubs}
        local = self.counted("tokenrelay_router_admission_local_refusals_total", reason=local_reason)
        return answers, elapsed, calls, local

    def log(self, name: str) -> str:
        return (self.tmp / f"{name}.log").read_text(errors="replace")[-3000:]

    async def upstreams(self, *engine_flags: str, engines: int = 2) -> None:
        self.spawn("tok", "tokenizer_svc", "--tokenizer", str(self.model))
        for i in range(engines):
            self.spawn(f"e{i}", "engine_svc", "--backend", "sim", "--model", str(self.model),
                       *engine_args_for(self.model, "sim"), *SIM, *engine_flags)
        await self.ready("tok", *(f"e{i}" for i in range(engines)))

    def router(self, name: str, *args: str, port: int = 0, engines: list[str] | None = None) -> None:
        """A router over every engine started here (`engines`: these addresses, in this order)."""
        listed = ",".join(engines if engines is not None else
                          [self.addr[n] for n in sorted(self.addr) if n.startswith("e")])
        self.spawn(name, "router_svc", "--tokenizers", self.addr["tok"], "--engines", listed,
                   "--redis-url", self.redis_url, "--pool", self.pool, "--tenants-file", str(self.tenants),
                   "--router-id", name, "--engine-poll-interval", "0.2", *args, port=port)

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()
            proc.wait(10)


async def first_delta(stream: AsyncIterator[Any]) -> None:
    """Read a client stream up to its first text delta."""
    async for event in stream:
        if isinstance(event, TextDelta):
            return


async def outcome(stream: AsyncIterator[Any], timeout: float = 10) -> str:
    """How a client stream ends: its finish reason, ``cancelled`` (a Cancelled status), or ``no done``."""
    async def rest() -> str:
        async for event in stream:
            if isinstance(event, Finished):
                return event.finish_reason
        return "no done"
    try:
        return await asyncio.wait_for(rest(), timeout)
    except Cancelled:
        return "cancelled"


@contextlib.asynccontextmanager
async def routers_on_redis(tmp: pathlib.Path, tenants: str, routers: dict[str, list[str]],
                           engines: int = 1) -> AsyncIterator[Procs]:
    """A redis-server, a tokenizer, `engines` sim engines and one router per `routers` entry (its
    flags), all real processes sharing one pool, with an Inference stub per router (`p.stubs`);
    killed at the end."""
    redis = RedisProc(tmp)
    redis.start()
    p = Procs(tmp, redis.url, tenants=tenants)
    channels = []
    try:
        await p.upstreams(engines=engines)
        for name, flags in routers.items():
            p.router(name, *flags)
        await p.ready(*routers)
        for name in routers:
            channels.append(open_channel(p.addr[name], options=CHANNEL_OPTIONS))
            p.stubs[name] = inference_pb2_grpc.InferenceStub(channels[-1])
        yield p
    finally:
        for ch in channels:
            await ch.close()
        p.stop()
        redis.kill()
