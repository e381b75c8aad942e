"""Redis time of the admission scripts (router_svc/queue_lua.py) per call, against a trivial script
measured in the same run on the same redis-server.

Starts its own redis-server (unix socket, no persistence), runs each script `--calls` times one
call at a time with redis-py, and reads Redis's own accounting (`INFO commandstats`: the microseconds
Redis spent in EVALSHA, and in the commands the scripts called):

  trivial          `return 1` with the same keys and arguments (the floor of a script call)
  prelude          the prelude every admission script starts with (its time, the class list
                   parsed, its local functions defined), then `return 1`
  enqueue+settle   one request through the fast path: ENQUEUE (granted at once), then its SETTLE;
                   per request, with the commands the scripts ran and their own share
  enqueue+settle x16  the same for 16 requests to a call (the router's batchers under load), per request

    python bench/bench_lua_cost.py [--calls 3000] [--cpu 1] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
from typing import Any

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

import redis
from bench_admission_cost import RedisServer

from router_svc import queue_lua

CLASSES = "interactive,0.0,4096;standard,0.1,4096;batch,0.05,4096"
META = "tq:{bench}:meta"
HEAD: list[Any] = [CLASSES, "256:0:50", "bench-router", 15000]           # ARGV 1-4 of every admission script
# Redis's own accounting of the commands the bench sends besides the scripts (config|resetstat and the like)
NOT_SCRIPTED = ("cmdstat_evalsha", "cmdstat_info", "cmdstat_config", "cmdstat_script", "cmdstat_flushall")


def _redis_time(r: redis.Redis, calls: int, fn: Any) -> dict[str, float]:
    """Per call of fn: Redis's microseconds in EVALSHA, in the commands the scripts ran, and those commands."""
    fn(-1)                     # loaded (redis-py's NOSCRIPT, then SCRIPT LOAD) before the count starts
    r.config_resetstat()
    for i in range(calls):
        fn(i)
    stats = r.info("commandstats")
    inner = {k: v for k, v in stats.items() if not k.startswith(NOT_SCRIPTED)}
    return {"script_us": stats["cmdstat_evalsha"]["usec"] / calls,
            "commands_us": sum(v["usec"] for v in inner.values()) / calls,
            "commands": sum(v["calls"] for v in inner.values()) / calls}


def measure(r: redis.Redis, calls: int) -> dict[str, dict[str, float]]:
    trivial = r.register_script("#!lua\nreturn 1")
    prelude = r.register_script("#!lua\n" + queue_lua.PRELUDE + "\nreturn 1")
    enqueue, settle = r.register_script(queue_lua.ENQUEUE), r.register_script(queue_lua.SETTLE)

    seq = iter(range(1 << 60))

    def requests(n: int) -> None:
        """n requests in one ENQUEUE call, then their settles in one SETTLE call (as the router's
        batchers send what arrives in one loop turn)."""
        members = [f"bench:{i}~n{i}" for i in (next(seq) for _ in range(n))]
        # per request: class standard, 500 estimated tokens, no deadline, its nonce, no tenant limits, weight 1
        entries = [a for m in members for a in (m, "standard", 500, 0, m[-6:], 1_000_000, 0, 0, 1.0, 15000)]
        reply = enqueue(keys=[META], args=[*HEAD, n, *entries])
        if any(reply[3 * k] != 1 for k in range(n)):
            raise SystemExit(f"ENQUEUE did not grant at once: {reply!r}")
        settles = [a for k, m in enumerate(members) for a in (m, reply[3 * k + 1], 400, 0, 1.0)]
        settle(keys=[META], args=[*HEAD, n, *settles])

    def one_request(_: int) -> None:
        requests(1)

    r.flushall()
    for i in range(50):                # warm-up: scripts loaded, lease statistics past their first samples
        one_request(i)
    return {"trivial": _redis_time(r, calls, lambda i: trivial(keys=[META], args=[*HEAD, 0])),
            "prelude": _redis_time(r, calls, lambda i: prelude(keys=[META], args=[*HEAD, 0])),
            "enqueue+settle": _redis_time(r, calls, one_request),
            # per request, 16 to a call: the prelude and the dispatch paid once per call
            "enqueue+settle x16": _per_request(_redis_time(r, max(1, calls // 16), lambda i: requests(16)), 16)}


def _per_request(v: dict[str, float], n: int) -> dict[str, float]:
    return {k: x / n for k, x in v.items()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--calls", type=int, default=3000)
    p.add_argument("--cpu", type=int, default=-1, help="pin redis-server to this CPU")
    p.add_argument("--json", default="")
    args = p.parse_args(argv)
    server = RedisServer("no", "everysec", args.cpu if args.cpu >= 0 else None)   # no persistence
    try:
        results = measure(server.client, args.calls)
        version = server.version
    finally:
        server.close()
    floor = results["trivial"]["script_us"]
    print(f"Redis {version}, {args.calls} calls each, one at a time; microseconds of Redis time per call")
    print(f"{'what':<16} {'script us':>10} {'x trivial':>10} {'commands':>9} {'their us':>9} {'Lua alone us':>13}")
    for name, v in results.items():
        print(f"{name:<16} {v['script_us']:10.1f} {v['script_us'] / floor:10.1f} {v['commands']:9.1f} "
              f"{v['commands_us']:9.1f} {v['script_us'] - v['commands_us']:13.1f}")
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps({"redis": version, "calls": args.calls, **results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
