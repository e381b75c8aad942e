"""bench/bare_inference.py's Ticker: it shares the router's CPU in bench_relay, so while no stream
waits it must not tick (device run 1 found it spinning flat out at --bare-step-ms 0)."""

from __future__ import annotations

import asyncio
import pathlib
import sys

REPO = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "bench"))

from bare_inference import Ticker  # noqa: E402


async def test_the_ticker_is_still_while_nobody_waits_and_fires_for_a_waiter() -> None:
    ticker = Ticker(0.0)
    ticks = 0
    original = ticker.tick
    runner = asyncio.create_task(ticker.run())
    try:
        for _ in range(200):                 # 200 loop turns with nobody waiting: no tick
            await asyncio.sleep(0)
        assert ticker.tick is original and not original.done()
        for _ in range(5):                   # each waiter gets a tick, and a fresh one is armed
            fired = ticker.next()
            await asyncio.wait_for(fired, 1.0)
            ticks += 1
            assert ticker.tick is not fired
        armed = ticker.tick
        for _ in range(200):
            await asyncio.sleep(0)
        assert ticker.tick is armed and not armed.done() and ticks == 5
    finally:
        runner.cancel()
