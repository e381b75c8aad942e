"""The prefix policy's decision cost in process, against live holds (router_svc/prefix_index.py,
"Holds"): `PrefixAware.choose` over `--replicas` replicas with KV events, prompts of one of 16 shared
256-token prefixes + 32 own tokens (as `bench_routing.py --decision-time`), with 0 live holds (the
baseline, measured in the same run) and with each of `--holds` live holds spread over the replicas.
Prints µs per decision (median of `--repeats` passes) and the ratio to the baseline, and the cost of
`hold` (a request's end).

    python bench/bench_placement_cost.py
    python bench/bench_placement_cost.py --holds 0,100,1000,10000 --decisions 5000
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from router_svc.placement import PrefixAware, PrefixWeights
from router_svc.ports import PlacementView, ReplicaSnapshot
from router_svc.prefix_index import PrefixIndex


def run(replicas: int, holds: int, decisions: int, repeats: int, seed: int = 0) -> tuple[float, float]:
    """(µs per choose, µs per hold) with `holds` live holds."""
    rng = random.Random(seed)
    clock = [0.0]
    index = PrefixIndex(32, clock=lambda: clock[0])
    addresses = [f"e{i}:1" for i in range(replicas)]
    for a in addresses:
        index.reset(a, events=True)
    prefixes = [[rng.randrange(4, 120) for _ in range(256)] for _ in range(16)]

    def prompt() -> list[int]:
        return [*rng.choice(prefixes), *(rng.randrange(4, 120) for _ in range(32))]

    for p in prefixes:
        index.placed(rng.choice(addresses), [*p, 1], "t")
    for i in range(holds):
        index.hold(addresses[i % replicas], prompt(), "t")
    policy = PrefixAware(index, PrefixWeights())
    snaps = [ReplicaSnapshot(a, max_active=64) for a in addresses]
    views = [PlacementView("t", prompt_tokens=len(p), prompt_ids=p, cache_salt="t")
             for p in (prompt() for _ in range(decisions))]
    passes = []
    for v in views:          # a pass not counted: warm the allocator and the caches
        policy.choose(snaps, v)
    for _ in range(repeats):
        t0 = time.perf_counter()
        for v in views:
            policy.choose(snaps, v)
        passes.append((time.perf_counter() - t0) / decisions * 1e6)
    ended = [prompt() for _ in range(decisions)]
    t0 = time.perf_counter()
    for p in ended:
        index.hold(addresses[0], p, "t")
    return statistics.median(passes), (time.perf_counter() - t0) / decisions * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--replicas", type=int, default=8)
    ap.add_argument("--holds", default="0,150,1000,10000", help="comma-separated; 0 (the baseline) is always run")
    ap.add_argument("--decisions", type=int, default=2000)
    ap.add_argument("--repeats", type=int, default=5)
    a = ap.parse_args()
    counts = sorted({0, *(int(x) for x in a.holds.split(",") if x)})
    base = None
    print(f"{'holds':>7}  {'choose µs':>9}  {'× no holds':>10}  {'hold() µs':>9}")
    for n in counts:
        choose, hold = run(a.replicas, n, a.decisions, a.repeats)
        base = choose if base is None else base
        print(f"{n:>7}  {choose:>9.1f}  {choose / base:>10.2f}  {hold:>9.1f}")


if __name__ == "__main__":
    main()
