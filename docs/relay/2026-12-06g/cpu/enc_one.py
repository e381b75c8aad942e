"""One chat turn's suffix (~170 characters with ChatML's markers, the byte-level tokenizer of `up --engine
sim`): Tokenizer.encode against encode_batch of one input, medians of 200, with the thread spinning,
sleeping or back to back between calls (measurement only; docs/benchmarks.md, seventh session).
    taskset -c 1 python docs/relay/2026-12-06g/cpu/enc_one.py spin 0.02   # or: sleep 0.02 | spin 0
"""
import os
import pathlib
import random
import statistics
import string
import sys
import tempfile
import time

from services.tokenization.loader import TokenizerFiles, load_tokenizer
from tokenrelay_tools.cli.byte_tokenizer import ensure_byte_tokenizer

d = ensure_byte_tokenizer(pathlib.Path(tempfile.mkdtemp()))
tok = load_tokenizer(TokenizerFiles.discover(d)).tokenizer
rnd = random.Random(1)
texts = ["<|im_end|>\n<|im_start|>user\n" + "".join(rnd.choice(string.ascii_lowercase + "    ") for _ in range(140))
         for _ in range(200)]
mode, gap = sys.argv[1], float(sys.argv[2])
fns = {"encode_batch": lambda t: tok.encode_batch([t], add_special_tokens=False)[0].offsets,
       "encode": lambda t: tok.encode(t, add_special_tokens=False).offsets}
res: dict[str, list[float]] = {k: [] for k in fns}
for t in texts:
    for k, f in fns.items():
        if mode == "spin":
            end = time.perf_counter() + gap
            while time.perf_counter() < end:
                os.sched_yield()
        elif gap:
            time.sleep(gap)
        t0 = time.perf_counter()
        f(t)
        res[k].append((time.perf_counter() - t0) * 1e6)
for k, v in res.items():
    print(f"{mode} {gap} {k:14s} p50 {statistics.median(v):7.1f} p90 {sorted(v)[int(.9 * len(v))]:7.1f} us")
