"""`tokenrelay split`: show or change the traffic split between engine pools of running routers.

The split lives in Redis (router_svc/pools.py: the hash ``tq:{pool}:split``, a version, a pub/sub
notice); every router of the admission pool serves a change within a second, without a restart.

    tokenrelay split show
    tokenrelay split set default=90 canary=10 [--shadow canary:0.05 | --shadow off] [--epoch E]
    tokenrelay split set --shadow mirror:1          (the shadow alone: the weights stay)
    tokenrelay split set default=100                (instant rollback)
    tokenrelay split reset                          (back to the routers' --traffic-split flags)

Redis: --redis-url, else $TOKENRELAY_REDIS_URL, else the local mesh's (`tokenrelay up`'s state file).
"""

from __future__ import annotations

import argparse
import getpass
import json
import pathlib
import socket
import sys
from typing import Any

from tokenrelay_tools import env

from .launcher import DEFAULT_STATE, read_state


def add_split_parser(sub: Any) -> None:
    sp = sub.add_parser("split", help="show or change the traffic split between engine pools (all routers, "
                                      "at runtime)")
    actions = sp.add_subparsers(dest="action", required=True)

    def common(p: argparse.ArgumentParser) -> None:
        p.add_argument("--redis-url", default="", help="the routers' Redis (default: $TOKENRELAY_REDIS_URL or "
                                                       "the local mesh's)")
        p.add_argument("--pool", default="default", help="the routers' --pool (their Redis hash tag; default: "
                                                         "default)")
        p.add_argument("--state-file", default=str(DEFAULT_STATE))

    common(actions.add_parser("show", help="print the split stored in Redis"))
    common(actions.add_parser("reset", help="remove the stored split: routers serve their --traffic-split"))
    put = actions.add_parser("set", help="store a split every router serves within a second")
    put.add_argument("weights", nargs="*", metavar="POOL=WEIGHT",
                     help="the pools and their relative weights, e.g. default=90 canary=10 (none: unchanged)")
    put.add_argument("--shadow", default=None, metavar="POOL:FRACTION",
                     help="mirror this share (0 to 1) of requests to POOL, answers recorded, never returned; "
                          "'off' stops it (default: unchanged)")
    put.add_argument("--epoch", default="", help="the hash salt; a new one re-buckets every session")
    common(put)


def _shadow(text: str | None) -> tuple[str, float] | None:
    if text is None:
        return None
    if text in ("off", "none", ""):
        return ("", 0.0)
    pool, sep, fraction = text.rpartition(":")
    try:
        value = float(fraction)
    except ValueError:
        raise ValueError(f"--shadow {text!r}: expected POOL:FRACTION (e.g. canary:0.05) or off") from None
    if not sep or not pool:
        raise ValueError(f"--shadow {text!r}: expected POOL:FRACTION (e.g. canary:0.05) or off")
    return (pool, value) if value > 0 else ("", 0.0)


def _redis_url(args: argparse.Namespace) -> str:
    url = args.redis_url or env.redis_url()
    if url:
        return str(url)
    try:
        return str(read_state(pathlib.Path(args.state_file))["redis_url"])
    except (SystemExit, KeyError, OSError, ValueError):
        raise SystemExit("error: no Redis: pass --redis-url (or set TOKENRELAY_REDIS_URL, or start a mesh "
                         "with `tokenrelay up`)") from None


async def run_split(args: argparse.Namespace) -> int:
    from redis.exceptions import RedisError

    from router_svc.cluster_redis import open_redis
    from router_svc.pools import check_shadow, parse_weights, read_split, reset_split, write_split

    try:
        weights = parse_weights(args.weights) if getattr(args, "weights", None) else None
        shadow = _shadow(getattr(args, "shadow", None))
        if shadow is not None:
            check_shadow(*shadow)
        if args.action == "set" and weights is None and shadow is None:
            raise ValueError("split set needs POOL=WEIGHT pairs and/or --shadow")
    except ValueError as exc:
        print(f"tokenrelay split: error: {exc}", file=sys.stderr)
        return 2
    redis = open_redis(_redis_url(args), 2.0)
    try:
        if args.action == "set":
            who = f"{getpass.getuser()}@{socket.gethostname()}"
            version = await write_split(redis, args.pool, weights, epoch=args.epoch, shadow=shadow, who=who)
            print(f"[tokenrelay] split version {version} stored; routers of pool {args.pool!r} serve it within "
                  "a second", file=sys.stderr)
        elif args.action == "reset":
            await reset_split(redis, args.pool)
            print("[tokenrelay] split removed: routers serve their --traffic-split again", file=sys.stderr)
        stored = await read_split(redis, args.pool)
        print(json.dumps(stored or {"stored": "none (routers serve their --traffic-split flags)"}, sort_keys=True))
        return 0
    except (RedisError, OSError, ValueError) as exc:
        print(f"tokenrelay split: error: {exc}", file=sys.stderr)
        return 1
    finally:
        await redis.aclose()
