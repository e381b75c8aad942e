"""The simulated engine's paged KV cache: block allocation, prefix reuse by chained block hashes,
LRU eviction of unreferenced cached blocks.

A full block's hash chains its parent's hash, the cache salt and its tokens (blake2b, so hashes are
stable across processes and can later be published as KV events to a prefix-aware router, as
TensorRT-LLM's ``stored`` / ``removed`` events are). A block is in exactly one of three states:
free (in `_free`), referenced by one or more requests (`_refs`), or cached — unreferenced but
still holding reusable content (`_lru`, oldest first). Cached blocks are evicted only when a new
allocation finds no free block.

With ``record_events`` on, the cache records TensorRT-LLM-style KV events as it goes: ``stored``
when blocks become reusable (a prompt's full blocks at allocation, a block filled by decode) and
``removed`` when cached blocks are evicted; `take_events()` hands them over. Off, it records
nothing (the backend turns it on only while someone subscribes).
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from dataclasses import dataclass, field

from .events import KvBlock, KvEvent, KvEventType


def block_hash(parent: int | None, tokens: list[int] | tuple[int, ...], salt: str = "") -> int:
    """The content hash of one full block, chained to its parent block's hash."""
    h = hashlib.blake2b(digest_size=8)
    if parent is not None:
        h.update(parent.to_bytes(8, "little"))
    if salt:
        h.update(salt.encode())
        h.update(b"\0")
    h.update(array("I", tokens).tobytes())
    return int.from_bytes(h.digest(), "little")


@dataclass(slots=True)
class Allocation:
    """The blocks one request holds, in sequence order."""

    blocks: list[int]
    cached_tokens: int
    # Hash of the last registered (full) block and how many blocks are registered, so decode can
    # extend the chain as blocks fill up.
    last_hash: int | None = None
    hashed_blocks: int = 0
    salt: str = ""
    pending_tokens: list[int] = field(default_factory=list)


class KVCache:
    """``num_blocks`` blocks of ``tokens_per_block`` tokens with prefix reuse and LRU eviction."""

    def __init__(self, num_blocks: int, tokens_per_block: int) -> None:
        if num_blocks < 1 or tokens_per_block < 1:
            raise ValueError("num_blocks and tokens_per_block must be >= 1")
        self.num_blocks = num_blocks
        self.tokens_per_block = tokens_per_block
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))
        self._refs: dict[int, int] = {}
        self._lru: OrderedDict[int, None] = OrderedDict()
        self._by_hash: dict[int, int] = {}
        self._hash_of: dict[int, int] = {}
        self.hit_blocks = 0
        self.miss_blocks = 0
        self.evictions = 0
        self.record_events = False
        self._events: list[KvEvent] = []
        self._evicted: list[int] = []
        self._next_event_id = 1          # 0 marks snapshot events
        # registered hash → (parent hash, tokens, salt): what a new subscriber's snapshot needs
        self._meta: dict[int, tuple[int | None, tuple[int, ...], str]] = {}

    # -- events -------------------------------------------------------------------------------
    def take_events(self) -> list[KvEvent]:
        events, self._events = self._events, []
        return events

    def _event(self, kind: KvEventType, **fields: object) -> None:
        self._events.append(KvEvent(self._next_event_id, kind, **fields))  # type: ignore[arg-type]
        self._next_event_id += 1

    def snapshot_events(self) -> list[KvEvent]:
        """Every registered block as a ``stored`` event (event id 0), parents before children."""
        out: list[KvEvent] = []
        for h in self._by_hash:
            parent, tokens, salt = self._meta[h]
            out.append(KvEvent(0, KvEventType.STORED, parent_hash=parent, blocks=(KvBlock(h, tokens),),
                               cache_salt=salt))
        return out

    def _flush_evicted(self) -> None:
        if self._evicted:
            if self.record_events:
                self._event(KvEventType.REMOVED, block_hashes=tuple(self._evicted))
            self._evicted = []

    # -- accounting ---------------------------------------------------------------------------
    @property
    def used_blocks(self) -> int:
        """Blocks referenced by live requests (cached blocks are reclaimable, so not "used")."""
        return len(self._refs)

    @property
    def cached_blocks(self) -> int:
        return len(self._lru)

    @property
    def available_blocks(self) -> int:
        return len(self._free) + len(self._lru)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.tokens_per_block)

    # -- prefix matching ----------------------------------------------------------------------
    def prompt_hashes(self, prompt: list[int], salt: str) -> list[int]:
        """Chained hashes of the prompt's full blocks."""
        tpb = self.tokens_per_block
        hashes: list[int] = []
        parent: int | None = None
        for start in range(0, len(prompt) - tpb + 1, tpb):
            parent = block_hash(parent, prompt[start:start + tpb], salt)
            hashes.append(parent)
        return hashes

    def _match(self, hashes: list[int], prompt_len: int) -> list[int]:
        # At least one prompt token is always computed (it produces the first output logits),
        # so a fully cached prompt still recomputes its last block, as vLLM does.
        limit = (prompt_len - 1) // self.tokens_per_block
        matched: list[int] = []
        for h in hashes[:limit]:
            block = self._by_hash.get(h)
            if block is None:
                break
            matched.append(block)
        return matched

    # -- allocation ---------------------------------------------------------------------------
    def try_allocate(self, prompt: list[int], total_tokens: int, salt: str = "",
                     hashes: list[int] | None = None) -> Allocation | None:
        """Reserve blocks for ``total_tokens`` (prompt + max new tokens), reusing cached prefix
        blocks; None (and no change) when the cache cannot hold it now."""
        hashes = self.prompt_hashes(prompt, salt) if hashes is None else hashes
        matched = self._match(hashes, len(prompt))
        needed = self.blocks_for(total_tokens) - len(matched)
        reclaimable = len(self._free) + len(self._lru) - sum(1 for b in matched if b in self._lru)
        if needed > reclaimable:
            return None
        for block in matched:
            self._acquire(block)
        blocks = matched + [self._take_block() for _ in range(needed)]
        self._flush_evicted()
        self.hit_blocks += len(matched)
        self.miss_blocks += len(hashes) - len(matched)
        alloc = Allocation(blocks, len(matched) * self.tokens_per_block, salt=salt)
        alloc.hashed_blocks = len(matched)
        if matched:
            alloc.last_hash = hashes[len(matched) - 1]
        self._register(alloc, hashes, prompt)
        tail = len(hashes) * self.tokens_per_block
        alloc.pending_tokens = list(prompt[tail:])
        return alloc

    def _acquire(self, block: int) -> None:
        if block in self._lru:
            del self._lru[block]
            self._refs[block] = 1
        else:
            self._refs[block] += 1

    def _take_block(self) -> int:
        if self._free:
            block = self._free.pop()
        else:
            block, _ = self._lru.popitem(last=False)
            h = self._hash_of.pop(block)
            del self._by_hash[h]
            del self._meta[h]
            self._evicted.append(h)
            self.evictions += 1
        self._refs[block] = 1
        return block

    def _register(self, alloc: Allocation, hashes: list[int], prompt: list[int]) -> None:
        """Publish the hashes of newly filled blocks (the simulated prefill/decode wrote them)."""
        tpb = self.tokens_per_block
        stored: list[KvBlock] = []
        parent = alloc.last_hash
        for i in range(alloc.hashed_blocks, len(hashes)):
            block = alloc.blocks[i]
            h = hashes[i]
            # The same content computed concurrently by another request keeps the first copy
            # registered; this block stays private and is freed, not cached, at release.
            if h not in self._by_hash and block not in self._hash_of:
                self._by_hash[h] = block
                self._hash_of[block] = h
                tokens = tuple(prompt[i * tpb:(i + 1) * tpb])
                self._meta[h] = (hashes[i - 1] if i else None, tokens, alloc.salt)
                if self.record_events:
                    stored.append(KvBlock(h, tokens))
            elif stored:   # a run of new blocks ended: one event per contiguous run
                self._event(KvEventType.STORED, parent_hash=parent, blocks=tuple(stored), cache_salt=alloc.salt)
                stored = []
            if not stored:
                parent = h
            alloc.last_hash = h
        if stored:
            self._event(KvEventType.STORED, parent_hash=parent, blocks=tuple(stored), cache_salt=alloc.salt)
        alloc.hashed_blocks = max(alloc.hashed_blocks, len(hashes))

    def append_token(self, alloc: Allocation, token: int) -> None:
        """Track a generated token so a completed block becomes reusable (multi-turn chats)."""
        pending = alloc.pending_tokens
        pending.append(token)
        if len(pending) == self.tokens_per_block:
            if alloc.hashed_blocks < len(alloc.blocks):
                h = block_hash(alloc.last_hash, pending, alloc.salt)
                block = alloc.blocks[alloc.hashed_blocks]
                if h not in self._by_hash and block not in self._hash_of:
                    self._by_hash[h] = block
                    self._hash_of[block] = h
                    self._meta[h] = (alloc.last_hash, tuple(pending), alloc.salt)
                    if self.record_events:
                        self._event(KvEventType.STORED, parent_hash=alloc.last_hash,
                                    blocks=(KvBlock(h, tuple(pending)),), cache_salt=alloc.salt)
                alloc.last_hash = h
                alloc.hashed_blocks += 1
            alloc.pending_tokens = []

    def release(self, alloc: Allocation) -> None:
        """Drop a request's references; tail blocks first so that the LRU evicts suffixes before
        the shared prefixes they hang from."""
        for block in reversed(alloc.blocks):
            refs = self._refs[block] - 1
            if refs:
                self._refs[block] = refs
                continue
            del self._refs[block]
            if block in self._hash_of:
                self._lru[block] = None
            else:
                self._free.append(block)
        alloc.blocks = []
