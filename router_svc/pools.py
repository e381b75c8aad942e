"""Engine pools: the weighted traffic split between them, and its shared, runtime-changeable config.

A split names engine pools with weights (``default=90,canary=10``) and, optionally, a shadow pool
and the share of requests mirrored to it (router_svc/shadow.py).

- `TrafficSplit` (pure): the pool of a request is a deterministic function of a stickiness key
  (`sticky_key`: the tenant's session if it has one, else the tenant; or always the tenant; or the
  request, i.e. no stickiness): blake2b(epoch, key) is a point in [0, 1), and the pools, in name
  order, own consecutive intervals of it as wide as their weights. So every router process sends
  a session to the same pool while the weights stay; moving weight between two pools moves only
  the keys in the interval that changed hands (90/10 → 80/20 moves 10% of keys, all of them to
  the pool that grew), and a new epoch reshuffles every key. With three or more pools a change
  can move more keys than the minimum when weight passes over a pool in between.
- A pool with no healthy, serving replica: its requests fall back to the heaviest pool of the
  split that has one (logged and counted in ``tokenrelay_router_pool_requests_total{how=
  "fallback"}``), never to a pool of weight 0: during a rollout a canary that dies must cost the
  clients nothing, and a pool just rolled back to 0 must not take traffic again because the primary
  blinked. Nothing serving in any weighted pool: the chosen pool is returned, and placement
  answers NO_HEALTHY_REPLICA.
- `SplitStore`: the split every router serves, in the Redis hash ``tq:{pool}:split`` (the
  admission pool's hash tag) with a version that each write increments; routers reload it on a
  pub/sub notice (``tq:{pool}:split:changed``) and on a poll, so a change reaches every router
  within a second on the notice, at worst one poll interval later, without a restart. A field the
  hash lacks (or no hash at all) falls back to the router's flags (``--traffic-split``,
  ``--shadow-pool``, ``--shadow-fraction``): `tokenrelay split reset` returns to them. An
  invalid value in Redis keeps the split being served (logged, counted). Redis down: the split
  being served stays.
- `write_split` / `read_split` / `reset_split`: what `tokenrelay split set|show|reset` calls.
  Instant rollback is ``tokenrelay split set default=100``.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import math
import re
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from services.logging import get_logger

from .cluster_redis import REDIS_ERRORS, RedisClient, open_redis, stop_tasks, subscribe
from .metrics import POOL_REQUESTS, SPLIT_RELOADS, SPLIT_VERSION, SPLIT_WEIGHT
from .ports import ReplicaSnapshot

log = get_logger(__name__)

Sticky = Literal["session", "tenant", "request"]
POOL_NAME = re.compile(r"^[A-Za-z0-9._-]{1,64}$")
MAX_POOLS = 16
_SCALE = float(1 << 64)


def parse_weights(text: str | Sequence[str]) -> dict[str, float]:
    """``default=90,canary=10`` (commas and/or spaces, or a list of ``pool=weight``) → weights.

    Raises ValueError with the reason: a bad pool name, a weight that is not a finite number ≥ 0,
    a pool named twice, more than MAX_POOLS pools, or no positive weight at all."""
    items = text if not isinstance(text, str) else [t for t in re.split(r"[,\s]+", text) if t]
    weights: dict[str, float] = {}
    for item in items:
        name, sep, value = item.partition("=")
        name = name.strip()
        if not sep or not POOL_NAME.match(name):
            raise ValueError(f"{item!r} is not pool=weight (a pool name is 1-64 of A-Z a-z 0-9 . _ -)")
        try:
            weight = float(value)
        except ValueError:
            raise ValueError(f"{item!r}: the weight {value!r} is not a number") from None
        if not math.isfinite(weight) or weight < 0:
            raise ValueError(f"{item!r}: a weight is a finite number >= 0")
        if name in weights:
            raise ValueError(f"pool {name!r} is named twice")
        weights[name] = weight
    if len(weights) > MAX_POOLS:
        raise ValueError(f"at most {MAX_POOLS} pools in a split, got {len(weights)}")
    if not any(w > 0 for w in weights.values()):
        raise ValueError("a split needs at least one pool with a weight above 0")
    return weights


def format_weights(weights: Mapping[str, float]) -> str:
    return ",".join(f"{name}={weight:g}" for name, weight in sorted(weights.items()))


def check_shadow(pool: str, fraction: float) -> None:
    """Raises ValueError unless (pool, fraction) is a shadow setting: ("", 0) is off."""
    if pool and not POOL_NAME.match(pool):
        raise ValueError(f"{pool!r} is not a pool name (1-64 of A-Z a-z 0-9 . _ -)")
    if not math.isfinite(fraction) or not 0 <= fraction <= 1:
        raise ValueError(f"the shadow fraction is between 0 and 1, got {fraction}")


def unit_hash(salt: str, key: str) -> float:
    """A stable point in [0, 1) of (salt, key): the same in every process and Python version."""
    digest = hashlib.blake2b(key.encode(), digest_size=8, key=salt.encode()[:64]).digest()
    return int.from_bytes(digest, "big") / _SCALE


def sticky_key(mode: Sticky, tenant: str, session_id: str, request_id: str) -> str:
    """What a request's pool is a function of. Sessions are the tenant's own (the key holds both)."""
    if mode == "request":
        return f"r\0{tenant}\0{request_id}"
    if mode == "session" and session_id:
        return f"s\0{tenant}\0{session_id}"
    return f"t\0{tenant}"


@dataclass(frozen=True)
class SplitConfig:
    """One version of the split: weights by pool, the shadow pool and its share, the hash epoch."""

    weights: tuple[tuple[str, float], ...]        # by pool name
    shadow_pool: str = ""
    shadow_fraction: float = 0.0
    epoch: str = ""
    version: int = 0                              # Redis's counter; 0 = the router's flags

    @classmethod
    def build(cls, weights: str | Mapping[str, float], shadow_pool: str = "", shadow_fraction: float = 0.0,
              epoch: str = "", version: int = 0) -> SplitConfig:
        parsed = parse_weights(weights) if isinstance(weights, str) else dict(weights)
        if isinstance(weights, Mapping):
            parse_weights(format_weights(parsed))   # the same checks
        check_shadow(shadow_pool, shadow_fraction)
        return cls(tuple(sorted(parsed.items())), shadow_pool if shadow_fraction > 0 else "",
                   shadow_fraction if shadow_pool else 0.0, epoch, version)

    def describe(self) -> dict[str, Any]:
        return {"version": self.version, "weights": format_weights(dict(self.weights)),
                "shadow": f"{self.shadow_pool}:{self.shadow_fraction:g}" if self.shadow_pool else "off",
                "epoch": self.epoch}


@dataclass(frozen=True)
class Choice:
    pool: str
    fallback: bool = False      # the split's pool had no serving replica


class TrafficSplit:
    """Pure: a stickiness key → a pool, by cumulative weights over the pools in name order."""

    def __init__(self, config: SplitConfig) -> None:
        self.config = config
        total = sum(w for _, w in config.weights)
        self._bounds: list[tuple[float, str]] = []
        edge = 0.0
        for name, weight in config.weights:
            if weight > 0:
                edge += weight / total
                self._bounds.append((edge, name))
        # By weight, heaviest first (ties by name): where a pool without replicas sends its keys.
        self._by_weight = [n for n, w in sorted(config.weights, key=lambda p: (-p[1], p[0])) if w > 0]

    @property
    def pools(self) -> list[str]:
        """The pools that get traffic (weight > 0)."""
        return [name for _, name in self._bounds]

    @property
    def primary(self) -> str:
        return self._by_weight[0]

    def pick(self, key: str) -> str:
        point = unit_hash(self.config.epoch, key)
        for edge, name in self._bounds:
            if point < edge:
                return name
        return self._bounds[-1][1]      # float rounding at the top end

    def choose(self, key: str, serving: Collection[str] | None = None) -> Choice:
        """The key's pool; when `serving` (pools with a serving replica) lacks it, the heaviest
        weighted pool that has one."""
        pool = self.pick(key)
        if serving is None or pool in serving:
            return Choice(pool)
        for other in self._by_weight:
            if other in serving:
                return Choice(other, fallback=True)
        return Choice(pool)


def serving_pools(snapshots: Sequence[ReplicaSnapshot]) -> set[str]:
    return {s.pool for s in snapshots if s.healthy and s.serving}


class SplitSelector:
    """`ports.PoolSelector` over the split being served (`split()`, read per request: a reload is one
    reference swap) and the replicas' snapshots (for the fallback)."""

    def __init__(self, split: Callable[[], TrafficSplit], snapshots: Callable[[], Sequence[ReplicaSnapshot]],
                 sticky: Sticky = "session") -> None:
        self._split = split
        self._snapshots = snapshots
        self.sticky: Sticky = sticky
        self._counters: dict[tuple[str, str], Any] = {}
        self._warned: dict[str, float] = {}

    def routed_snapshots(self) -> list[ReplicaSnapshot]:
        """The replicas of the pools that get traffic (weight > 0): the admission queue's capacity.
        A shadow-only or rolled-back pool's replicas run no primary request, so they add no room."""
        routed = set(self._split().pools)
        return [s for s in self._snapshots() if s.pool in routed]

    def choose(self, tenant: str, session_id: str, request_id: str) -> str:
        split = self._split()
        key = sticky_key(self.sticky, tenant, session_id, request_id)
        wanted = split.pick(key)
        snapshots = self._snapshots()
        if any(s.pool == wanted and s.healthy and s.serving for s in snapshots):
            choice = Choice(wanted)
        else:
            choice = split.choose(key, serving_pools(snapshots))
        how = "fallback" if choice.fallback else "split"
        counter = self._counters.get((choice.pool, how))
        if counter is None:
            counter = self._counters[(choice.pool, how)] = POOL_REQUESTS.labels(choice.pool, how)
        counter.inc()
        if choice.fallback:
            now = time.monotonic()
            if now - self._warned.get(wanted, -1e9) > 10:     # per request otherwise
                self._warned[wanted] = now
                log.warning("pool_fallback", wanted=wanted, pool=choice.pool,
                            why="no healthy, serving replica in the pool")
        return choice.pool


# ----------------------------------------------------------------------------------------- Redis
def split_key(pool: str) -> str:
    return f"tq:{{{pool}}}:split"


def split_channel(pool: str) -> str:
    return f"tq:{{{pool}}}:split:changed"


# KEYS[1] the split hash; ARGV: channel, weights ('' = keep), epoch, set shadow (0/1), shadow pool,
# fraction, who, when.
# One write, one version, one notice: a router never reads half a change.
_WRITE = """
redis.call('HSET', KEYS[1], 'updated_by', ARGV[7], 'updated_at', ARGV[8])
if ARGV[2] ~= '' then redis.call('HSET', KEYS[1], 'weights', ARGV[2], 'epoch', ARGV[3]) end
if ARGV[4] == '1' then redis.call('HSET', KEYS[1], 'shadow_pool', ARGV[5], 'shadow_fraction', ARGV[6]) end
local v = redis.call('HINCRBY', KEYS[1], 'version', 1)
redis.call('PUBLISH', ARGV[1], v)
return v
"""


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def config_from_hash(fields: Mapping[Any, Any], base: SplitConfig) -> SplitConfig:
    """The split a Redis hash describes; what it lacks comes from `base` (the router's flags).
    Raises ValueError when a value is invalid."""
    got = {_text(k): _text(v) for k, v in fields.items()}
    if not got:
        return base
    weights = got.get("weights")
    shadow_pool = got.get("shadow_pool", base.shadow_pool)
    try:
        fraction = float(got["shadow_fraction"]) if "shadow_fraction" in got else base.shadow_fraction
        version = int(got.get("version", "0"))
    except ValueError as exc:
        raise ValueError(f"split hash: {exc}") from None
    return SplitConfig.build(weights if weights is not None else dict(base.weights), shadow_pool, fraction,
                             got.get("epoch", base.epoch), version)


async def write_split(redis: RedisClient, pool: str, weights: Mapping[str, float] | None, *, epoch: str = "",
                      shadow: tuple[str, float] | None = None, who: str = "") -> int:
    """Store a split for every router of `pool` and notify them; returns its version. `weights`
    None keeps the stored weights and epoch; `shadow` None keeps the stored shadow setting, ("", 0)
    turns it off."""
    text = ""
    if weights is not None:
        text = format_weights(weights)
        parse_weights(text)
    if shadow is not None:
        check_shadow(*shadow)
    pool_name, fraction = shadow or ("", 0.0)
    return int(await redis.eval(_WRITE, 1, split_key(pool), split_channel(pool), text, epoch,
                                "0" if shadow is None else "1", pool_name, repr(float(fraction)), who,
                                repr(time.time())))


async def read_split(redis: RedisClient, pool: str) -> dict[str, str]:
    return {_text(k): _text(v) for k, v in (await redis.hgetall(split_key(pool))).items()}


async def reset_split(redis: RedisClient, pool: str) -> None:
    """Forget the stored split: routers return to their flags."""
    async with redis.pipeline(transaction=True) as pipe:
        pipe.delete(split_key(pool))
        pipe.execute_command("PUBLISH", split_channel(pool), "0")   # a cluster pipeline blocks pipe.publish()
        await pipe.execute()


class SplitStore:
    """The split this router serves: its flags' split until Redis holds one, then Redis's, reloaded
    on the change notice and every `poll_interval` seconds. Owns its two tasks (`start` / `close`)."""

    def __init__(self, initial: SplitConfig, redis_url: str = "", pool: str = "", *, poll_interval: float = 2.0,
                 op_timeout: float = 1.0, redis_options: Mapping[str, Any] | None = None) -> None:
        self.base = initial
        self._split = TrafficSplit(initial)
        self.pool = pool
        self.poll_interval = poll_interval
        self.op_timeout = op_timeout
        self.redis: RedisClient | None = (open_redis(redis_url, op_timeout, **(redis_options or {}))
                                             if redis_url else None)
        self.reloads = 0                 # reads of Redis done (tests wait on it)
        self._wake = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self._last_warn = -1e9
        self._published(initial)

    @property
    def config(self) -> SplitConfig:
        return self._split.config

    def split(self) -> TrafficSplit:
        return self._split

    async def start(self) -> None:
        if self.redis is None:
            return
        await self.reload()
        self._tasks = [asyncio.create_task(self._listen(), name="split-listener"),
                       asyncio.create_task(self._poll(), name="split-poller")]

    async def close(self) -> None:
        if self._tasks:
            await stop_tasks(self._tasks, self.op_timeout * 2)
        if self.redis is not None:
            with contextlib.suppress(*REDIS_ERRORS):
                await self.redis.aclose()

    async def reload(self) -> bool:
        """Read Redis once; True if the split served changed."""
        assert self.redis is not None
        try:
            fields = await asyncio.wait_for(self.redis.hgetall(split_key(self.pool)), self.op_timeout)
        except REDIS_ERRORS as exc:
            SPLIT_RELOADS.labels("failed").inc()
            self._warn("split_reload_failed", error=repr(exc))
            return False
        finally:
            self.reloads += 1
        try:
            config = config_from_hash(fields, self.base)
        except ValueError as exc:
            SPLIT_RELOADS.labels("invalid").inc()
            self._warn("split_invalid", error=str(exc), kept=self.config.describe())
            return False
        if config == self.config:
            return False
        old, self._split = self.config, TrafficSplit(config)
        SPLIT_RELOADS.labels("changed").inc()
        log.info("split_changed", **config.describe(), previous=old.describe()["weights"],
                 previous_version=old.version)
        self._published(config, old)
        return True

    def _published(self, config: SplitConfig, old: SplitConfig | None = None) -> None:
        SPLIT_VERSION.set(config.version)
        for name, _ in old.weights if old else ():
            SPLIT_WEIGHT.labels(name).set(0)
        total = sum(w for _, w in config.weights)
        for name, weight in config.weights:
            SPLIT_WEIGHT.labels(name).set(weight / total)

    def _warn(self, event: str, **fields: Any) -> None:
        now = time.monotonic()
        if now - self._last_warn > 10:
            self._last_warn = now
            log.warning(event, **fields)

    async def _poll(self) -> None:
        while True:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self.poll_interval)
            self._wake.clear()
            await self.reload()

    async def _listen(self) -> None:
        assert self.redis is not None
        backoff = 0.05
        while True:
            pubsub = self.redis.pubsub(ignore_subscribe_messages=True)
            try:
                await asyncio.wait_for(subscribe(self.redis, pubsub, split_channel(self.pool)), self.op_timeout)
                self._wake.set()    # a change published while we were not subscribed is read now
                backoff = 0.05
                while True:
                    message = await pubsub.get_message(timeout=1.0)
                    if message is not None and message.get("type") == "message":
                        self._wake.set()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - Redis gone: the poll goes on, subscribe again
                self._warn("split_subscribe_failed", error=repr(exc))
            finally:
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(pubsub.aclose(), self.op_timeout)
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, 2.0)


