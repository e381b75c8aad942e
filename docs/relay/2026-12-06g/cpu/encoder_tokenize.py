"""The router's whole inline encode call (`Encoder.tokenize`: validation, the span, the batcher's inline run,
the special-text scan, the ChatML render, the session's prefix cache, the encode, the limits) on a
chat-multiturn-like conversation (as chat_encode_parts.py), with the thread spinning, sleeping or back to
back before each call (measurement only; docs/benchmarks.md, seventh session). Median and p90 in µs.
    taskset -c 1 python docs/relay/2026-12-06g/cpu/encoder_tokenize.py spin 0.02  # or spin 0, sleep 0.02, ...
"""
import asyncio
import os
import pathlib
import random
import statistics
import string
import sys
import tempfile
import time

from router_svc.local_tokenize import CHAT_CACHE_TOKENS, template_of
from services.tokenization.encoder import ChatInput, Encoder, EncoderLimits
from services.tokenization.loader import TokenizerFiles, load_tokenizer
from tokenrelay_tools.cli.byte_tokenizer import ensure_byte_tokenizer

tok = load_tokenizer(TokenizerFiles.discover(ensure_byte_tokenizer(pathlib.Path(tempfile.mkdtemp()))))
enc = Encoder(tok, template_of(tok, ""), EncoderLimits(max_input_tokens=8192, inline_bytes=16384), workers=1,
              chat_cache_tokens=CHAT_CACHE_TOKENS)
rnd = random.Random(1)
mode, gap = sys.argv[1], float(sys.argv[2])


def words(n: int) -> str:
    return "".join(rnd.choice(string.ascii_lowercase + "    ") for _ in range(n))


async def main() -> None:
    await enc.start()
    xs: list[float] = []
    system = words(64)
    for conv in range(60):
        msgs = [("system", system)]
        for _turn in range(4):
            msgs.append(("user", words(48)))
            if mode == "spin":
                end = time.perf_counter() + gap
                while time.perf_counter() < end:
                    os.sched_yield()
            elif gap:
                await asyncio.sleep(gap)
            t0 = time.perf_counter()
            chat = [{"role": r, "content": c} for r, c in msgs]
            await enc.tokenize([ChatInput(chat, True, f"s{conv}", False)])
            xs.append((time.perf_counter() - t0) * 1e6)
            msgs.append(("assistant", words(80)))
    print(mode, gap, f"Encoder.tokenize p50 {statistics.median(xs):.0f} us p90 {sorted(xs)[int(.9 * len(xs))]:.0f}")
    await enc.close()

asyncio.run(main())
