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
  library: ...     the same two through the function library the routers call (`queue_lua.LIBRARY`,
                   FCALL: the shared functions defined once at FUNCTION LOAD, not on every call)

`--gap-ms N` waits N ms before each call: Redis then runs code that has not run for that long, as
at light load (on a shared host, much slower than back to back).

    python bench/bench_lua_cost.py [--calls 3000] [--rounds 1] [--cpu 1] [--gap-ms 0] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys
import time
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
NOT_SCRIPTED = ("cmdstat_evalsha", "cmdstat_fcall", "cmdstat_info", "cmdstat_config", "cmdstat_script",
                "cmdstat_function", "cmdstat_flushall")
SCRIPTED = ("cmdstat_evalsha", "cmdstat_fcall")


def _redis_time(r: redis.Redis, calls: int, fn: Any, gap: float = 0.0) -> dict[str, float]:
    """Per call of fn: Redis's microseconds in EVALSHA or FCALL, in the commands the scripts ran, and
    those commands."""
    fn(-1)                     # loaded (redis-py's NOSCRIPT, then SCRIPT LOAD) before the count starts
    r.config_resetstat()
    for i in range(calls):
        if gap:
            time.sleep(gap)
        fn(i)
    stats = r.info("commandstats")
    inner = {k: v for k, v in stats.items() if not k.startswith(NOT_SCRIPTED)}
    return {"script_us": sum(stats[k]["usec"] for k in SCRIPTED if k in stats) / calls,
            "commands_us": sum(v["usec"] for v in inner.values()) / calls,
            "commands": sum(v["calls"] for v in inner.values()) / calls}


def measure(r: redis.Redis, calls: int, gap: float = 0.0, rounds: int = 1) -> dict[str, dict[str, float]]:
    trivial = r.register_script("#!lua\nreturn 1")
    prelude = r.register_script("#!lua\n" + queue_lua.PRELUDE + "\nreturn 1")
    scripts = r.register_script(queue_lua.ENQUEUE), r.register_script(queue_lua.SETTLE)
    r.function_load(queue_lua.LIBRARY, replace=True)
    names = queue_lua.FUNCTIONS
    library = (lambda keys, args: r.fcall(names["ENQUEUE"], len(keys), *keys, *args),
               lambda keys, args: r.fcall(names["SETTLE"], len(keys), *keys, *args))
    seq = iter(range(1 << 60))

    def requests(n: int, calls: tuple[Any, Any] = scripts) -> None:
        """n requests in one ENQUEUE call, then their settles in one SETTLE call (as the router's
        batchers send what arrives in one loop turn), through `calls` (ENQUEUE, SETTLE)."""
        enqueue, settle = calls
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

    def through(calls: tuple[Any, Any], n: int) -> Any:
        return lambda _: requests(n, calls)

    r.flushall()
    for i in range(50):                # warm-up: scripts loaded, lease statistics past their first samples
        one_request(i)
    batches = max(1, calls // 16)
    rows: dict[str, Any] = {
        "trivial": lambda: _redis_time(r, calls, lambda i: trivial(keys=[META], args=[*HEAD, 0]), gap),
        "prelude": lambda: _redis_time(r, calls, lambda i: prelude(keys=[META], args=[*HEAD, 0]), gap),
        "enqueue+settle": lambda: _redis_time(r, calls, through(scripts, 1), gap),
        # per request, 16 to a call: the prelude and the dispatch paid once per call
        "enqueue+settle x16": lambda: _per_request(_redis_time(r, batches, through(scripts, 16), gap), 16),
        "library: enqueue+settle": lambda: _redis_time(r, calls, through(library, 1), gap),
        "library: x16": lambda: _per_request(_redis_time(r, batches, through(library, 16), gap), 16)}
    # Every row once per round, the rounds one after another (interleaved: a host whose speed drifts
    # moves every row alike); each figure is the median of its rounds.
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in rows}
    for _ in range(rounds):
        for name, row in rows.items():
            runs[name].append(row())
    return {name: {k: statistics.median(run[k] for run in got) for k in got[0]} for name, got in runs.items()}


def _per_request(v: dict[str, float], n: int) -> dict[str, float]:
    return {k: x / n for k, x in v.items()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--calls", type=int, default=3000)
    p.add_argument("--cpu", type=int, default=-1, help="pin redis-server to this CPU")
    p.add_argument("--rounds", type=int, default=1, help="measure every row this many times, interleaved; "
                   "report each row's median")
    p.add_argument("--gap-ms", type=float, default=0.0, help="wait this long before each call (light load)")
    p.add_argument("--json", default="")
    args = p.parse_args(argv)
    server = RedisServer("no", "everysec", args.cpu if args.cpu >= 0 else None)   # no persistence
    try:
        results = measure(server.client, args.calls, args.gap_ms / 1000, args.rounds)
        version = server.version
    finally:
        server.close()
    floor = results["trivial"]["script_us"]
    print(f"Redis {version}, {args.calls} calls each, one at a time, {args.gap_ms:g} ms apart, median of "
          f"{args.rounds} interleaved round(s); microseconds of Redis time per call (per request for the "
          "two-script rows)")
    print(f"{'what':<23} {'script us':>10} {'x trivial':>10} {'commands':>9} {'their us':>9} {'Lua alone us':>13}")
    for name, v in results.items():
        print(f"{name:<23} {v['script_us']:10.1f} {v['script_us'] / floor:10.1f} {v['commands']:9.1f} "
              f"{v['commands_us']:9.1f} {v['script_us'] - v['commands_us']:13.1f}")
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps({"redis": version, "calls": args.calls, **results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
