"""The hit-rate ceiling of a trace: one infinite prefix cache over the prompts actually sent.

Block granularity is the engines' (32 tokens): a prompt's full blocks are keyed by chained hashes
(a block matches only with its whole prefix), and a prompt hits the leading run of its blocks the
cache already holds, except that its last token is always computed (a fully cached prompt still
recomputes its last block: the sim engine's rule, and vLLM's). `prompt_only` caches what was sent
as prompts (the issue's oracle); with `replies`, each request's reply tokens are cached after its
prompt, as an engine that keeps decoded blocks does, so a follow-up turn can also hit the block that
straddles the previous prompt's end and the reply. Prompts are taken in the order they were sent.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence


def block_keys(tokens: Sequence[int], tokens_per_block: int) -> list[int]:
    """Chained keys of the full blocks of `tokens` (Python's tuple hash: deterministic for ints)."""
    keys: list[int] = []
    parent = 0
    for start in range(0, len(tokens) - tokens_per_block + 1, tokens_per_block):
        parent = hash((parent, tuple(tokens[start:start + tokens_per_block])))
        keys.append(parent)
    return keys


class InfiniteCache:
    def __init__(self, tokens_per_block: int = 32) -> None:
        self.tpb = tokens_per_block
        self.blocks: set[int] = set()

    def lookup(self, prompt: Sequence[int]) -> int:
        """Prompt tokens this cache would serve (a multiple of the block size)."""
        limit = max(0, (len(prompt) - 1) // self.tpb)
        hit = 0
        for key in block_keys(prompt, self.tpb)[:limit]:
            if key not in self.blocks:
                break
            hit += 1
        return hit * self.tpb

    def insert(self, tokens: Sequence[int]) -> None:
        self.blocks.update(block_keys(tokens, self.tpb))


def hit_rate(requests: Iterable[tuple[Sequence[int], Sequence[int]]], tokens_per_block: int = 32,
             replies: bool = False) -> tuple[int, int]:
    """(cached, prompt) token totals of one infinite cache over (prompt, reply) pairs in send order."""
    cache = InfiniteCache(tokens_per_block)
    cached = total = 0
    for prompt, reply in requests:
        cached += cache.lookup(prompt)
        total += len(prompt)
        cache.insert([*prompt, *reply] if replies else prompt)
    return cached, total
