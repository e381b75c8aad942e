"""What the chat prefetch takes off a turn's encode, by tokenizer: the suffix a chat-multiturn-like turn
encodes without it (the previous reply, ~80 tokens, then the new message, ~48 tokens, with ChatML's
markers) against with it (the new message only), `Tokenizer.encode` with offsets as the prefix cache calls
it, back to back and after 50 ms asleep (medians of 150, µs; measurement only, docs/benchmarks.md).
    taskset -c 1 python docs/relay/2026-12-06h/cpu/suffix_encode.py [TOKENIZER_JSON ...]
"""
import pathlib
import random
import statistics
import sys
import tempfile
import time

from tokenizers import Tokenizer

from tokenrelay_tools.cli.byte_tokenizer import ensure_byte_tokenizer

paths = sys.argv[1:] or [str(ensure_byte_tokenizer(pathlib.Path(tempfile.mkdtemp())) / "tokenizer.json")]
words = pathlib.Path("/work/shared/data/text/state-of-the-union.txt").read_text().split()
rnd = random.Random(1)


def text(n_words: int) -> str:
    start = rnd.randrange(len(words) - n_words)
    return " ".join(words[start:start + n_words])


turns = [(text(60), text(36)) for _ in range(150)]   # ~80 and ~48 tokens of English for a 50k BPE
for path in paths:
    tok = Tokenizer.from_file(path)
    for gap in (0.0, 0.05):
        res: dict[str, list[float]] = {"reply+message": [], "message": []}
        for reply, message in turns:
            tail = f"<|im_start|>user\n{message}<|im_end|>\n<|im_start|>assistant\n"
            for name, suffix in (("reply+message", f"<|im_start|>assistant\n{reply}<|im_end|>\n{tail}"),
                                 ("message", f"<|im_end|>\n{tail}")):
                if gap:
                    time.sleep(gap)
                t0 = time.perf_counter()
                _ = tok.encode(suffix, add_special_tokens=False).offsets
                res[name].append((time.perf_counter() - t0) * 1e6)
        print(f"{pathlib.Path(path).parent.name:12s} gap {gap:4.2f}: " + "  ".join(
            f"{k} {statistics.median(v):6.1f}" for k, v in res.items()))
