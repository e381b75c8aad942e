"""Unit tests of the simulated paged KV cache: prefix reuse, salts, LRU eviction, accounting."""

from __future__ import annotations

import pytest

from engine_svc.backends.sim_kv import KVCache, block_hash


def test_block_hash_chains_parent_salt_and_tokens() -> None:
    a = block_hash(None, [1, 2, 3, 4])
    assert a == block_hash(None, (1, 2, 3, 4))  # stable, content-defined
    assert a != block_hash(None, [1, 2, 3, 5])
    assert a != block_hash(None, [1, 2, 3, 4], salt="tenant-a")
    assert block_hash(a, [5, 6, 7, 8]) != block_hash(None, [5, 6, 7, 8])


def test_second_request_with_same_prefix_reuses_full_blocks() -> None:
    kv = KVCache(num_blocks=16, tokens_per_block=4)
    prompt = list(range(10))  # 2 full blocks + 2 tokens
    first = kv.try_allocate(prompt, total_tokens=14)
    assert first is not None and first.cached_tokens == 0
    assert kv.used_blocks == 4  # ceil(14 / 4)
    second = kv.try_allocate([*prompt, 99], total_tokens=15)
    assert second is not None
    assert second.cached_tokens == 8
    assert second.blocks[:2] == first.blocks[:2]
    # Shared blocks are counted once.
    assert kv.used_blocks == 4 + 2
    assert kv.hit_blocks == 2


def test_fully_cached_prompt_still_computes_its_last_block() -> None:
    kv = KVCache(num_blocks=16, tokens_per_block=4)
    prompt = list(range(8))  # exactly 2 full blocks
    a = kv.try_allocate(prompt, total_tokens=9)
    assert a is not None
    b = kv.try_allocate(prompt, total_tokens=9)
    assert b is not None and b.cached_tokens == 4


def test_salt_isolates_prefix_reuse() -> None:
    kv = KVCache(num_blocks=16, tokens_per_block=4)
    prompt = list(range(9))
    assert kv.try_allocate(prompt, 10, salt="a") is not None
    other = kv.try_allocate(prompt, 10, salt="b")
    assert other is not None and other.cached_tokens == 0
    same = kv.try_allocate(prompt, 10, salt="a")
    assert same is not None and same.cached_tokens == 8


def test_released_blocks_stay_cached_and_reuse_refreshes_recency() -> None:
    kv = KVCache(num_blocks=6, tokens_per_block=2)
    a = kv.try_allocate([1, 2, 3, 4, 5], total_tokens=6)  # 3 blocks, the 2 full ones hashed
    assert a is not None
    kv.release(a)
    assert kv.used_blocks == 0 and kv.cached_blocks == 2 and kv.available_blocks == 6
    b = kv.try_allocate([7, 8, 9, 10, 11], total_tokens=6)
    assert b is not None
    kv.release(b)
    assert kv.cached_blocks == 4
    # Reusing a's prefix makes its blocks the most recently used again.
    c = kv.try_allocate([1, 2, 3, 4, 6], total_tokens=6)
    assert c is not None and c.cached_tokens == 4
    kv.release(c)
    # 2 free blocks + 2 evictions: b's blocks, now the least recently used, go.
    big = kv.try_allocate([20], total_tokens=8)
    assert big is not None and kv.evictions == 2
    kv.release(big)
    assert kv.try_allocate([1, 2, 3, 4, 5], 6).cached_tokens == 4  # type: ignore[union-attr]
    assert kv.try_allocate([7, 8, 9, 10, 11], 6).cached_tokens == 0  # type: ignore[union-attr]


def test_lru_evicts_least_recently_released_first() -> None:
    kv = KVCache(num_blocks=4, tokens_per_block=2)
    old = kv.try_allocate([1, 2, 3], total_tokens=4)
    new = kv.try_allocate([5, 6, 7], total_tokens=4)
    assert old is not None and new is not None
    kv.release(old)
    kv.release(new)
    assert kv.cached_blocks == 2
    # Needs 3 blocks: 2 free + 1 eviction, which must take `old`'s block.
    filler = kv.try_allocate([9], total_tokens=6)
    assert filler is not None and kv.evictions == 1
    kv.release(filler)
    assert kv.try_allocate([5, 6, 7], 4).cached_tokens == 2  # type: ignore[union-attr]
    assert kv.try_allocate([1, 2, 3], 4).cached_tokens == 0  # type: ignore[union-attr]


def test_allocation_fails_without_side_effects_when_full() -> None:
    kv = KVCache(num_blocks=4, tokens_per_block=4)
    a = kv.try_allocate(list(range(9)), total_tokens=12)
    assert a is not None and kv.used_blocks == 3
    assert kv.try_allocate(list(range(9)), total_tokens=16) is None
    assert kv.used_blocks == 3 and kv.hit_blocks == 0
    kv.release(a)
    assert kv.used_blocks == 0


def test_generated_tokens_complete_blocks_that_later_prompts_reuse() -> None:
    kv = KVCache(num_blocks=16, tokens_per_block=4)
    prompt = [1, 2, 3, 4, 5, 6]
    a = kv.try_allocate(prompt, total_tokens=12)
    assert a is not None
    for token in [7, 8, 9, 10]:
        kv.append_token(a, token)
    kv.release(a)
    # A follow-up turn: previous prompt + answer + new text.
    b = kv.try_allocate([1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], total_tokens=14)
    assert b is not None and b.cached_tokens == 8


def test_rejects_nonsense_geometry() -> None:
    with pytest.raises(ValueError):
        KVCache(num_blocks=0, tokens_per_block=4)
