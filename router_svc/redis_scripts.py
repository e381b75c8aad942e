"""The admission scripts' own Redis connection: EVALSHA written to the socket when called, replies read
by a protocol callback (`--redis-client lean`, the default for one Redis over TCP, a Unix socket or TLS; the cluster
pipeline of router_svc/cluster_redis.py writes its commands here too, `command()`).

Why not redis-py for these calls: its asyncio client runs each command as a task that first takes a
pooled connection and checks it (awaits that each cost a loop turn) before it writes, and costs ~100
µs of CPU per command on this 2-core machine (a raw asyncio socket with hiredis: ~36 µs). A request's
ENQUEUE, sent early so that Redis answers while the router tokenizes the prompt
(`--admit-while-tokenizing`, router_svc/local_tokenize.py), reached Redis 0.93 ms (p50) after a 0.54 ms
encode had started, i.e. after it had ended (`tokenrelay up`, chat-multiturn, spans against Redis's
MONITOR; docs/benchmarks.md): the two did not overlap at all. Here the command is on the wire before
`call` returns.

What it keeps of redis-py's behaviour: the same replies (RESP2, bytes and ints) and exceptions
(`OutOfMemoryError`, `NoScriptError`-free: an unknown script is sent once with its body, as after a
SCRIPT FLUSH or a Redis restart; `ResponseError`; `ConnectionError`); AUTH and SELECT from the URL
and the password setting; a command whose connection died (a Redis restart: the socket's end is
seen at once) is sent once more on a new connection, which is safe for these scripts (ENQUEUE is
idempotent by its nonce, SETTLE answers "settled already", CANCEL and BEAT are idempotent); and a
connection that answers nothing for `stall_timeout` s is dropped, like redis-py's socket timeout, so a
silently dead peer does not hold every later call.
TLS (`rediss://`) is redis-py's own: its `RedisSSLContext` with the same files and defaults (the
certificate and its host name verified). What it does not do: Redis Cluster (the router then uses
redis-py, `lean_eligible`).
One connection carries every call of a client, pipelined: Redis runs commands one at a time anyway. A
router process has two clients, the admission's and the cluster pipeline's (`open_lean`).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import ssl
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import hiredis
from redis.asyncio.connection import RedisSSLContext, parse_url
from redis.exceptions import (
    AuthenticationError,
    BusyLoadingError,
    OutOfMemoryError,
    ResponseError,
)
from redis.exceptions import ConnectionError as RedisConnectionError

__all__ = ["ScriptClient", "lean_eligible", "open_lean", "pack"]


_TLS_OPTIONS = ("ssl_ca_certs", "ssl_certfile", "ssl_keyfile")


def lean_eligible(url: str, options: Mapping[str, Any]) -> bool:
    """One Redis (TCP, Unix socket, or TLS with the options the settings give): what `ScriptClient` serves."""
    scheme = url.split("://", 1)[0]
    if scheme == "rediss":
        return all(k in _TLS_OPTIONS or k == "password" for k in options)
    return scheme in ("redis", "unix") and not any(k.startswith("ssl") for k in options)


def open_lean(url: str, options: Mapping[str, Any], *, connect_timeout: float,
              stall_timeout: float) -> ScriptClient | None:
    """A `ScriptClient` for this URL and the settings' Redis options (TLS files, password), or None
    where it does not serve (a cluster, TLS options it does not take): the caller keeps redis-py."""
    if not lean_eligible(url, options):
        return None
    return ScriptClient(url, password=options.get("password", ""), connect_timeout=connect_timeout,
                        stall_timeout=stall_timeout, tls=options)


def _tls_context(options: Mapping[str, Any]) -> ssl.SSLContext:
    """redis-py's context for these files (`SSLConnection`'s defaults: the peer's certificate required,
    its host name checked)."""
    return RedisSSLContext(keyfile=options.get("ssl_keyfile"), certfile=options.get("ssl_certfile"),
                           cert_reqs="required", ca_certs=options.get("ssl_ca_certs"), check_hostname=True).get()


def pack(*parts: Any) -> bytes:
    """One command in RESP (an array of bulk strings): hiredis's packer (str, bytes, int and float as
    redis-py sends them; anything else, a bool included, raises TypeError). A third of the cost of
    packing it in Python (2.2 against 7.3 us for an ENQUEUE call's 19 arguments)."""
    return hiredis.pack_command(parts)  # type: ignore[no-any-return]


class _ErrorReply(Exception):
    """An error reply, as hiredis hands it over (mapped to redis-py's exceptions by `_error`)."""


def _error(message: str) -> Exception:
    head = message.split(" ", 1)[0]
    if head == "OOM":
        return OutOfMemoryError(message)
    if head == "LOADING":
        return BusyLoadingError(message)
    if head in ("NOAUTH", "WRONGPASS"):
        return AuthenticationError(message)
    return ResponseError(message)


@dataclass(eq=False)
class _Call:
    sha: str                    # "" for a plain command (`raw`)
    body: str
    keys: tuple[Any, ...]
    args: tuple[Any, ...]
    future: asyncio.Future[Any]
    raw: bytes = b""
    library: bool = False       # `sha` names a function of the library `body` (FCALL)
    script: str = ""            # the same operation as a script: run when the library cannot be loaded
    by_body: bool = False       # sent as EVAL (the script was unknown to Redis), or sent again after
                                # its library was loaded
    resent: bool = False        # sent again after its connection died
    sent_at: float = field(default=0.0)

    def command(self) -> bytes:
        if not self.sha:
            return self.raw
        if self.library:
            return pack("FCALL", self.sha, len(self.keys), *self.keys, *self.args)
        head = ("EVAL", self.body) if self.by_body else ("EVALSHA", self.sha)
        return pack(*head, len(self.keys), *self.keys, *self.args)


class _Connection(asyncio.Protocol):
    def __init__(self, client: ScriptClient) -> None:
        self.client = client
        self.reader = hiredis.Reader(replyError=_ErrorReply)
        self.transport: asyncio.Transport | None = None
        self.waiting: deque[_Call | asyncio.Future[Any]] = deque()    # FIFO: Redis answers in order
        self.closed = False
        self._watchdog: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def write(self, entry: _Call | asyncio.Future[Any], command: bytes) -> None:
        assert self.transport is not None
        loop = asyncio.get_running_loop()
        if isinstance(entry, _Call):
            entry.sent_at = loop.time()
        self.waiting.append(entry)
        self.transport.write(command)
        if self._watchdog is None:
            self._watchdog = loop.call_later(self.client.stall_timeout, self._check_stall)

    def data_received(self, data: bytes) -> None:
        self.reader.feed(data)
        while True:
            reply = self.reader.gets()
            if reply is False:
                break
            if not self.waiting:          # a reply nobody asked for: the stream is out of step
                self._abort("an unexpected reply")
                return
            self.client._answer(self.waiting.popleft(), reply)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self._watchdog is not None:
            self._watchdog.cancel()
            self._watchdog = None
        waiting, self.waiting = list(self.waiting), deque()
        self.client._lost(self, waiting, exc)

    def _check_stall(self) -> None:
        self._watchdog = None
        if self.closed or not self.waiting:
            return
        loop = asyncio.get_running_loop()
        oldest = next((e.sent_at for e in self.waiting if isinstance(e, _Call)), loop.time())
        if loop.time() - oldest >= self.client.stall_timeout:
            self._abort(f"no reply in {self.client.stall_timeout:.1f}s")
            return
        self._watchdog = loop.call_at(oldest + self.client.stall_timeout, self._check_stall)

    def _abort(self, why: str) -> None:
        self.client.last_abort = why
        if self.transport is not None:
            self.transport.abort()


class ScriptClient:
    """Script calls over one pipelined connection (module doc). `call()` returns a future of the reply."""

    def __init__(self, url: str, *, password: str = "", connect_timeout: float = 2.0,
                 stall_timeout: float = 20.0, tls: Mapping[str, Any] | None = None) -> None:
        kw = parse_url(url)
        # `tls`: the ssl_* options of a rediss:// URL (AdmissionSettings.redis_options)
        self._tls = _tls_context(tls or {}) if url.startswith("rediss://") else None
        self._path: str | None = kw.get("path")
        self._host: str = kw.get("host") or "localhost"
        self._port: int = int(kw.get("port") or 6379)
        self._db = int(kw.get("db") or 0)
        self._username: str | None = kw.get("username")
        self._password = password or kw.get("password") or ""
        self.connect_timeout = connect_timeout
        self.stall_timeout = stall_timeout
        self._conn: _Connection | None = None
        self._connecting: asyncio.Task[None] | None = None
        self._queued: list[_Call] = []
        self._loading: dict[str, asyncio.Future[Any]] = {}     # library code -> its FUNCTION LOAD
        self._closed = False
        self.connects = 0            # connections made (tests)
        self.script_fallbacks = 0    # calls run as scripts because their library did not load
        self.last_abort = ""

    def call(self, sha: str, body: str, keys: list[Any] | tuple[Any, ...], args: list[Any] | tuple[Any, ...]
             ) -> asyncio.Future[Any]:
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._submit(_Call(sha, body, tuple(keys), tuple(args), fut))
        return fut

    def fcall(self, name: str, library: str, keys: list[Any] | tuple[Any, ...], args: list[Any] | tuple[Any, ...],
              script: str = "") -> asyncio.Future[Any]:
        """FCALL of function `name` of the function library `library` (its code): a library unknown to
        Redis (a restart without persistence, FUNCTION FLUSH) is loaded (FUNCTION LOAD REPLACE, once
        for every call that found it missing) and the call sent again. When the load fails (Redis at
        maxmemory refuses FUNCTION LOAD; an ACL or a proxy may too) the call runs as `script`, the
        same operation as a script (EVALSHA, or EVAL with its body), or without one fails with the
        load's error."""
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._submit(_Call(name, library, tuple(keys), tuple(args), fut, library=True, script=script))
        return fut

    def command(self, *args: Any) -> asyncio.Future[Any]:
        """Any other command (its raw RESP2 reply: no redis-py response callback), e.g. PUBLISH, GET, an
        EVAL with its body. It too is sent once more if its connection dies: give it only idempotent ones."""
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._submit(_Call("", "", (), (), fut, raw=pack(*args)))
        return fut

    async def close(self) -> None:
        self._closed = True
        if self._connecting is not None:
            self._connecting.cancel()
            with contextlib.suppress(BaseException):
                await self._connecting
        conn, self._conn = self._conn, None
        if conn is not None and conn.transport is not None:
            conn.transport.close()
        self._fail(self._queued, RedisConnectionError("Redis: the client is closed"))
        self._queued = []

    # ------------------------------------------------------------------------------ internals
    def _submit(self, call: _Call) -> None:
        if call.future.done():        # its caller gave up meanwhile (only at close)
            return
        if self._closed:
            call.future.set_exception(RedisConnectionError("Redis: the client is closed"))
            return
        conn = self._conn
        if conn is not None and not conn.closed:
            conn.write(call, call.command())
            return
        self._queued.append(call)
        if self._connecting is None or self._connecting.done():
            self._connecting = asyncio.ensure_future(self._connect())

    async def _connect(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self.connect_timeout):
                if self._path:
                    _, conn = await loop.create_unix_connection(lambda: _Connection(self), self._path)
                else:
                    _, conn = await loop.create_connection(lambda: _Connection(self), self._host, self._port,
                                                           ssl=self._tls,
                                                           server_hostname=self._host if self._tls else None)
                handshake: list[tuple[Any, ...]] = []
                if self._password:
                    auth = ("AUTH", self._username, self._password) if self._username else ("AUTH", self._password)
                    handshake.append(auth)
                if self._db:
                    handshake.append(("SELECT", self._db))
                for command in handshake:
                    fut: asyncio.Future[Any] = loop.create_future()
                    conn.write(fut, pack(*command))
                    await fut
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - every cause fails the waiting calls alike
            queued, self._queued = self._queued, []
            error = exc if isinstance(exc, (AuthenticationError, ResponseError)) else RedisConnectionError(
                f"Redis: cannot connect ({type(exc).__name__}: {exc})")
            self._fail(queued, error)
            return
        self.connects += 1
        self._conn = conn
        queued, self._queued = self._queued, []
        for call in queued:
            self._submit(call)

    def _answer(self, entry: _Call | asyncio.Future[Any], reply: Any) -> None:
        if not isinstance(entry, _Call):         # a handshake command
            if not entry.done():
                if isinstance(reply, _ErrorReply):
                    entry.set_exception(_error(str(reply)))
                else:
                    entry.set_result(reply)
            return
        if isinstance(reply, _ErrorReply):
            message = str(reply)
            if message.startswith("NOSCRIPT") and entry.sha and not entry.by_body and not entry.library:
                entry.by_body = True        # loaded by this EVAL; the next calls' EVALSHA finds it
                self._submit(entry)
                return
            if entry.library and not entry.by_body and "Function not found" in message:
                entry.by_body = True
                self._load(entry.body).add_done_callback(lambda load: self._loaded(entry, load))
                return
            if not entry.future.done():
                entry.future.set_exception(_error(message))
            return
        if not entry.future.done():
            entry.future.set_result(reply)

    def _load(self, library: str) -> asyncio.Future[Any]:
        """FUNCTION LOAD REPLACE of `library`, one at a time for all the calls that found it missing."""
        load = self._loading.get(library)
        if load is None or load.done():
            load = self._loading[library] = self.command("FUNCTION", "LOAD", "REPLACE", library)
            load.add_done_callback(lambda done: self._loading.pop(library, None) if self._loading.get(library)
                                   is done else None)
        return load

    def _loaded(self, entry: _Call, load: asyncio.Future[Any]) -> None:
        if entry.future.done():
            return
        error = None if load.cancelled() else load.exception()
        if load.cancelled() or error is not None:
            if entry.script:           # the same operation as a script (it runs at maxmemory if flagged so)
                self.script_fallbacks += 1
                entry.library, entry.by_body = False, False
                entry.sha, entry.body = hashlib.sha1(entry.script.encode()).hexdigest(), entry.script
                self._submit(entry)
                return
            entry.future.set_exception(error or RedisConnectionError("Redis: the function library did not load"))
            return
        self._submit(entry)

    def _lost(self, conn: _Connection, waiting: list[_Call | asyncio.Future[Any]], exc: Exception | None) -> None:
        if self._conn is conn:
            self._conn = None
        why = RedisConnectionError(f"Redis: connection lost ({self.last_abort or exc or 'closed by the server'})")
        self.last_abort = ""
        for entry in waiting:
            if not isinstance(entry, _Call):
                if not entry.done():
                    entry.set_exception(why)
            elif entry.resent or self._closed:
                self._fail([entry], why)
            else:
                entry.resent = True
                self._submit(entry)

    @staticmethod
    def _fail(calls: list[_Call], exc: Exception) -> None:
        for call in calls:
            if not call.future.done():
                call.future.set_exception(exc)
