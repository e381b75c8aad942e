"""Processes of bench_routing.py: redis-server, one tokenizer_svc, N sim engines, tokenrelay routers,
the SGLang-worker adapter (routing_adapter.py) and sglang-router, each on an ephemeral port
published through a port file, killed at the end (and with this process, however it dies)."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import time
import urllib.request

REPO = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from services.grpc_util import wait_healthy  # noqa: E402
from services.redis_client import unix_socket_listening  # noqa: E402
from tokenrelay_tools.cli.byte_tokenizer import ensure_byte_tokenizer  # noqa: E402
from tokenrelay_tools.cli.launcher import CACHE, _die_with_parent, engine_args_for  # noqa: E402

VOCAB = 259          # the byte-level tokenizer's (the engine refuses an EOS id beyond its vocabulary)
API_KEY = "bench-routing-" + "k" * 16
SGLANG_VENV = CACHE / "sglang-router-0.3.2"


class Procs:
    def __init__(self, work: pathlib.Path) -> None:
        self.work = work
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.model = ensure_byte_tokenizer(CACHE)

    def spawn(self, name: str, argv: list[str]) -> subprocess.Popen[bytes]:
        log = open(self.work / f"{name}.log", "ab")
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, cwd=REPO, start_new_session=True,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"}, preexec_fn=_die_with_parent)
        log.close()
        self.procs[name] = proc
        return proc

    def service(self, name: str, module: str, *args: str, port: int = 0) -> pathlib.Path:
        port_file = self.work / f"{name}.port"
        port_file.unlink(missing_ok=True)
        self.spawn(name, [sys.executable, "-m", module, "--host", "127.0.0.1", "--port", str(port),
                          "--port-file", str(port_file), "--log-level", "WARNING", "--log-format", "console",
                          "--metrics-port", "0", "--metrics-port-file", str(self.work / f"{name}.mport"), *args])
        return port_file

    async def port(self, name: str, port_file: pathlib.Path, timeout: float = 90) -> str:
        deadline = time.monotonic() + timeout
        while not port_file.exists() or not port_file.read_text().strip():
            if self.procs[name].poll() is not None:
                raise RuntimeError(f"{name} exited {self.procs[name].returncode}:\n{self.log(name)}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"{name} did not start in {timeout}s:\n{self.log(name)}")
            await asyncio.sleep(0.05)
        return port_file.read_text().strip()

    async def grpc_service(self, name: str, module: str, *args: str, port: int = 0) -> str:
        address = f"127.0.0.1:{await self.port(name, self.service(name, module, *args, port=port))}"
        await wait_healthy(address, timeout=60)
        return address

    def metrics_url(self, name: str) -> str:
        return f"http://127.0.0.1:{(self.work / f'{name}.mport').read_text().strip()}/metrics"

    def log(self, name: str) -> str:
        try:
            return (self.work / f"{name}.log").read_text(errors="replace")[-3000:]
        except OSError:
            return "(no log)"

    def stop(self, *names: str) -> None:
        names = names or tuple(reversed(self.procs))
        for name in names:
            proc = self.procs.get(name)
            if proc is not None and proc.poll() is None:
                with contextlib.suppress(OSError):
                    proc.send_signal(signal.SIGTERM)
        for name in names:
            proc = self.procs.pop(name, None)
            if proc is None:
                continue
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(OSError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()

    # ------------------------------------------------------------------ roles
    async def redis(self) -> str:
        server = shutil.which("redis-server")
        if server is None:
            raise SystemExit("redis-server not found (apt-get install -y redis-server)")
        sock = self.work / "redis.sock"
        sock.unlink(missing_ok=True)
        self.spawn("redis", [server, "--port", "0", "--unixsocket", str(sock), "--unixsocketperm", "700",
                             "--save", "", "--appendonly", "no"])
        deadline = time.monotonic() + 10
        while not unix_socket_listening(sock):
            if time.monotonic() > deadline or self.procs["redis"].poll() is not None:
                raise RuntimeError(f"redis did not start:\n{self.log('redis')}")
            await asyncio.sleep(0.02)
        return f"unix://{sock}"

    async def tokenizer(self) -> str:
        return await self.grpc_service("tok", "tokenizer_svc", "--tokenizer", str(self.model))

    async def engines(self, group: str, n: int, flags: list[str]) -> list[str]:
        names = [f"{group}-e{i}" for i in range(n)]
        files = [self.service(nm, "engine_svc", "--backend", "sim", "--model", str(self.model),
                              *engine_args_for(self.model, "sim"), "--sim-vocab-size", str(VOCAB), *flags)
                 for nm in names]
        ports = await asyncio.gather(*(self.port(nm, f) for nm, f in zip(names, files, strict=True)))
        addrs = [f"127.0.0.1:{p}" for p in ports]
        await asyncio.gather(*(wait_healthy(a, timeout=60) for a in addrs))
        return addrs

    def tenants(self) -> pathlib.Path:
        path = self.work / "tenants.yaml"
        path.write_text("tenants:\n  - name: bench\n"
                        f"    api_key_sha256: {hashlib.sha256(API_KEY.encode()).hexdigest()}\n"
                        "    max_in_flight: 1024\n    max_queued: 1024\n")
        return path

    async def routers(self, name: str, n: int, tok: str, engines: list[str], redis_url: str, pool: str,
                      flags: list[str], trace: bool = True) -> list[str]:
        """`n` router processes on their own ports (clients split between them), one admission pool;
        with `trace`, each writes its spans to `<name>-r<i>.spans`."""
        tenants = self.tenants()
        out = []
        for i in range(n):
            rname = f"{name}-r{i}"
            (self.work / f"{rname}.spans").unlink(missing_ok=True)
            out.append(self.grpc_service(
                rname, "router_svc", "--tokenizers", tok, "--engines", ",".join(engines), "--redis-url", redis_url,
                "--pool", pool, "--tenants-file", str(tenants), "--router-id", rname,
                *(["--trace-file", str(self.work / f"{rname}.spans")] if trace else []), *flags))
        return list(await asyncio.gather(*out))

    async def adapter(self, name: str, engines: list[str]) -> list[str]:
        port_file = self.work / f"{name}.ports"
        port_file.unlink(missing_ok=True)
        self.spawn(name, [sys.executable, str(REPO / "bench" / "routing_adapter.py"), "--engines", ",".join(engines),
                          "--port-file", str(port_file), "--model", str(self.model)])
        ports = (await self.port(name, port_file)).split()
        return [f"http://127.0.0.1:{p}" for p in ports]

    async def sglang(self, name: str, workers: list[str], policy: str, extra: list[str]) -> str:
        python = SGLANG_VENV / "bin" / "python"
        if not python.exists():
            raise RuntimeError(f"sglang-router is not installed in {SGLANG_VENV} (see bench_routing.py --help)")
        port, metrics = _free_port(), _free_port()   # sglang-router takes port numbers, not 0
        self.spawn(name, [str(python), "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port", str(port),
                          "--worker-urls", *workers, "--policy", policy, "--log-level", "warn",
                          "--prometheus-host", "127.0.0.1", "--prometheus-port", str(metrics),
                          "--disable-retries", *extra])
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while True:
            if self.procs[name].poll() is not None:
                raise RuntimeError(f"{name} exited:\n{self.log(name)}")
            with contextlib.suppress(OSError):
                body = await asyncio.to_thread(lambda: urllib.request.urlopen(url + "/workers", timeout=2).read())
                if body.count(b'"is_healthy":true') >= len(workers):
                    return url
            if time.monotonic() > deadline:
                raise RuntimeError(f"{name}: workers not healthy in 60 s:\n{self.log(name)}")
            await asyncio.sleep(0.2)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
