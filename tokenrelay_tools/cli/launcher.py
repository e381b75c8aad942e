"""`tokenrelay up`: run the whole mesh on one machine as real processes.

Starts Redis (a private `redis-server` on a unix socket unless a URL is given), the tokenizers,
the engines and the routers, each on an ephemeral port published through a port file, waits for
every one to report SERVING on the standard health service, then writes a state file (router
address + development API key, mode 0600) that `tokenrelay generate` / `chat` read.

Several routers (`--routers N`) serve one address: the first binds `--port` (0 = ephemeral) with
SO_REUSEPORT, the others bind the port it got, also with SO_REUSEPORT, and the kernel spreads
client connections over them; every router is pointed at every engine and tokenizer and shares
the one Redis (request ids, Cancel and sessions work whichever router holds a stream).
Stopping sends SIGTERM in reverse start order, then SIGKILL after a grace period.

Supervision (`supervise`, once everything is up): a service that exits is started again with the
same command line, on the same port (routers and engines know each other by host:port; the routers'
shared port is bound with SO_REUSEPORT) or the same Redis socket, after a backoff; one that keeps
crashing is left down and reported, while the rest keep serving. The policy (when, and whether)
is pure logic in `supervisor.py`; this module acts on it. Each restart is one line of the
launcher's log and is counted in the state file (`tokenrelay status` shows the counts). The Redis
it starts keeps an append-only file in the run directory (appendfsync everysec, noeviction), so a
restarted Redis has the leases and queue entries of admitted requests, all but at most the last
second's writes; a new `up` starts from an empty one.

Before starting anything it takes its run directory (`preflight`: a second mesh there is refused,
so nothing another mesh owns, its Redis socket above all, is ever unlinked) and checks the router
port; a router that still fails to bind is reported in one line, as a port in use.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import pathlib
import secrets
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from services.grpc_util import wait_healthy
from services.redis_client import unix_socket_listening
from tokenrelay_tools import env

from .device import Device, choose_device, default_prompt_cap
from .preflight import Refused, bind_failure, check_port_free, claim_run_dir, port_in_use, release_run_dir
from .supervisor import RestartPolicy, ServiceRecord, describe_exit

CACHE = env.cache_root()
DEFAULT_STATE = CACHE / "local.json"
LOCAL_TOKENIZE_BYTES = 16384    # prompts up to this size are tokenized in the routers `up` starts


@dataclass
class MeshOptions:
    model: pathlib.Path
    engine: str = "hf"
    port: int = 50051
    host: str = "127.0.0.1"
    redis_url: str = ""
    run_dir: pathlib.Path = CACHE / "run"
    state_file: pathlib.Path = DEFAULT_STATE
    max_in_flight: int = 16
    max_prompt_tokens: int | None = None   # the dev tenant's; None = default_prompt_cap (device.py)
    device: str = "auto"                   # hf engines: auto | cpu | cuda | cuda:N
    tokenizer_replicas: int = 1
    engine_replicas: int = 1
    routers: int = 1
    startup_timeout: float = 300.0
    log_level: str = "INFO"
    engine_args: list[str] = field(default_factory=list)
    tokenizer_args: list[str] = field(default_factory=list)
    router_args: list[str] = field(default_factory=list)
    tenants_file: pathlib.Path | None = None   # served instead of the generated dev tenant
    restart: RestartPolicy = field(default_factory=RestartPolicy)


# What `tokenrelay status` shows for each state of a supervised process.
UP, STARTING, BACKOFF, DOWN = "up", "restarting", "waiting to restart", "down"


@dataclass
class _Proc:
    name: str
    popen: subprocess.Popen[bytes]
    log_path: pathlib.Path
    argv: list[str] = field(default_factory=list)
    port_file: pathlib.Path | None = None     # None: redis (its socket is fixed)
    address: str = ""
    record: ServiceRecord = field(default_factory=lambda: ServiceRecord(RestartPolicy()))
    state: str = UP
    due: float = 0.0                          # BACKOFF: when to start it again
    checking: asyncio.Task[None] | None = None   # STARTING: its health check

    @property
    def role(self) -> str:
        return self.name.rstrip("0123456789")


class Mesh:
    def __init__(self, options: MeshOptions) -> None:
        self.o = options
        self.procs: list[_Proc] = []
        self.api_key = "trk-dev-" + secrets.token_urlsafe(24)
        self.router_address = ""
        self.addresses: dict[str, str] = {}
        self.tokenizer_addresses: list[str] = []
        self.engine_addresses: list[str] = []
        self.router_addresses: list[str] = []
        self.metrics: dict[str, str] = {}
        self.redis_url = options.redis_url
        self.device: Device = Device("cpu", 0, "not chosen yet")

    # ------------------------------------------------------------------ processes
    def _spawn(self, name: str, argv: list[str]) -> _Proc:
        logs = self.o.run_dir / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        log_path = logs / f"{name}.log"
        proc = _Proc(name, _popen(argv, log_path), log_path, argv,
                     record=ServiceRecord(self.o.restart, started_at=time.monotonic()))
        self.procs.append(proc)
        return proc

    def _service(self, name: str, module: str, extra: list[str], port: int = 0) -> tuple[_Proc, pathlib.Path]:
        port_file = self.o.run_dir / f"{name}.port"
        metrics_file = self.o.run_dir / f"{name}.metrics-port"
        for f in (port_file, metrics_file):
            f.unlink(missing_ok=True)
        argv = [sys.executable, "-m", module, "--host", self.o.host, "--port", str(port),
                "--port-file", str(port_file), "--log-format", "console", "--log-level", self.o.log_level,
                "--metrics-port", "0", "--metrics-port-file", str(metrics_file), *extra]
        proc = self._spawn(name, argv)
        proc.port_file = port_file
        return proc, port_file

    async def _wait_port(self, proc: _Proc, port_file: pathlib.Path) -> str:
        deadline = time.monotonic() + self.o.startup_timeout
        while not port_file.exists():
            if proc.popen.poll() is not None:
                last = tail(proc.log_path)
                address = bind_failure(last) if proc.name.startswith("router") else None
                if address is not None:  # taken since the preflight check: one line, not a traceback
                    host, _, port = address.rpartition(":")
                    raise port_in_use(host.strip("[]"), int(port))
                raise RuntimeError(f"{proc.name} exited with {proc.popen.returncode}; last log lines:\n{last}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{proc.name} did not start in {self.o.startup_timeout}s")
            await asyncio.sleep(0.05)
        port = port_file.read_text().strip()
        address = f"{self.o.host}:{port}"
        await wait_healthy(address, timeout=30)
        # A restart binds this port again: routers hold engines and tokenizers by host:port.
        proc.address, proc.argv = address, _with_port(proc.argv, port)
        return address

    async def _start_redis(self) -> None:
        if self.redis_url:
            return
        server = shutil.which("redis-server")
        if server is None:
            raise RuntimeError("redis-server not found: install it (apt-get install -y redis-server) "
                               "or pass --redis-url")
        sock = self.o.run_dir / "redis.sock"
        sock.unlink(missing_ok=True)
        # A new mesh starts from an empty Redis: a previous run's leases would hold capacity.
        shutil.rmtree(self.o.run_dir / REDIS_AOF_DIR, ignore_errors=True)
        proc = self._spawn("redis", [server, "--port", "0", "--unixsocket", str(sock),
                                     "--unixsocketperm", "700", "--save", "", "--dir", str(self.o.run_dir),
                                     "--appendonly", "yes", "--appendfsync", "everysec",
                                     "--appenddirname", REDIS_AOF_DIR, "--maxmemory-policy", "noeviction"])
        deadline = time.monotonic() + 10
        while not unix_socket_listening(sock):
            if proc.popen.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"redis-server did not start:\n{tail(proc.log_path)}")
            await asyncio.sleep(0.02)
        self.redis_url = f"unix://{sock}"
        proc.address = self.redis_url

    def _write_tenants(self) -> pathlib.Path:
        import hashlib

        path = self.o.run_dir / "tenants.yaml"
        digest = hashlib.sha256(self.api_key.encode()).hexdigest()
        path.write_text(
            "# Generated by `tokenrelay up`: one development tenant.\n"
            "tenants:\n"
            f"  - name: dev\n    api_key_sha256: {digest}\n    max_in_flight: {self.o.max_in_flight}\n"
            f"    max_prompt_tokens: {self.prompt_cap}\n")
        return path

    @property
    def prompt_cap(self) -> int:
        """The dev tenant's max_prompt_tokens (0 = the model's context)."""
        if self.o.max_prompt_tokens is not None:
            return self.o.max_prompt_tokens
        return default_prompt_cap(self.o.engine, self.device)

    def choose_device(self) -> Device:
        """Where the hf engines run (`device.py`); `start()` calls it, `up` earlier to say so."""
        if self.device.why == "not chosen yet":
            self.device = choose_device(self.o.device, self.o.engine, self.o.engine_args)
        return self.device

    def preflight(self) -> None:
        """Refuse (`Refused`) before anything starts: another mesh in the run dir, a port in use.
        `start()` runs it too; `tokenrelay up` runs it first, before building the default model."""
        claim_run_dir(self.o.run_dir)
        try:
            check_port_free(self.o.host, self.o.port)
        except Refused:
            release_run_dir(self.o.run_dir)
            raise

    async def start(self) -> str:
        self.preflight()
        self.choose_device()
        await self._start_redis()
        replicas = max(1, self.o.tokenizer_replicas)
        toks = [self._service(_name("tokenizer", i), "tokenizer_svc",
                              tokenizer_argv(self.o.model, replicas, self.o.tokenizer_args))
                for i in range(replicas)]
        n_engines = max(1, self.o.engine_replicas)
        engs = [self._service(_name("engine", i), "engine_svc",
                              engine_argv(self.o.model, self.o.engine, n_engines, self.o.engine_args,
                                          device=self._engine_device(i)))
                for i in range(n_engines)]
        addrs = await asyncio.gather(*(self._wait_port(*t) for t in (*toks, *engs)))
        tok_addrs, eng_addrs = list(addrs[:replicas]), list(addrs[replicas:])
        self.router_addresses = await self._start_routers(tok_addrs, eng_addrs)
        self.router_address = self.router_addresses[0]
        self.tokenizer_addresses, self.engine_addresses = tok_addrs, eng_addrs
        self.addresses = {"tokenizer": tok_addrs[0], "engine": eng_addrs[0], "router": self.router_address}
        names = [*(_name("tokenizer", i) for i in range(replicas)), *(_name("engine", i) for i in range(n_engines)),
                 *(_name("router", i) for i in range(len(self.router_addresses)))]
        self.metrics = {name: f"http://{self.o.host}:{(self.o.run_dir / f'{name}.metrics-port').read_text().strip()}"
                        "/metrics" for name in names}
        self._write_state()
        return self.router_address

    def router_flags(self) -> list[str]:
        """An hf engine on the CPU sends nothing while it prefills a prompt (~170 tokens/s measured
        for Gemma 3 270M on the 2-core machine: 1.9k tokens took 11 s), longer than the router's 10 s
        progress timeout, which failed such prompts with ENGINE_STALLED: allow a capped prompt 60 s,
        an uncapped one the whole request timeout. The router's own variable, when set, wins."""
        if (self.o.engine != "hf" or self.device.name != "cpu"
                or "TOKENRELAY_ROUTER_ENGINE_PROGRESS_TIMEOUT" in os.environ):
            return []
        return ["--engine-progress-timeout", "60" if self.prompt_cap else "600"]

    def local_tokenizer_flags(self) -> list[str]:
        """The routers of this one-host mesh detokenize, and tokenize prompts of up to 16 KB, in their
        own process, from the files the tokenizer replicas serve (checked against them at start);
        longer prompts go to the tokenizer service. Measured on the documented chat-multiturn load,
        both on quiet cores and here: the time the mesh adds to the first token fell 1.1-2.4 ms at
        p50, and one-token deltas cost the router less CPU (docs/benchmarks.md). The routers' own
        variables, or a config file of theirs, win: then nothing is added; nor when the tokenizers
        are given a config file or a chat template of their own (the routers would not know it)."""
        def given(args: list[str], *flags: str) -> bool:
            return any(a == f or a.startswith(f + "=") for a in args for f in flags)
        if (given(self.o.router_args, "--config") or given(self.o.tokenizer_args, "--config", "--chat-template")
                or {"TOKENRELAY_ROUTER_DETOKENIZE", "TOKENRELAY_ROUTER_TOKENIZE_LOCAL_BYTES",
                    "TOKENRELAY_TOKENIZER_CHAT_TEMPLATE"} & set(os.environ)):
            return []
        return ["--detokenize", "local", "--tokenize-local-bytes", str(LOCAL_TOKENIZE_BYTES)]

    def _engine_device(self, index: int) -> str:
        """The --hf-device this replica gets ("" = none: not hf, or the user passed one)."""
        if self.o.engine != "hf" or self.device.why.startswith("--engine-arg"):
            return ""
        return self.device.for_replica(index)

    async def _start_routers(self, tok_addrs: list[str], eng_addrs: list[str]) -> list[str]:
        """The first router binds --port (0 = ephemeral); the others bind the port it got. With more
        than one, every router binds with SO_REUSEPORT, so they serve one address."""
        n = max(1, self.o.routers)
        tenants = self.o.tenants_file.resolve() if self.o.tenants_file else self._write_tenants()
        # --tokenizer-files: what the tokenizers serve, for local (de)tokenization in the routers.
        argv = ["--tokenizers", ",".join(tok_addrs), "--engines", ",".join(eng_addrs),
                "--tokenizer-files", str(self.o.model),
                "--redis-url", self.redis_url, "--tenants-file", str(tenants),
                *self.router_flags(), *self.local_tokenizer_flags(), *self.o.router_args]
        if n > 1:
            argv.append("--reuse-port")
        first = await self._wait_port(*self._service("router", "router_svc", argv, port=self.o.port))
        port = int(first.rsplit(":", 1)[1])
        rest = [self._service(_name("router", i), "router_svc", argv, port=port) for i in range(1, n)]
        return [first, *await asyncio.gather(*(self._wait_port(*r) for r in rest))]

    def _write_state(self) -> None:
        self.o.state_file.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.o.state_file.with_suffix(".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            # With a tenants file of the user's, no key of it is known here: clients pass their own.
            api_key = "" if self.o.tenants_file else self.api_key
            json.dump({"router": self.router_address, "api_key": api_key, "pid": os.getpid(),
                       "model": str(self.o.model), "engine": self.o.engine, "redis_url": self.redis_url,
                       "tokenizers": self.tokenizer_addresses, "engines": self.engine_addresses,
                       "routers": len(self.router_addresses), "device": self.device.name,
                       "max_prompt_tokens": self.prompt_cap,
                       "run_dir": str(self.o.run_dir), "metrics": self.metrics,
                       "services": self.services()}, f)
        os.replace(tmp, self.o.state_file)

    def services(self) -> dict[str, dict[str, object]]:
        """Every supervised process: state, restarts, pid, address (the state file's `services`)."""
        return {p.name: {"state": p.state, "restarts": p.record.restarts,
                         "pid": p.popen.pid if p.popen.poll() is None else None, "address": p.address}
                for p in self.procs}

    # ------------------------------------------------------------------ supervision
    async def supervise(self, say: Callable[[str], None], tick: float = 0.1) -> str:
        """Restart what exits, as `self.o.restart` says, until a whole role is down (every router,
        engine or tokenizer, or the Redis it started: nothing can be served); returns why."""
        try:
            while True:
                now = time.monotonic()
                for proc in self.procs:
                    if proc.state in (UP, STARTING) and proc.popen.poll() is not None:
                        self._exited(proc, now, say)
                    elif proc.state == BACKOFF and now >= proc.due:
                        self._restart(proc, now)
                    elif proc.state == STARTING and proc.checking is None and self._published(proc):
                        proc.checking = asyncio.create_task(self._confirm(proc, say))
                for role in {p.role for p in self.procs}:
                    if all(p.state == DOWN for p in self.procs if p.role == role):
                        return f"every {role} is down: nothing can be served"
                await asyncio.sleep(tick)
        finally:
            for proc in self.procs:
                if proc.checking is not None:
                    proc.checking.cancel()

    def _exited(self, proc: _Proc, now: float, say: Callable[[str], None]) -> None:
        code = proc.popen.returncode
        ran = now - proc.record.started_at
        decision = proc.record.exited(now)
        if proc.checking is not None:
            proc.checking.cancel()
            proc.checking = None
        if decision.restart:
            proc.state, proc.due = BACKOFF, now + decision.delay
            say(f"{proc.name} exited ({describe_exit(code)}) after {ran:.1f} s: restart {decision.number} "
                f"in {decision.delay:g} s")
        else:
            proc.state = DOWN
            p = self.o.restart
            times = "time" if decision.recent == 1 else "times"
            why = (f"restarted {decision.recent} {times} in the last {p.window:g} s" if p.max_restarts
                   else "restarts are off (--max-restarts 0)")
            say(f"{proc.name} keeps crashing ({describe_exit(code)}; {why}): left down, the rest keep serving; "
                f"last lines of {proc.log_path}:\n" + _indent(tail(proc.log_path, 6)))
        self._write_state()

    def _restart(self, proc: _Proc, now: float) -> None:
        if proc.port_file is not None:
            proc.port_file.unlink(missing_ok=True)
            (self.o.run_dir / f"{proc.name}.metrics-port").unlink(missing_ok=True)
        else:  # redis: its socket file is left behind by a kill
            (self.o.run_dir / "redis.sock").unlink(missing_ok=True)
        with open(proc.log_path, "ab") as log:
            log.write(f"--- tokenrelay up: restart {proc.record.restarts} ---\n".encode())
        proc.popen = _popen(proc.argv, proc.log_path)
        proc.record.started(now)
        proc.state = STARTING
        self._write_state()

    def _published(self, proc: _Proc) -> bool:
        if proc.port_file is None:
            return (self.o.run_dir / "redis.sock").exists()
        return proc.port_file.exists() and (self.o.run_dir / f"{proc.name}.metrics-port").exists()

    async def _confirm(self, proc: _Proc, say: Callable[[str], None]) -> None:
        """A restarted service is UP once it answers SERVING (Redis: PONG, i.e. its AOF is loaded)."""
        try:
            if proc.port_file is not None:
                await wait_healthy(proc.address, timeout=30)
                metrics_port = (self.o.run_dir / f"{proc.name}.metrics-port").read_text().strip()
                self.metrics[proc.name] = f"http://{self.o.host}:{metrics_port}/metrics"
            else:
                await _redis_ready(self.o.run_dir / "redis.sock", timeout=30)
        except (TimeoutError, OSError):
            return  # not healthy: it is killed at stop, or exits and is seen as a crash
        finally:
            proc.checking = None
        if proc.state == STARTING and proc.popen.poll() is None:
            proc.state = UP
            took = time.monotonic() - proc.record.started_at
            say(f"{proc.name} is back on {proc.address} (restart {proc.record.restarts}, pid {proc.popen.pid}, "
                f"{took:.1f} s to serve)")
            self._write_state()

    def restart_counts(self) -> dict[str, int]:
        return {p.name: p.record.restarts for p in self.procs if p.record.restarts}

    def stop(self, grace: float = 15.0) -> None:
        with contextlib.suppress(OSError, ValueError):
            if self.o.state_file.exists() and json.loads(self.o.state_file.read_text()).get("pid") == os.getpid():
                self.o.state_file.unlink()
        for proc in reversed(self.procs):
            if proc.popen.poll() is None:
                with contextlib.suppress(OSError, ValueError):
                    proc.popen.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + grace
            while proc.popen.poll() is None and time.monotonic() < deadline:
                time.sleep(0.05)
            if proc.popen.poll() is None:
                with contextlib.suppress(OSError, ValueError):
                    os.killpg(proc.popen.pid, signal.SIGKILL)
                proc.popen.wait()
        self.procs.clear()
        release_run_dir(self.o.run_dir)  # last: every process of this mesh is gone


REDIS_AOF_DIR = "redis-aof"   # under the run dir: the append-only file of the Redis `up` starts


async def _redis_ready(sock: pathlib.Path, timeout: float) -> None:
    """Until the Redis on `sock` answers PING with PONG (while it loads its AOF it answers -LOADING)."""
    deadline = time.monotonic() + timeout
    while True:
        with contextlib.suppress(OSError):
            reader, writer = await asyncio.open_unix_connection(str(sock))
            try:
                writer.write(b"PING\r\n")
                if (await asyncio.wait_for(reader.readline(), 1.0)).startswith(b"+PONG"):
                    return
            except asyncio.TimeoutError:
                pass
            finally:
                writer.close()
        if time.monotonic() > deadline:
            raise TimeoutError(f"redis on {sock} not ready after {timeout}s")
        await asyncio.sleep(0.05)


def _popen(argv: list[str], log_path: pathlib.Path) -> subprocess.Popen[bytes]:
    with open(log_path, "ab") as log_file:
        return subprocess.Popen(argv, stdout=log_file, stderr=subprocess.STDOUT,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"},
                                start_new_session=True, preexec_fn=_die_with_parent)


def _with_port(argv: list[str], port: str) -> list[str]:
    """`argv` with the value of its (first) --port replaced."""
    i = argv.index("--port")
    return [*argv[:i + 1], port, *argv[i + 2:]]


def _indent(text: str) -> str:
    """Log lines under a report, each cut to 300 characters (a service's settings line is ~3k)."""
    return "\n".join(f"    {line[:300]}" + ("..." if len(line) > 300 else "") for line in text.splitlines())


def _name(role: str, index: int) -> str:
    """Process names: router, router1, router2, ... (the first keeps the plain name)."""
    return f"{role}{index}" if index else role


def _die_with_parent() -> None:
    """In the child, before exec: SIGTERM it when the launcher dies, however it dies (even kill -9),
    so a killed `tokenrelay up` never leaves orphan servers holding ports and memory (Linux only)."""
    if sys.platform.startswith("linux"):
        import ctypes

        pr_set_pdeathsig = 1
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)


def engine_args_for(model: pathlib.Path, engine: str) -> list[str]:
    """Engine flags that follow from the model: the checkpoint's dtype for `hf` (bf16 checkpoints run
    faster in bf16 on CPUs with bf16 support); for `sim`, ids the tokenizer can decode, within the context."""
    if engine == "hf":
        return ["--hf-dtype", "auto"]
    if engine != "sim":
        return []
    from tokenizers import Tokenizer

    from .byte_tokenizer import REPLY_IDS, is_built

    tokenizer = model / "tokenizer.json" if model.is_dir() else model
    args = ["--sim-vocab-size", str(Tokenizer.from_file(str(tokenizer)).get_vocab_size())]
    if model.is_dir() and is_built(model):
        # `up --engine sim`'s own tokenizer: replies of printable ASCII, whose text re-tokenizes to the
        # same ids, as a real model's replies mostly do (byte_tokenizer.REPLY_IDS).
        args += ["--sim-sample-ids-from", str(REPLY_IDS[0]), "--sim-sample-ids-below", str(REPLY_IDS[1])]
    # The model's context, else the tokenizer's (a tokenizer-only directory, as `up --engine sim` makes).
    for name, key in (("config.json", "max_position_embeddings"), ("tokenizer_config.json", "model_max_length")):
        path = model / name
        context = json.loads(path.read_text()).get(key) if path.exists() else None
        if isinstance(context, int) and 0 < context < 10_000_000:  # transformers writes 1e30 for "unknown"
            return [*args, "--sim-max-context", str(context)]
    return args


def engine_argv(model: pathlib.Path, engine: str, replicas: int, extra: list[str],
                cores: int | None = None, device: str = "") -> list[str]:
    """Flags of each engine replica: its torch `device` (hf; "" = the engine's default, cpu). Several
    `hf` engines on this host's CPUs share its cores, so each gets its share of torch threads (as
    tokenizer replicas do); a frame port each; `extra` comes last and wins."""
    # The routers' stream on a frame port of its own (engine_svc --frame-port; these meshes are plaintext):
    # one message each way costs less than over gRPC (services/frames.py, docs/architecture.md).
    argv = ["--backend", engine, "--model", str(model), *engine_args_for(model, engine), "--frame-port", "0"]
    if engine == "hf" and device:
        argv += ["--hf-device", device]
    if engine == "hf" and replicas > 1 and not device.startswith("cuda"):
        cores = cores if cores is not None else len(os.sched_getaffinity(0))
        argv += ["--hf-threads", str(max(1, cores // replicas))]
    return [*argv, *extra]


def tail(path: pathlib.Path, lines: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def read_state(path: pathlib.Path = DEFAULT_STATE) -> dict[str, str]:
    try:
        return json.loads(path.read_text())  # type: ignore[no-any-return]
    except FileNotFoundError:
        raise SystemExit(f"no running mesh found ({path} is missing): start one with `tokenrelay up`, "
                         "or pass --address and --api-key") from None


def tokenizer_argv(model: pathlib.Path, replicas: int, extra: list[str],
                   cores: int | None = None) -> list[str]:
    """Flags of each tokenizer replica: several replicas on this host share its cores, so each
    library pool gets its share (N pools of every core each oversubscribe the cores: on 2 cores,
    2 replicas went from 0.65 to 0.82 of raw encode_batch). `extra` comes last and wins."""
    argv = ["--tokenizer", str(model)]
    if replicas > 1:
        cores = cores if cores is not None else len(os.sched_getaffinity(0))
        argv += ["--library-threads", str(max(1, cores // replicas))]
    return [*argv, *extra]
