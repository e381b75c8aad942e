"""An encode handed to a worker thread while the event loop keeps working, against the encode inline
(measurement only; docs/benchmarks.md, eleventh session). The library releases the GIL inside its
encode, but the call needs the GIL to start and to return, and a loop busy in Python holds it.
    python docs/relay/2026-12-07b/cpu/gilhand.py TOKENIZER_JSON spin|nospin uvloop|asyncio
"""

import asyncio
import queue
import sys
import threading
import time

import uvloop
from tokenizers import Tokenizer

tok = Tokenizer.from_file(sys.argv[1])
TEXT = ("<|im_start|>user\nCan you explain how the admission queue decides which tenant goes next?"
        "<|im_end|>\n<|im_start|>assistant\n")
jobs: queue.SimpleQueue = queue.SimpleQueue()


def worker() -> None:
    while True:
        fut, loop, text = jobs.get()
        ids = tok.encode(text, add_special_tokens=False).ids
        loop.call_soon_threadsafe(fut.set_result, ids)


async def spin() -> None:
    while True:
        await asyncio.sleep(0)


def us(xs: list[float], p: float = 0.5) -> float:
    return sorted(xs)[int(p * len(xs))] * 1e6


async def main() -> None:
    loop = asyncio.get_running_loop()
    spinner = asyncio.ensure_future(spin()) if sys.argv[2] == "spin" else None
    inline: list[float] = []
    threaded: list[float] = []
    for _ in range(300):
        await asyncio.sleep(0.02)
        t0 = time.perf_counter()
        tok.encode(TEXT, add_special_tokens=False)
        inline.append(time.perf_counter() - t0)
        await asyncio.sleep(0.02)
        t0 = time.perf_counter()
        fut = loop.create_future()
        jobs.put((fut, loop, TEXT))
        while time.perf_counter() - t0 < 0.00015:    # the loop's own work meanwhile: 150 us of Python
            pass
        await fut
        threaded.append(time.perf_counter() - t0)
    print(f"{sys.argv[2]} {sys.argv[3]}: inline encode {us(inline):.0f} us (median); handed to a thread with "
          f"150 us of loop work meanwhile {us(threaded):.0f} us (median), {us(threaded, 0.9):.0f} (p90)")
    if spinner is not None:
        spinner.cancel()


threading.Thread(target=worker, daemon=True).start()
if __name__ == "__main__":
    if sys.argv[3] == "asyncio":
        asyncio.run(main())
    else:
        uvloop.run(main())

