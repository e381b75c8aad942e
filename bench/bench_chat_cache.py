"""Incremental chat tokenization: each turn of a conversation that resends the whole history,
encoded by the tokenizer's `Encoder` with its chat prefix cache (the key a session, or for a chat
without one the conversation's opening: `router_svc.cache_key.tokenize_cache_key`) against the same
turns encoded whole (no key), in the same run, on the same tokenizer files.

    python bench/bench_chat_cache.py [--tokenizer DIR] [--turns 12] [--conversations 50]

Without ``--tokenizer`` it builds the byte-level tokenizer of ``tokenrelay up --engine sim``.
Prints per-turn encode time p50 for both and their ratio, and checks the ids are the same.
"""

from __future__ import annotations

import argparse
import asyncio
import pathlib
import statistics
import sys
import tempfile
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

from router_svc.cache_key import tokenize_cache_key
from router_svc.local_tokenize import template_of
from services.tokenization.encoder import ChatInput, Encoder, EncoderLimits
from services.tokenization.loader import TokenizerFiles, load_tokenizer


def conversation(n: int, turns: int) -> list[list[tuple[str, str]]]:
    """The requests of one conversation: turn k resends the k-1 earlier exchanges and a new question."""
    history = [("system", f"You are assistant {n}. Answer in a few sentences, plainly.")]
    out = []
    for t in range(turns):
        history.append(("user", f"Question {t} of conversation {n}: how does paged attention handle "
                                 f"sequence {t * 7 + n}, and what does it cost?"))
        out.append(list(history))
        history.append(("assistant", "Blocks of keys and values are allocated on demand and shared by "
                                      f"prefix; turn {t} reuses {t * 3} blocks. " * 3))
    return out


async def run(args: argparse.Namespace) -> dict[str, float]:
    if args.tokenizer:
        path = pathlib.Path(args.tokenizer)
    else:
        from tokenrelay_tools.cli.byte_tokenizer import ensure_byte_tokenizer
        path = ensure_byte_tokenizer(pathlib.Path(tempfile.mkdtemp(prefix="bench-chat-cache-")))
    tok = load_tokenizer(TokenizerFiles.discover(path))
    template = template_of(tok, "")
    if template is None:
        raise SystemExit(f"{path}: no chat template")
    enc = Encoder(tok, template, EncoderLimits(max_input_tokens=1 << 20, inline_bytes=1 << 20), workers=1,
                  chat_cache_tokens=20_000_000)
    await enc.start()
    times: dict[str, list[float]] = {"whole": [], "cached": []}
    tokens = mismatches = 0
    try:
        for n in range(args.conversations):
            for messages in conversation(n, args.turns):
                msgs = [{"role": r, "content": c} for r, c in messages]
                key = tokenize_cache_key("bench", "", messages)
                t = time.perf_counter()
                (whole,) = await enc.tokenize([ChatInput(msgs, True, "")])
                times["whole"].append(time.perf_counter() - t)
                t = time.perf_counter()
                (cached,) = await enc.tokenize([ChatInput(msgs, True, key)])
                times["cached"].append(time.perf_counter() - t)
                tokens += len(whole)
                mismatches += list(whole) != list(cached)
        cache = enc.chat_cache
        hits = cache.hits if cache is not None else 0
    finally:
        await enc.close()
    w, c = statistics.median(times["whole"]), statistics.median(times["cached"])
    return {"requests": len(times["whole"]), "mean_tokens": tokens / len(times["whole"]), "whole_p50_ms": w * 1e3,
            "cached_p50_ms": c * 1e3, "ratio": c / w, "hits": hits, "mismatches": mismatches}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokenizer", default="", help="a directory with tokenizer.json (and a chat template)")
    p.add_argument("--turns", type=int, default=12, help="turns per conversation")
    p.add_argument("--conversations", type=int, default=50)
    r = asyncio.run(run(p.parse_args(argv)))
    print(f"{r['requests']} requests, {r['mean_tokens']:.0f} tokens each on average: encode p50 whole "
          f"{r['whole_p50_ms']:.3f} ms, from the cached prefix {r['cached_p50_ms']:.3f} ms (ratio {r['ratio']:.2f}); "
          f"cache hits {r['hits']}, ids differing {r['mismatches']}")
    return 1 if r["mismatches"] else 0


if __name__ == "__main__":
    sys.exit(main())
