"""Where the engine replicas are: sources of (pool, address) members, and the task that keeps an
`EnginePool`'s membership equal to their union.

Entries (``--engines``): ``[pool@]address``; no prefix is pool ``default``. An address is
``host:port`` (or ``unix:PATH``): one static replica; or ``dns:host:port``: every A/AAAA record of
``host`` is one replica at ``port``, re-resolved every ``--dns-interval`` seconds (a Kubernetes
headless service). A lookup that fails keeps the last set (dead addresses leave rotation through
their circuit breakers, not through DNS).

The registry (``--engine-registry``): engines write themselves into one Redis hash of the
admission pool, ``tq:{<pool>}:engines`` (the pool's hash tag: one Cluster slot), field = the
address routers dial, value = ``<expiry ms> <json>`` where the expiry is Redis's own clock plus the
engine's TTL, so no two hosts' clocks are compared (engine_svc/registration.py writes it). A router
reads the whole hash in one script call per ``--registry-interval`` (it also deletes entries
expired for more than a minute): a live entry is a member (its pool, its draining flag, its load);
an expired one is a replica that missed its heartbeats and is removed at once, its in-flight
streams failed (retryable: the engine stage retries them elsewhere before their first token); an
entry that is gone was deleted by its engine on a clean stop, and the replica is retired: no new
work, closed once its requests end. Redis down or slow: the last set read is kept, logged once.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import socket
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from redis.exceptions import RedisError

from services.logging import get_logger
from services.tasks import OwnedTask

from . import metrics
from .breaker import BreakerPolicy
from .cluster_redis import open_redis
from .upstreams import DEFAULT_POOL, EnginePool, ReplicaLoad

if TYPE_CHECKING:
    from services.security import SecuritySettings

    from .admission_settings import AdmissionSettings
    from .config import RoutingSettings, UpstreamSettings

log = get_logger(__name__)

POOL_NAME = re.compile(r"^[A-Za-z0-9._-]{1,64}$")
GC_AFTER_MS = 60_000    # an entry expired this long is deleted (any router may)
_MALFORMED: set[str] = set()


def registry_key(pool: str) -> str:
    """The registry hash of an admission pool (engine_svc/registration.py writes the same key)."""
    return f"tq:{{{pool}}}:engines"


# KEYS[1]: the registry hash; ARGV[1]: ms after its expiry an entry is deleted. Returns Redis's time
# (ms) and the hash's fields and values (HGETALL order).
_READ = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local all = redis.call('HGETALL', KEYS[1])
for i = 1, #all, 2 do
  local exp = tonumber(string.match(all[i + 1], '^(%d+)'))
  if exp == nil or exp + tonumber(ARGV[1]) < now then redis.call('HDEL', KEYS[1], all[i]) end
end
return {now, all}
"""


# ------------------------------------------------------------------------------------------ entries
@dataclass(frozen=True)
class Entry:
    """One ``--engines`` entry."""

    pool: str
    address: str          # host:port, unix:PATH, or (dns) host:port to resolve
    dns: bool = False

    @property
    def host_port(self) -> tuple[str, int]:
        host, _, port = self.address.rpartition(":")
        return host.strip("[]"), int(port)


def parse_entry(text: str) -> Entry:
    """``[pool@]host:port`` | ``[pool@]unix:PATH`` | ``[pool@]dns:host:port``; ValueError if malformed."""
    raw = text.strip()
    pool = DEFAULT_POOL
    head, at, rest = raw.partition("@")
    if at and ":" not in head and "/" not in head:
        if not POOL_NAME.match(head):
            raise ValueError(f"{text!r}: pool name {head!r} must be 1-64 of A-Z a-z 0-9 . _ -")
        pool, raw = head, rest
    if raw.startswith("dns:"):
        target = raw[4:]
        host, _, port = target.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"{text!r} is not dns:host:port")
        return Entry(pool, target, dns=True)
    if raw.startswith("unix:"):
        if len(raw) <= 5:
            raise ValueError(f"{text!r} is not unix:PATH")
        return Entry(pool, raw)
    host, _, port = raw.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{text!r} is not an address ([pool@]host:port, [pool@]unix:PATH or "
                         "[pool@]dns:host:port)")
    return Entry(pool, raw)


def format_address(family: int, ip: str, port: int) -> str:
    return f"[{ip}]:{port}" if family == socket.AF_INET6 else f"{ip}:{port}"


# ------------------------------------------------------------------------------------------ sources
@dataclass(frozen=True)
class Member:
    pool: str
    address: str
    draining: bool = False
    load: ReplicaLoad | None = None     # the registry's last heartbeat, when it came from there


@dataclass(frozen=True)
class Reading:
    """What a source knows now: its members by address, and (registry) those that expired."""

    members: dict[str, Member]
    expired: frozenset[str] = frozenset()


class Source(Protocol):
    name: str
    interval: float      # seconds between reads (0 = read once)

    async def read(self) -> Reading | None:
        """The source's members now, or None when it cannot tell (keep the last reading)."""
        ...

    async def close(self) -> None: ...


class StaticSource:
    name = "static"
    interval = 0.0

    def __init__(self, entries: Iterable[Entry]) -> None:
        self._members = {e.address: Member(e.pool, e.address) for e in entries}

    async def read(self) -> Reading:
        return Reading(dict(self._members))

    async def close(self) -> None:
        return None


class _Warn:
    """Log a source's failure once until it recovers."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.failing = False

    def failed(self, error: object) -> None:
        metrics.DISCOVERY_FAILURES.labels(self.name.split(":", 1)[0]).inc()
        if not self.failing:
            self.failing = True
            log.warning("discovery_failed", source=self.name, error=str(error), keeping="the last known replicas")

    def ok(self) -> None:
        if self.failing:
            self.failing = False
            log.info("discovery_recovered", source=self.name)


class DnsSource:
    """Every A/AAAA record of ``host`` is one replica at ``port`` (duplicates merged)."""

    def __init__(self, entry: Entry, interval: float, timeout: float = 5.0) -> None:
        self.pool = entry.pool
        self.host, self.port = entry.host_port
        self.name = f"dns:{entry.address}"
        self.interval = interval
        self._timeout = timeout
        self._warn = _Warn(self.name)

    async def read(self) -> Reading | None:
        loop = asyncio.get_running_loop()
        try:
            infos = await asyncio.wait_for(
                loop.getaddrinfo(self.host, self.port, type=socket.SOCK_STREAM), self._timeout)
        except (OSError, asyncio.TimeoutError) as exc:
            self._warn.failed(exc or "timeout")
            return None
        self._warn.ok()
        addresses = {format_address(family, str(sockaddr[0]), self.port) for family, _, _, _, sockaddr in infos
                     if family in (socket.AF_INET, socket.AF_INET6)}
        return Reading({a: Member(self.pool, a) for a in sorted(addresses)})

    async def close(self) -> None:
        return None


def _load(entry: dict[str, Any]) -> ReplicaLoad:
    return ReplicaLoad(int(entry.get("active", 0)), int(entry.get("queued", 0)), int(entry.get("max_active", 0)),
                       int(entry.get("kv_used", 0)), int(entry.get("kv_total", 0)), int(entry.get("max_context", 0)),
                       int(entry.get("tokens_per_block", 0)))


def parse_registry(now_ms: int, flat: Sequence[Any]) -> Reading:
    """The registry hash (HGETALL's flat list) at Redis time `now_ms` → live members and expired
    addresses; a malformed entry is skipped."""
    members: dict[str, Member] = {}
    expired: set[str] = set()
    for i in range(0, len(flat) - 1, 2):
        address = _text(flat[i])
        expiry, _, body = _text(flat[i + 1]).partition(" ")
        try:
            if parse_entry(address).dns or "@" in address:
                raise ValueError(address)
            entry = json.loads(body)
            if int(expiry) < now_ms:
                expired.add(address)
                continue
            pool = str(entry.get("pool") or DEFAULT_POOL)
            members[address] = Member(pool, address, bool(entry.get("draining")), _load(entry))
        except (ValueError, TypeError, AttributeError):
            if address not in _MALFORMED and len(_MALFORMED) < 1024:   # once per entry, not per read
                _MALFORMED.add(address)
                log.warning("registry_entry_malformed", address=address)
    return Reading(members, frozenset(expired))


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class RegistrySource:
    """The engines' registry in Redis: one script call per read (module doc)."""

    def __init__(self, redis_url: str, pool: str, interval: float, timeout: float = 1.0,
                 **redis_options: Any) -> None:
        self.name = f"registry:{pool}"
        self.interval = interval
        self.key = registry_key(pool)
        self._redis = open_redis(redis_url, timeout, **redis_options)
        self._script = self._redis.register_script(_READ)
        self._timeout = timeout
        self._warn = _Warn(self.name)

    async def read(self) -> Reading | None:
        try:
            now, flat = await asyncio.wait_for(self._script(keys=[self.key], args=[GC_AFTER_MS]),
                                               self._timeout * 2)
        except (RedisError, OSError, asyncio.TimeoutError) as exc:
            self._warn.failed(exc or "timeout")
            return None
        self._warn.ok()
        return parse_registry(int(now), flat)

    async def close(self) -> None:
        await self._redis.aclose()


def build_sources(entries: Sequence[str], *, dns_interval: float, registry_url: str = "", registry_pool: str = "",
                  registry_interval: float = 1.0, redis_timeout: float = 1.0,
                  redis_options: dict[str, Any] | None = None) -> list[Source]:
    """The sources of ``--engines`` entries (one static source, one per dns: entry) and the registry."""
    parsed = [parse_entry(e) for e in entries]
    sources: list[Source] = []
    static = [e for e in parsed if not e.dns]
    if static:
        sources.append(StaticSource(static))
    sources.extend(DnsSource(e, dns_interval) for e in parsed if e.dns)
    if registry_url:
        sources.append(RegistrySource(registry_url, registry_pool, registry_interval, redis_timeout,
                                      **(redis_options or {})))
    return sources


async def _resolve(entries: Sequence[str], timeout: float, keep_unresolved: bool) -> list[str] | None:
    out: list[str] = []
    for text in entries:
        entry = parse_entry(text)
        if not entry.dns:
            out.append(entry.address)
            continue
        reading = await DnsSource(entry, 0, timeout).read()
        if reading is not None and reading.members:
            out.extend(reading.members)
        elif keep_unresolved:
            out.append(entry.address)
        else:
            return None
    return list(dict.fromkeys(out))


async def resolve(entries: Sequence[str], timeout: float = 5.0) -> list[str] | None:
    """Plain addresses of ``host:port`` / ``dns:host:port`` entries; None when a `dns:` entry could
    not be read (the caller keeps what it had)."""
    return await _resolve(entries, timeout, keep_unresolved=False)


class TokenizerDiscovery:
    """The tokenizer replicas of `--tokenizers` followed while the router runs: `dns:` entries (a
    Kubernetes headless service) are read again every `interval` and the upstream serves what they
    list now (`TokenizerUpstream.sync`: new replicas get work at once, gone ones are retired once
    idle). Static entries stay as given; a lookup that fails keeps the last membership."""

    def __init__(self, entries: Sequence[str], upstream: Any, interval: float, timeout: float = 5.0,
                 resolver: Any = resolve) -> None:
        self._entries = list(entries)
        self._resolver = resolver     # (entries, timeout) -> addresses | None; tests give their own
        self._upstream = upstream
        self._interval = interval
        self._timeout = timeout
        self._task = OwnedTask("discovery-tokenizers")

    @property
    def follows(self) -> bool:
        return self._interval > 0 and any(parse_entry(e).dns for e in self._entries)

    def start(self) -> None:
        if self.follows:
            self._task.ensure(self._follow)

    async def refresh(self) -> None:
        addresses = await self._resolver(self._entries, self._timeout)
        if addresses:
            self._upstream.sync(addresses)

    async def _follow(self) -> None:
        while True:
            await asyncio.sleep(self._interval)   # the lookup period, not a synchronisation
            try:
                await self.refresh()
            except Exception:   # one bad reading must not end discovery: logged, the next one may do
                log.exception("tokenizer_discovery_failed")

    async def close(self) -> None:
        await self._task.close()


async def resolve_once(entries: Sequence[str], timeout: float = 5.0) -> list[str]:
    """Plain addresses of ``host:port`` / ``dns:host:port`` entries, resolved once (at start; the
    tokenizers are then followed by `TokenizerDiscovery`). A name that does not resolve is kept as
    it is (gRPC's own resolver then tries it)."""
    return await _resolve(entries, timeout, keep_unresolved=True) or []


# ---------------------------------------------------------------------------------------- discovery
@dataclass
class Discovery:
    """Keeps `pool`'s membership equal to the union of its sources' last readings. Owns one task
    per source that is read more than once (`start` / `close`)."""

    sources: list[Source]
    pool: EnginePool
    readings: dict[str, Reading] = field(default_factory=dict)
    _tasks: list[asyncio.Task[None]] = field(default_factory=list)
    _closed: bool = False

    async def start(self) -> None:
        """Read every source once (so the first requests see the replicas), then keep reading."""
        await self.refresh()
        self._tasks = [asyncio.create_task(self._follow(s), name=f"discovery-{s.name}")
                       for s in self.sources if s.interval > 0]

    async def refresh(self) -> None:
        """Read every source now and sync."""
        results = await asyncio.gather(*(s.read() for s in self.sources))
        for source, reading in zip(self.sources, results, strict=True):
            if reading is not None:
                self.readings[source.name] = reading
        self.sync()

    async def _follow(self, source: Source) -> None:
        while not self._closed:   # a flag too: wait_for (3.11) may swallow a cancel that races its result
            await asyncio.sleep(source.interval)
            try:
                reading = await source.read()
                if reading is not None and not self._closed:
                    self.readings[source.name] = reading
                    self.sync()
            except Exception:   # one bad reading must not end discovery: logged, the next one may do
                log.exception("discovery_sync_failed", source=source.name)

    def sync(self) -> None:
        """Add what the sources list, update what changed, remove what none lists any more."""
        wanted: dict[str, Member] = {}
        expired: set[str] = set()
        for source in self.sources:
            reading = self.readings.get(source.name)
            if reading is None:
                continue
            expired |= reading.expired
            for address, member in reading.members.items():
                wanted.setdefault(address, member)
        for address, member in wanted.items():
            self.pool.add(member.pool, address, member.load)
            if member.draining:
                self.pool.set_draining(address)
        for address in set(self.pool.addresses()) - set(wanted):
            self.pool.remove(address, now=address in expired)

    async def close(self) -> None:
        self._closed = True
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        for source in self.sources:
            await source.close()


def from_settings(upstreams: UpstreamSettings, routing: RoutingSettings, admission: AdmissionSettings,
                  security: SecuritySettings) -> Discovery:
    """The router's engine pool (empty: its sources fill it on `start()`) and its discovery."""
    if not upstreams.engines and not upstreams.engine_registry:
        raise ValueError("no engine replicas: give --engines or --engine-registry")
    policy = BreakerPolicy(routing.breaker_failures, routing.breaker_backoff, routing.breaker_max_backoff)
    pool = EnginePool((), routing.engine_poll_interval, security=security, wake_delay=routing.engine_wake_delay,
                      breaker=policy, poll_timeout=routing.engine_poll_timeout, frames=upstreams.engine_frames)
    sources = build_sources(upstreams.engines, dns_interval=upstreams.dns_interval,
                            registry_url=admission.redis_url if upstreams.engine_registry else "",
                            registry_pool=admission.pool, registry_interval=upstreams.registry_interval,
                            redis_timeout=min(admission.op_timeout, 1.0), redis_options=admission.redis_options())
    return Discovery(sources, pool)
