"""A chat-multiturn-like conversation (64-character system prompt, 48-character user turns, 80-character
replies, 4 turns, 60 conversations) through the router's encoder parts one by one, with the session's
prefix cache: the special-text scan, the ChatML render, the prefix plan, the suffix's encode and the join
(measurement only; docs/benchmarks.md, seventh session). Medians in µs.
    taskset -c 1 python docs/relay/2026-12-06g/cpu/chat_encode_parts.py [GAP_S]   # sleep GAP_S before each turn
"""
import pathlib
import random
import statistics
import string
import sys
import tempfile
import time

from router_svc.local_tokenize import CHAT_CACHE_TOKENS, template_of
from services.tokenization.encoder import Encoder, EncoderLimits
from services.tokenization.loader import TokenizerFiles, load_tokenizer
from tokenrelay_tools.cli.byte_tokenizer import ensure_byte_tokenizer

tok = load_tokenizer(TokenizerFiles.discover(ensure_byte_tokenizer(pathlib.Path(tempfile.mkdtemp()))))
tpl = template_of(tok, "")
assert tpl is not None
enc = Encoder(tok, tpl, EncoderLimits(max_input_tokens=8192, inline_bytes=8192), workers=1,
              chat_cache_tokens=CHAT_CACHE_TOKENS)
assert enc.chat_cache is not None
rnd = random.Random(1)


def words(n: int) -> str:
    return "".join(rnd.choice(string.ascii_lowercase + "    ") for _ in range(n))


gap = float(sys.argv[1]) if len(sys.argv) > 1 else 0.0
parts: dict[str, list[float]] = {k: [] for k in ("scan", "render", "plan", "encode", "join", "all")}
system = words(64)
for conv in range(60):
    msgs = [{"role": "system", "content": system}]
    for _turn in range(4):
        msgs.append({"role": "user", "content": words(48)})
        if gap:
            time.sleep(gap)
        t0 = time.perf_counter()
        enc.special_text.found_in_chat(msgs)
        t1 = time.perf_counter()
        text = tpl.render(msgs, True)
        t2 = time.perf_counter()
        plan = enc.chat_cache.plan(f"s{conv}", text)
        t3 = time.perf_counter()
        encoding = tok.tokenizer.encode(plan.suffix, add_special_tokens=False)
        t4 = time.perf_counter()
        enc.chat_cache.complete(plan, encoding)
        t5 = time.perf_counter()
        for k, v in zip(parts, (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4, t5 - t0), strict=False):
            parts[k].append(v * 1e6)
        msgs.append({"role": "assistant", "content": words(80)})
print(f"gap {gap} s: " + "  ".join(f"{k} {statistics.median(v):.0f}" for k, v in parts.items()))
