"""The one factory of the mesh's Redis clients: a single Redis (``redis://``, ``rediss://``, ``unix://``)
or, opt-in by the URL's scheme, a Redis Cluster (``redis+cluster://host:port``, ``rediss+cluster://``
for TLS: one seed node; the client discovers the others and routes each command to its key's slot).

Every key of an admission pool carries the pool's hash tag ``{pool}``, so each command, script
call and pipeline of one pool maps to one slot: a cluster spreads pools over its masters, not
one pool's keys. `router_svc.cluster_redis.open_redis` is this function (the engine's registration
imports it from here: a service imports no other service)."""

from __future__ import annotations

import socket
from collections.abc import Sequence
from typing import Any

import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

CLUSTER_SCHEMES = {"redis+cluster": "redis", "rediss+cluster": "rediss"}
# redis-py's cluster client fails a call beyond a node's connections at once (no blocking pool):
# its per-node limit is the blocking pool's size plus this headroom.
CLUSTER_HEADROOM = 64
RETRY_ON: tuple[type[Exception], ...] = (RedisConnectionError, RedisTimeoutError, ConnectionResetError)

RedisClient = aioredis.Redis | RedisCluster


def unix_socket_listening(path: object) -> bool:
    """Whether a server accepts connections on the unix socket ``path``. Its file existing is not
    enough: a server binds (the file appears) before it listens, and a connect in between is refused."""
    with socket.socket(socket.AF_UNIX) as s:
        try:
            s.connect(str(path))
        except OSError:
            return False
    return True


def is_cluster_url(url: str) -> bool:
    return url.split("://", 1)[0] in CLUSTER_SCHEMES


def plain_url(url: str) -> str:
    """The URL redis-py parses: ``redis+cluster://`` → ``redis://``, ``rediss+cluster://`` → ``rediss://``."""
    scheme, sep, rest = url.partition("://")
    return f"{CLUSTER_SCHEMES.get(scheme, scheme)}{sep}{rest}"


def open_redis(url: str, timeout: float, *, connect_timeout: float | None = None, max_connections: int | None = None,
               retry_on: Sequence[type[Exception]] | None = RETRY_ON, health_check_interval: float = 30,
               **options: Any) -> RedisClient:
    """A client with bounded timeouts (`timeout` per socket operation, `connect_timeout` to connect,
    default `timeout`) and, with `retry_on`, one retry on a fresh connection when a pooled one turns
    out dead (after a Redis restart), so no operation is lost to a stale socket (None: no retry).
    `max_connections`: a blocking pool of that many connections whose callers wait up to `timeout`
    for one (single Redis); in a cluster, per node and with `CLUSTER_HEADROOM` more, as a call beyond
    them fails at once there.
    ``options``: TLS files and password (`AdmissionSettings.redis_options`)."""
    common: dict[str, Any] = {"socket_timeout": timeout,
                              "socket_connect_timeout": timeout if connect_timeout is None else connect_timeout,
                              **options}
    if health_check_interval:
        common["health_check_interval"] = health_check_interval
    if retry_on is not None:
        common["retry"] = Retry(NoBackoff(), 1)
        common["retry_on_error"] = list(retry_on)
    if is_cluster_url(url):
        if max_connections is not None:
            common["max_connections"] = max_connections + CLUSTER_HEADROOM
        return RedisCluster.from_url(plain_url(url), **common)
    if max_connections is None:
        return aioredis.from_url(url, **common)
    pool = aioredis.BlockingConnectionPool.from_url(url, max_connections=max_connections, timeout=timeout, **common)
    return aioredis.Redis.from_pool(pool)
