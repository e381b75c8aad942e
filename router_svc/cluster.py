"""Router processes as one cluster through Redis: request ids, Cancel and session affinity.

`RedisRequestRegistry` and `RedisSessionAffinity` implement `ports.RequestRegistry` and
`ports.SessionAffinity` for routers that share a Redis (several processes behind one address
with SO_REUSEPORT, or routers on several hosts):

- A request id is claimed per tenant: key ``tr:{pool}:rid:<tenant>:<request_id>`` (set if absent,
  with a TTL; the value is the owner's router id). It is released when the request ends, awaited,
  so a client holding its `done` may reuse the id on any router. One heartbeat task per process
  refreshes every id it holds in one Lua call per 500 ids (never a task per request); a key lost
  to a Redis restart is claimed again by that heartbeat. Another tenant's id is another key:
  invisible, never blocking. An id whose owner died (nobody subscribed to its Cancel channel) is
  taken over at once, so a client retrying on another router after a crash is not refused.
- Cancel: the local request first; otherwise the key names the owner, and the request goes to the
  owner's pub/sub channel ``tr:{pool}:router:<id>``; the owner aborts it and answers on the asker's
  channel. ``cancelled`` is True only if the owner held it; no answer within `cancel_timeout` (the
  owner died: PUBLISH reached no subscriber, or it did not answer) is False.
- Sessions: ``tr:{pool}:sess:<tenant>:<session>`` → engine replica address, TTL refreshed on each
  read, so a session keeps its replica whichever router holds its next turn.

Every command goes through one coalescing pipeline (`cluster_redis.Pipeliner`): what callers
submit while a round trip is in flight goes together in the next, so Redis costs one round trip
per batch, not per request, and a handful of connections per process. Redis down or slow (each
batch is bounded by `op_timeout`): each operation falls back to this process's own view, logged
and counted in ``tokenrelay_router_cluster_fallbacks_total{op}``: claims are checked locally,
Cancel reaches local requests only, sessions stick through a local LRU. Nothing here ever raises
REDIS_UNAVAILABLE or waits longer than its bound. All keys share the pool's hash tag (Redis
Cluster: one slot; the dead-owner check counts subscribers on the node it asks).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import json
import os
import secrets
import socket
from collections.abc import Callable, Mapping
from typing import Any

from prometheus_client import Counter, Gauge
from redis.exceptions import RedisError

from services.errors import Reason
from services.logging import get_logger

from .cluster_redis import REDIS_ERRORS, Pipeliner, Warned, numsub, open_redis, stop_tasks, subscribe
from .placement import LocalSessionAffinity
from .redis_scripts import ScriptClient, open_lean
from .request import LocalRequestRegistry

log = get_logger(__name__)

HELD_IDS = Gauge("tokenrelay_router_cluster_request_ids", "Request ids this router process holds in Redis")
STALE_IDS = Counter("tokenrelay_router_cluster_stale_request_ids_total", "Request ids found claimed in Redis by a "
                    "live router that no longer held them (a release lost, e.g. to a Redis restart), taken over")
REMOTE_CANCELS = Counter("tokenrelay_router_cluster_remote_cancels_total", "Cancels delivered to or from "
                         "another router process, by direction and outcome", ["direction", "outcome"])

_HEARTBEAT_CHUNK = 500
_SESSION_KEY_MAX = 128  # longer session ids are hashed into the key
# KEYS: request-id keys; ARGV: router id, ttl ms. Refresh ours; claim again what a Redis restart lost.
# Returns how many are held by another router (a duplicate admitted while Redis was unreachable).
_HEARTBEAT = """
local lost = 0
for i, k in ipairs(KEYS) do
  local v = redis.call('GET', k)
  if v == ARGV[1] then redis.call('PEXPIRE', k, ARGV[2])
  elseif not v then redis.call('SET', k, ARGV[1], 'PX', ARGV[2])
  else lost = lost + 1 end
end
return lost
"""
# KEYS: request-id keys; ARGV: router id, ttl ms. Per key: free, or ours (a release that has not landed
# yet): claim it, ''; else the owner.
_CLAIM = """
local out = {}
for i, k in ipairs(KEYS) do
  local v = redis.call('GET', k)
  if v and v ~= ARGV[1] then out[i] = v
  else redis.call('SET', k, ARGV[1], 'PX', ARGV[2]); out[i] = '' end
end
return out
"""
# ARGV: router id, ttl ms, the dead owner: take the key over only if that owner still has it.
_TAKE_OVER = """
local v = redis.call('GET', KEYS[1])
if v and v ~= ARGV[3] and v ~= ARGV[1] then return v end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
return ''
"""
# KEYS: request-id keys; ARGV[1] router id: delete only our own claims.
_RELEASE = """
local out = {}
for i, k in ipairs(KEYS) do
  if redis.call('GET', k) == ARGV[1] then out[i] = redis.call('DEL', k) else out[i] = 0 end
end
return out
"""


def default_router_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(3)}"


class RedisCluster:
    """This process's membership: the Redis client, the pipeline, the Cancel channel and the
    heartbeat of its request ids. Owns its tasks (`start` / `close`)."""

    def __init__(self, redis_url: str, pool: str, *, router_id: str = "", op_timeout: float = 1.0,
                 request_id_ttl: float = 15.0, session_ttl: float = 3600.0, cancel_timeout: float = 0.5,
                 redis_options: Mapping[str, Any] | None = None, lean: bool = True) -> None:
        self.router_id = router_id or default_router_id()
        self.pool = pool
        options = dict(redis_options or {})
        self.redis = open_redis(redis_url, op_timeout, **options)
        # The pipeline's commands on a connection that writes them at once (router_svc/redis_scripts.py).
        self.lean: ScriptClient | None = None
        if lean:
            self.lean = open_lean(str(redis_url), options, connect_timeout=op_timeout, stall_timeout=10 * op_timeout)
        self.pipe = Pipeliner(self.redis, op_timeout, self.lean)
        self.op_timeout = op_timeout
        self.warn = Warned()
        self.registry = RedisRequestRegistry(self, request_id_ttl, cancel_timeout)
        self.sessions = RedisSessionAffinity(self, session_ttl)
        self._heartbeat = self.redis.register_script(_HEARTBEAT)
        self._release = self.redis.register_script(_RELEASE)
        self._tasks: list[asyncio.Task[None]] = []

    def key(self, kind: str, tenant: str, name: str) -> str:
        return f"tr:{{{self.pool}}}:{kind}:{tenant}:{name}"

    def channel(self, router_id: str) -> str:
        return f"tr:{{{self.pool}}}:router:{router_id}"

    async def start(self) -> None:
        self.pipe.start()
        subscribed = asyncio.Event()
        self._tasks = [asyncio.create_task(self._listen(subscribed), name="cluster-cancel-listener"),
                       asyncio.create_task(self._beat(), name="cluster-request-id-heartbeat")]
        # Wait (bounded) for the Cancel channel so a Cancel right after start reaches us; with Redis
        # down the listener keeps trying and this router serves on its own meanwhile.
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(subscribed.wait(), self.op_timeout * 2)
        log.info("cluster_joined", router_id=self.router_id, subscribed=subscribed.is_set())

    async def close(self) -> None:
        if self._tasks:
            await stop_tasks(self._tasks, self.op_timeout * 2)
        await self.registry.release_all()
        await self.pipe.close()
        if self.lean is not None:
            await self.lean.close()
        with contextlib.suppress(*REDIS_ERRORS):
            await self.redis.aclose()

    def report(self, op: str) -> Callable[[asyncio.Future[Any]], None]:
        """A done-callback for a command nobody awaits: a failure is counted and logged."""
        def done(fut: asyncio.Future[Any]) -> None:
            if fut.cancelled():
                return
            exc = fut.exception()
            if exc is not None:
                self.warn(op, exc)
        return done

    async def owner_is_gone(self, owner: bytes | str) -> bool:
        """No process listens on the owner's Cancel channel: it died (its ids would otherwise block a
        client's retry until their TTL). Only asked when a claim meets another router's id."""
        owner = owner.decode() if isinstance(owner, bytes) else owner
        return await asyncio.wait_for(numsub(self.redis, self.channel(owner)), self.op_timeout) == 0

    async def publish(self, router_id: str, message: dict[str, Any]) -> int:
        return int(await self.pipe.call("PUBLISH", self.channel(router_id), json.dumps(message)))

    # ------------------------------------------------------------------------------ Cancel channel
    async def _listen(self, subscribed: asyncio.Event) -> None:
        backoff = 0.05
        while True:
            pubsub = self.redis.pubsub(ignore_subscribe_messages=True)
            try:
                await asyncio.wait_for(subscribe(self.redis, pubsub, self.channel(self.router_id)), self.op_timeout)
                subscribed.set()
                backoff = 0.05
                while True:
                    message = await pubsub.get_message(timeout=1.0)
                    if message is not None and message.get("type") == "message":
                        self._on_message(message["data"])
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - Redis gone or a bad message: resubscribe
                self.warn("subscribe", exc)
            finally:
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(pubsub.aclose(), self.op_timeout)
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, 2.0)

    def _on_message(self, data: bytes | str) -> None:
        try:
            message = json.loads(data)
            op = message["op"]
        except (ValueError, KeyError, TypeError):
            log.warning("cluster_bad_message", data=repr(data)[:200])
            return
        if op == "cancel":
            self.registry.remote_cancel(message)
        elif op == "holds":
            self.registry.remote_holds(message)
        elif op in ("cancelled", "held"):
            self.registry.answer(message)

    # ------------------------------------------------------------------------------------ heartbeat
    async def _beat(self) -> None:
        interval = self.registry.ttl / 3
        while True:
            await asyncio.sleep(interval)
            try:
                await self.heartbeat_once()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - next beat tries again; the TTL covers two misses
                self.warn("heartbeat", exc)

    async def heartbeat_once(self) -> int:
        """Refresh every request id this process holds (one Lua call per 500), and retry releases
        that failed. Returns how many of them another router holds (see `_HEARTBEAT`)."""
        keys = self.registry.held_keys()
        ttl_ms = int(self.registry.ttl * 1000)
        lost = 0
        for i in range(0, len(keys), _HEARTBEAT_CHUNK):
            lost += int(await asyncio.wait_for(
                self._heartbeat(keys=keys[i:i + _HEARTBEAT_CHUNK], args=[self.router_id, ttl_ms]), self.op_timeout))
        if lost:
            log.warning("cluster_request_ids_lost", count=lost)
        unreleased = self.registry.unreleased()
        await self.release_keys(unreleased)
        for key in unreleased:
            self.registry.released(key)
        return lost

    async def release_keys(self, keys: list[str]) -> None:
        for i in range(0, len(keys), _HEARTBEAT_CHUNK):
            await asyncio.wait_for(self._release(keys=keys[i:i + _HEARTBEAT_CHUNK], args=[self.router_id]),
                                   self.op_timeout)


class RedisRequestRegistry:
    """`ports.RequestRegistry` across router processes (see the module docstring)."""

    remote = True       # a claim is a Redis round trip

    def __init__(self, cluster: RedisCluster, ttl: float, cancel_timeout: float) -> None:
        self._c = cluster
        self.ttl = ttl
        self.cancel_timeout = cancel_timeout
        self._local = LocalRequestRegistry()   # this process's ids and their cancel callbacks
        self._claiming: set[tuple[str, str]] = set()   # held here, their claim not answered yet
        self._unreleased: set[str] = set()
        self._answers: dict[str, asyncio.Future[bool]] = {}
        HELD_IDS.set_function(lambda: len(self._local))  # read at scrape time, not per request

    @property
    def held(self) -> int:
        return len(self._local)

    def held_keys(self) -> list[str]:
        """The ids this process holds in Redis (a claim still being decided is not one of them)."""
        return [self._c.key("rid", t, r) for t, r in self._local.pairs() if (t, r) not in self._claiming]

    def unreleased(self) -> list[str]:
        return list(self._unreleased)

    def released(self, key: str) -> None:
        self._unreleased.discard(key)

    async def claim(self, tenant: str, request_id: str) -> bool:
        if not self._local.take(tenant, request_id):  # before any await: a concurrent claim here sees it
            return False
        key = self._c.key("rid", tenant, request_id)
        self._unreleased.discard(key)
        ttl_ms = int(self.ttl * 1000)
        self._claiming.add((tenant, request_id))
        try:
            owner = await self._c.pipe.call_keyed(_CLAIM, key, self._c.router_id, ttl_ms)
            # Another router's id: take it over if that router died holding it, or if it is alive but
            # no longer holds it (its release was lost: e.g. a Redis restart replayed the claim from
            # its AOF but not the delete that followed); else it really is in flight there.
            if owner and (await self._c.owner_is_gone(owner) or not await self._owner_holds(owner, tenant, request_id)):
                owner = await self._c.pipe.call("EVAL", _TAKE_OVER, 1, key, self._c.router_id, ttl_ms, owner)
        except REDIS_ERRORS as exc:
            self._c.warn("claim", exc)  # this process's view only; the heartbeat claims it when Redis is back
            return True
        except asyncio.CancelledError:
            self._local.drop(tenant, request_id)
            raise
        finally:
            self._claiming.discard((tenant, request_id))
        if not owner:
            return True
        self._local.drop(tenant, request_id)
        return False

    async def release(self, tenant: str, request_id: str, wait: bool = True) -> None:
        """Local at once; the Redis key goes in the next pipeline and, with `wait`, is awaited
        (bounded), so a client holding its `done` may reuse the id on any router. Without `wait`
        an id reused before the delete lands is taken over (`claim` asks this router, which no
        longer holds it). A failed delete is retried by the heartbeat (else the key expires); a
        caller cancelled meanwhile does not stop it."""
        if not self._local.drop(tenant, request_id):
            return
        key = self._c.key("rid", tenant, request_id)
        fut = self._c.pipe.submit_keyed(_RELEASE, key, self._c.router_id)
        fut.add_done_callback(functools.partial(self._release_done, key))
        if wait:
            with contextlib.suppress(*REDIS_ERRORS):
                await asyncio.shield(fut)

    def _release_done(self, key: str, fut: asyncio.Future[Any]) -> None:
        if fut.cancelled() or fut.exception() is not None:
            exc = fut.exception() if not fut.cancelled() else asyncio.CancelledError()
            self._c.warn("release", exc or RedisError("release"))
            self._unreleased.add(key)

    async def release_all(self) -> None:
        """At close: free every id still held (bounded), so another router may take them at once."""
        keys = self.held_keys()
        self._local.clear()
        with contextlib.suppress(*REDIS_ERRORS):
            await self._c.release_keys(keys)

    def on_cancel(self, tenant: str, request_id: str, callback: Callable[[], None]) -> None:
        self._local.on_cancel(tenant, request_id, callback)

    def _cancel_local(self, tenant: str, request_id: str) -> bool:
        return self._local.cancel_held(tenant, request_id)

    async def _owner_holds(self, owner: bytes | str, tenant: str, request_id: str) -> bool:
        """Does the live router `owner` hold this id? Asked on its channel; no answer within the
        cancel timeout (or Redis failing) reads as yes: an id is never run twice on a guess."""
        owner = owner.decode() if isinstance(owner, bytes) else owner
        if owner == self._c.router_id:
            return self._local.holds(tenant, request_id)
        try:
            held = await self._question(owner, "holds", tenant, request_id)
        except (asyncio.TimeoutError, *REDIS_ERRORS):
            return True
        if held is None:
            return False        # nobody listens there: it died (owner_is_gone raced its exit)
        if not held:
            STALE_IDS.inc()
            log.info("cluster_stale_request_id", owner=owner, request_id=request_id)
        return held

    def remote_holds(self, message: dict[str, Any]) -> None:
        """Another router asks whether we hold an id it found claimed by us (answered from the
        local view; the answer goes out in the next pipeline)."""
        self._reply(message, "held", self._local.holds, "holds_reply")

    async def cancel(self, tenant: str, request_id: str) -> bool:
        """True: cancelled (here, or by the router holding it); False: not in flight for this
        tenant (no owner, or an owner that is gone). When that cannot be known — Redis
        unreachable, or an owner that does not answer in time — the Cancel is refused as
        retryable (REDIS_UNAVAILABLE, CANCEL_NOT_CONFIRMED) rather than answered "not in flight"
        for a request that may still be running."""
        # An id whose claim is still being decided here: this request is told (if it wins the
        # claim it stops at once), and the router that may be running the id is asked as well.
        tentative = (tenant, request_id) in self._claiming
        if self._cancel_local(tenant, request_id) and not tentative:
            return True
        try:
            owner = await self._c.pipe.call("GET", self._c.key("rid", tenant, request_id))
        except REDIS_ERRORS as exc:
            self._c.warn("cancel", exc)
            raise Reason.REDIS_UNAVAILABLE.error("the Cancel cannot reach the other router processes "
                                                 "(Redis unreachable)") from None
        if owner is None:
            return tentative
        owner = owner.decode() if isinstance(owner, bytes) else str(owner)
        if owner == self._c.router_id:  # ours: the claim just landed, or it ended meanwhile
            return tentative
        return await self._ask(owner, tenant, request_id) or tentative

    async def _ask(self, owner: str, tenant: str, request_id: str) -> bool:
        try:
            cancelled = await self._question(owner, "cancel", tenant, request_id)
        except asyncio.TimeoutError:
            REMOTE_CANCELS.labels("sent", "timeout").inc()
            log.warning("cluster_cancel_timeout", owner=owner, request_id=request_id)
            raise Reason.CANCEL_NOT_CONFIRMED.error(
                f"the router holding the request did not answer within {self.cancel_timeout:g} s") from None
        except REDIS_ERRORS as exc:
            self._c.warn("cancel", exc)
            raise Reason.REDIS_UNAVAILABLE.error("the Cancel cannot reach the router holding the request "
                                                 "(Redis unreachable)") from None
        if cancelled is None:  # the owner is gone: its id expires with its heartbeat
            REMOTE_CANCELS.labels("sent", "no_owner").inc()
            return False
        REMOTE_CANCELS.labels("sent", "cancelled" if cancelled else "not_found").inc()
        return cancelled

    def remote_cancel(self, message: dict[str, Any]) -> None:
        """Another router asks us to cancel a request we hold; the answer goes to its channel in the
        next pipeline (an answer lost to Redis reads as False there, after its timeout)."""
        cancelled = self._reply(message, "cancelled", self._cancel_local, "cancel_reply")
        if cancelled is not None:
            REMOTE_CANCELS.labels("received", "cancelled" if cancelled else "not_found").inc()

    async def _question(self, owner: str, op: str, tenant: str, request_id: str) -> bool | None:
        """Ask the router `owner` about one of its ids on its channel (`op`: "cancel" or "holds"):
        its yes or no, or None when nobody listens there. Raises TimeoutError after the cancel
        timeout, and Redis errors."""
        nonce = secrets.token_hex(8)
        answer: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        self._answers[nonce] = answer
        try:
            receivers = await self._c.publish(owner, {"op": op, "tenant": tenant, "request_id": request_id,
                                                      "reply_to": self._c.router_id, "nonce": nonce})
            if receivers == 0:
                return None
            return await asyncio.wait_for(answer, self.cancel_timeout)
        finally:
            self._answers.pop(nonce, None)

    def _reply(self, message: dict[str, Any], op: str, decide: Callable[[str, str], bool],
               what: str) -> bool | None:
        """Answer another router's question: ``decide(tenant, request_id)`` goes to its channel as
        ``{"op": op, op: answer}`` in the next pipeline; None (and a log line) for a bad message."""
        try:
            value = decide(str(message["tenant"]), str(message["request_id"]))
            reply = json.dumps({"op": op, "nonce": str(message["nonce"]), op: value})
            channel = self._c.channel(str(message["reply_to"]))
        except (KeyError, TypeError) as exc:
            log.warning("cluster_bad_message", error=repr(exc))
            return None
        self._c.pipe.submit("PUBLISH", channel, reply).add_done_callback(self._c.report(what))
        return value

    def answer(self, message: dict[str, Any]) -> None:
        """The reply to one of our questions: ``{"op": "cancelled" | "held", <op>: yes or no}``."""
        answer = self._answers.get(str(message.get("nonce")))
        if answer is not None and not answer.done():
            answer.set_result(bool(message.get(str(message.get("op")))))


class RedisSessionAffinity:
    """`ports.SessionAffinity` across router processes, with a local LRU as cache and fallback."""

    def __init__(self, cluster: RedisCluster, ttl: float) -> None:
        self._c = cluster
        self.ttl = ttl
        self._local = LocalSessionAffinity()

    def _key(self, tenant: str, session_id: str) -> str:
        if len(session_id) > _SESSION_KEY_MAX:
            session_id = "h:" + hashlib.blake2b(session_id.encode(), digest_size=16).hexdigest()
        return self._c.key("sess", tenant, session_id)

    async def get(self, tenant: str, session_id: str) -> str:
        try:
            value = await self._c.pipe.call("GETEX", self._key(tenant, session_id), "PX", int(self.ttl * 1000))
        except REDIS_ERRORS as exc:
            self._c.warn("session", exc)
            return await self._local.get(tenant, session_id)
        address = value.decode() if isinstance(value, bytes) else (value or "")
        if address:
            await self._local.set(tenant, session_id, address)
        return address

    async def set(self, tenant: str, session_id: str, address: str) -> None:
        await self._local.set(tenant, session_id, address)
        fut = self._c.pipe.submit("SET", self._key(tenant, session_id), address, "PX", int(self.ttl * 1000))
        fut.add_done_callback(self._c.report("session"))
