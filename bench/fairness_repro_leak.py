"""Reproduction: a lease granted while its queued request is being cancelled is never settled.

Status: reproduced against HEAD 2d66dd9's router_svc (`--unit` exits 1); the working tree's
admission.py / pipeline.py (another worker's change, 13:22 UTC 2026-12-01) fix it (`--unit` exits 0).
Kept as a regression check; docs/admission-fairness-bench.md has the story.

Found by bench_fairness.py (after a phase's requests were cut, the pool kept leases that its router
went on heartbeating for ever). Per round, through a real mesh (fairness_mesh.Mesh: Redis, the byte
tokenizer, one sim engine of batch ``--batch``, one router): ``--batch`` long requests fill the pool,
``--queued`` more wait in the queue, then every call is cancelled at once by its client. The
holders' settlements grant queued requests at the same moment those are being cancelled. One
second later the pool should hold nothing; a lease still there (state `l`, expiry moving: its
router heartbeats it) is leaked capacity, for as long as that router runs.

    python bench/fairness_repro_leak.py --unit        # deterministic, no processes: the mechanism
    python bench/fairness_repro_leak.py --rounds 10   # through a mesh (timing-dependent)

What bench_fairness.py's router log showed when it leaked: `GeneratorExit` raised at
`pipeline.py`'s `yield Accepted(...)` in `_queued` (a position update), in a different Context
(the generator closed later by its finalizer, not by the handler's own cancellation).

Cause (router_svc/admission.py, `Admitting.abandon`, with pipeline.py `_queued`): a queued request's
generator is left suspended at `yield Accepted(...)` (a position update) when its client goes away;
a grant for it arrives before the generator is closed (`Book.granted` sets `waiter.lease` and puts
the Lease in `Book.leases`); then the close raises GeneratorExit at that yield, `_queued`'s
`except BaseException` calls `abandon()`, which does nothing because `self.grant` is no longer
None (it reads `waiter.lease`), and re-raises. The settle in `_generate`'s try/finally is never
reached; the Lease stays in `Book.leases` and the heartbeat keeps it alive. The same holds for a
CancelledError delivered to the handler after a grant notice set the waiter but before it resumed.
(`_withdraw` already settles a raced-in `waiter.lease` at zero; `abandon` never calls it then.)
"""

from __future__ import annotations

import argparse
import asyncio
import pathlib
import shutil
import sys
import tempfile
import time
from typing import Any

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

from fairness_load import api_key
from fairness_mesh import Mesh


async def one_round(address: str, holders: int, queued: int, gap: float) -> None:
    from services.channels import open_channel
    from services.proto.tokenrelay.v1 import common_pb2, inference_pb2, inference_pb2_grpc

    md = (("authorization", f"Bearer {api_key('noisy')}"),)
    async with open_channel(address) as ch:
        stub = inference_pb2_grpc.InferenceStub(ch)

        def call(n: int) -> Any:
            return stub.Generate(inference_pb2.GenerateRequest(prompt="x" * 16, sampling=common_pb2.SamplingParams(
                max_tokens=n, ignore_eos=True)), metadata=md, timeout=60)
        held = [call(4000) for _ in range(holders)]
        for c in held:                        # each holds a slot once its first token came
            while (await c.read()).WhichOneof("event") != "delta":
                pass
        waiting = [call(8) for _ in range(queued)]
        positions = [(await c.read()).accepted.queue_position for c in waiting]
        assert sum(pos > 0 for pos in positions) >= queued // 2, positions   # really queued
        for c in held:                        # the holders' clients go away: their settlements grant
            c.cancel()                        # queued requests...
        await asyncio.sleep(gap)
        for c in waiting:                     # ...whose clients go away `gap` seconds later
            c.cancel()
        await asyncio.sleep(0.05)


async def unit() -> bool:
    """The mechanism without processes: a grant lands on a queued request, then it is abandoned."""
    from router_svc.admission import Admission, AdmissionSettings, Admitting
    from router_svc.admission_book import Waiter
    from router_svc.ports import AdmitRequest

    adm = Admission(AdmissionSettings(redis_url="unix:///nonexistent/redis.sock"), "router0")
    waiter = Waiter("t:req1", AdmitRequest("t", "req1", 2, 100, 0.0, 8, 8), "standard", "nonce1")
    adm.book.waiting[waiter.member] = waiter
    admitting = Admitting(adm, waiter, None, 3)     # queued at position 3, as pipeline._queued holds it
    adm.book.notice(waiter.member, "42", "grant")   # its grant arrives (a settlement's dispatch)...
    await admitting.abandon()                       # ...before the client's going away closes it
    leaked = waiter.member in adm.book.leases
    print(f"after abandon(): lease held by the Book: {leaked}; abandon's `self.grant`: {admitting.grant}")
    await adm.book.close()
    await adm.redis.aclose()
    return leaked


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--queued", type=int, default=16)
    p.add_argument("--unit", action="store_true", help="the deterministic check of the mechanism only")
    args = p.parse_args()
    if args.unit:
        found = asyncio.run(unit())
        print("BUG: the lease is never settled (heartbeated for ever)" if found else "not reproduced")
        return 1 if found else 0
    ns = argparse.Namespace(cpu_list="", routers=1, engines=1, profile="h200-llama8b-fp8", batch=args.batch,
                            time_scale=4.0, engine_arg=[], router_arg=[], **{f"{r}_cpus": "" for r in
                                                                          ("router", "redis", "tokenizer",
                                                                           "engine", "client")})
    work = pathlib.Path(tempfile.mkdtemp(prefix="fairness-leak-"))
    mesh = Mesh(ns, work, [{"name": "noisy", "max_in_flight": 1000, "max_queued": 1000}])
    leaked = 0
    try:
        time.sleep(2.0)                       # the router's first load report of the engine
        for i in range(args.rounds):
            gap = (0.0, 0.001, 0.002, 0.004, 0.008)[i % 5]
            asyncio.run(one_round(mesh.routers[0], args.batch, args.queued, gap))
            time.sleep(1.0)
            state = mesh.pool_state()
            print(f"round {i} (gap {gap * 1000:g} ms): pool after every client cancelled + 1 s: {state}", flush=True)
            leaked = state["in_flight"]
            if leaked >= args.batch:
                break
    finally:
        mesh.stop()
        shutil.rmtree(work, ignore_errors=True)
    print(f"leases leaked: {leaked}" + ("  <- BUG: capacity held for ever" if leaked else " (not reproduced)"))
    return 1 if leaked else 0


if __name__ == "__main__":
    sys.exit(main())
