"""What each engine replica holds in its prefix cache, as the router knows it (pure, no I/O).

Keys. A prompt is cut into full blocks of `tokens_per_block` tokens (the engines' block size); a
block's key chains its parent's key and its tokens, so equal keys mean equal prefixes. The chain
starts from the request's cache salt (the tenant: the engines reuse blocks only within one salt),
or from 0 for replicas whose events carry no salt (TensorRT-LLM's do not). Keys are Python's hash
of a tuple of ints: deterministic across processes and ~1 µs per block, so every router computes
the same keys for the same prompt.

Three sources, per replica:
- KV-cache events (`apply`), the precise one: ``stored`` blocks arrive with the engine's own hash,
  its parent's hash and their tokens; the router maps engine hash → its key through the parent
  chain, and ``removed`` drops them. Event ids must be consecutive: a gap (or a batch reporting
  dropped events) makes `apply` return False and the caller clears the replica and resubscribes
  (the engine sends a snapshot of what it holds on every new subscription). Snapshot events carry
  event id 0.
- Recent placements (`placed`): a prompt routed to a replica counts as held there for
  `pending_ttl` seconds, until its events arrive, so a burst of requests sharing a prefix lands
  together before the first has been prefilled.
- Routing history (`placed` + `finished`, for replicas that publish no events): prompts and
  replies routed there, in an LRU bounded by the replica's KV capacity (eviction modelled).
- Other routers' placements (`remote`, fed by `placement_share.PlacementShare`): the keys another
  router process placed (or finished) on a replica, entered exactly as this router's own — pending
  until the events arrive, or history for event-less replicas. `on_record`, when set, hears every
  placement and history entry this router makes (the share publishes them).

Live blocks (`match(..., live=...)`, replicas with events): the keys held or pending there that a
placement (the whole prompt) or a ``stored`` event (blocks prefilled or decoded) touched in the
last `live_window` seconds — the prefixes of conversations in progress there. The rest of what a
replica holds is stale (conversations that ended or paused) and is what its LRU evicts first.
`live_window` 0 tracks nothing (the router does so while `--prefix-evict-cost` is 0).

Holds (`hold`, `held`): a request that ended on a replica leaves a hold there, keyed by its prompt's
last full block: the conversation's next turn (a prompt that extends this one) is expected within
milliseconds to seconds. Until a placement of a prompt with that key consumes it (here or, shared,
at another router) or `hold_ttl` seconds pass, `held` reports it to every other prompt's placement,
so a new conversation does not take the free slot of one between turns (and push that turn off its
cache); the prompt that owns a hold sees no holds on the replica it returns to. Without holds a
closed loop moved 17% of shared-hot's follow-up turns at `--prefix-balance-slack 0`
(docs/routing.md). Other routers' holds arrive through `remote_hold`; `hold_ttl` 0 keeps none.
"""

from __future__ import annotations

import hashlib
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

DEFAULT_TOKENS_PER_BLOCK = 32
PENDING_TTL = 5.0
HISTORY_BLOCKS = 4096   # a replica without events and without a reported KV size
LIVE_WINDOW = 0.5       # seconds a touched block counts as a conversation in progress
HOLD_TTL = 0.5          # seconds a replica is held for a conversation's next turn
MAX_HOLDS = 100_000     # holds kept at most (the oldest go first)


def salt_root(salt: str, _cache: dict[str, int] = {}) -> int:  # noqa: B006 - a memo on purpose
    """The chain's start for a cache salt (stable across processes; "" → 0)."""
    if not salt:
        return 0
    root = _cache.get(salt)
    if root is None:
        if len(_cache) > 65_536:
            _cache.clear()
        root = int.from_bytes(hashlib.blake2b(salt.encode(), digest_size=8).digest(), "little")
        _cache[salt] = root
    return root


def block_keys(tokens: Sequence[int], tokens_per_block: int, salt: str = "", limit: int | None = None,
               first: Sequence[int] = ()) -> list[int]:
    """Chained keys of the full blocks of `tokens` (at most `limit` of them); `first`: the keys of its
    leading blocks, already computed (they are kept, the chain goes on from the last of them)."""
    n = len(tokens) // tokens_per_block
    if limit is not None:
        n = min(n, limit)
    keys = list(first[:n])
    key = keys[-1] if keys else salt_root(salt)
    for i in range(len(keys), n):
        key = hash((key, *tokens[i * tokens_per_block:(i + 1) * tokens_per_block]))
        keys.append(key)
    return keys


@dataclass
class StoredBlock:
    engine_hash: int
    tokens: Sequence[int]


@dataclass
class _Replica:
    events: bool = False                      # publishes KV events (precise)
    salted: bool = True                       # its events carry the cache salt
    last_event_id: int | None = None
    engine_to_key: dict[int, int] = field(default_factory=dict)
    held: dict[int, int] = field(default_factory=dict)          # key → engine blocks with that key
    pending: OrderedDict[int, float] = field(default_factory=OrderedDict)   # key → expiry
    history: OrderedDict[int, None] = field(default_factory=OrderedDict)    # key LRU (no events)
    history_capacity: int = HISTORY_BLOCKS
    gaps: int = 0
    touched: OrderedDict[int, float] = field(default_factory=OrderedDict)   # key → last touch (events)


class PrefixIndex:
    """Keys held per replica, from events, recent placements and history (module doc)."""

    def __init__(self, tokens_per_block: int = DEFAULT_TOKENS_PER_BLOCK, pending_ttl: float = PENDING_TTL,
                 clock: Callable[[], float] = time.monotonic, live_window: float = LIVE_WINDOW,
                 hold_ttl: float = HOLD_TTL) -> None:
        self.tokens_per_block = tokens_per_block
        self.pending_ttl = pending_ttl
        self.live_window = live_window
        self._clock = clock
        self._replicas: dict[str, _Replica] = {}
        self.hold_ttl = hold_ttl
        # A prompt's last full-block key → the replica it ended on; per replica, key → when (oldest
        # first) and the sum of those times (a replica's hold weight in O(1), `held`).
        self._holds: dict[int, str] = {}
        self._held_at: dict[str, dict[int, float]] = {}
        self._held_sum: dict[str, float] = {}
        self._memo: tuple[Sequence[int], str, dict[bool, list[int]]] | None = None   # match's last keys
        # (address, key): a hold this router made (the share publishes it).
        self.on_hold: Callable[[str, int], None] | None = None
        # (address, keys, kind): kind "placed" (pending, or history without events) or "finished"
        # (history only); the keys as this router computed them (salt folded in where it applies).
        self.on_record: Callable[[str, list[int], str], None] | None = None

    # -- membership ---------------------------------------------------------------------------
    def replica(self, address: str) -> _Replica:
        r = self._replicas.get(address)
        if r is None:
            r = self._replicas[address] = _Replica()
        return r

    def forget(self, address: str) -> None:
        self._replicas.pop(address, None)
        for key in self._held_at.pop(address, {}):
            self._holds.pop(key, None)
        self._held_sum.pop(address, None)

    def reset(self, address: str, *, events: bool, salted: bool = True, tokens_per_block: int = 0) -> None:
        """A (re)subscription began: drop what was known of the replica's cache (a snapshot follows)."""
        old = self._replicas.get(address)
        r = self._replicas[address] = _Replica(events=events, salted=salted)
        if old is not None:
            r.history_capacity, r.gaps = old.history_capacity, old.gaps
        if tokens_per_block:
            self.tokens_per_block = tokens_per_block

    def set_capacity(self, address: str, kv_blocks: int) -> None:
        if kv_blocks > 0:
            self.replica(address).history_capacity = kv_blocks

    def stats(self, address: str) -> dict[str, int]:
        r = self.replica(address)
        return {"held": len(r.held), "pending": len(r.pending), "history": len(r.history), "gaps": r.gaps}

    # -- events -------------------------------------------------------------------------------
    def apply_stored(self, address: str, event_id: int, parent_hash: int | None,
                     blocks: Iterable[StoredBlock], salt: str | None) -> bool:
        """A ``stored`` event; False on a gap (clear and resubscribe)."""
        r = self.replica(address)
        if not self._in_sequence(r, event_id):
            return False
        r.events = True
        if salt is None:
            r.salted = False
        if parent_hash is None:
            key = salt_root(salt or "") if r.salted else 0
        else:
            parent = r.engine_to_key.get(parent_hash)
            if parent is None:
                return True            # hangs from a block we never saw: unusable, not a gap
            key = parent
        tpb = self.tokens_per_block
        now = self._clock()
        for block in blocks:
            if len(block.tokens) < tpb:
                break                  # a partial block (routers ignore them, as Dynamo does)
            key = hash((key, *block.tokens))
            if event_id and self.live_window > 0:   # a snapshot says what is held, not what is live
                r.touched[key] = now
                r.touched.move_to_end(key)
            if block.engine_hash in r.engine_to_key:
                continue
            r.engine_to_key[block.engine_hash] = key
            r.held[key] = r.held.get(key, 0) + 1
            r.pending.pop(key, None)
        return True

    def apply_removed(self, address: str, event_id: int, engine_hashes: Iterable[int]) -> bool:
        r = self.replica(address)
        if not self._in_sequence(r, event_id):
            return False
        for h in engine_hashes:
            key = r.engine_to_key.pop(h, None)
            if key is None:
                continue
            left = r.held.get(key, 0) - 1
            if left > 0:
                r.held[key] = left
            else:
                r.held.pop(key, None)
                r.touched.pop(key, None)
        return True

    def skip(self, address: str, event_id: int) -> bool:
        """An event that changes nothing here (created / updated): keep the sequence."""
        return self._in_sequence(self.replica(address), event_id)

    def gap(self, address: str) -> None:
        self.replica(address).gaps += 1

    @staticmethod
    def _in_sequence(r: _Replica, event_id: int) -> bool:
        if event_id == 0:               # a snapshot event
            return True
        if r.last_event_id is not None and event_id != r.last_event_id + 1:
            r.gaps += 1
            return False
        r.last_event_id = event_id
        return True

    # -- placements ---------------------------------------------------------------------------
    def placed(self, address: str, prompt: Sequence[int], salt: str) -> bool:
        """A prompt was routed to `address` (recent placement; history for event-less replicas).
        Returns whether the replica was believed to hold its first block (as `match` counts it)."""
        r = self.replica(address)
        # The keys `match` computed for this prompt just before (the same placement): at most one block
        # is left to add (it leaves out a last block the prompt ends exactly with).
        keys = block_keys(prompt, self.tokens_per_block, salt if r.salted else "", first=self._known(prompt, salt, r))
        reusable = len(prompt) - 1 >= self.tokens_per_block   # the engine always computes the last token
        if r.events:
            self._expire(r)
            hit = reusable and (keys[0] in r.held or keys[0] in r.pending)
            now = self._clock()
            self._pend(r, keys, now + self.pending_ttl)
            if self.live_window > 0:
                self._touch(r, keys, now)
        else:
            hit = reusable and keys[0] in r.history
            self._remember(r, keys)
        if self.on_record is not None and keys:
            self.on_record(address, keys, "placed")
        if self._holds:
            self._consume(keys)
        return hit

    def remote(self, address: str, keys: Sequence[int], kind: str, age: float = 0.0) -> None:
        """Another router placed (`kind` "placed") or finished ("finished") these keys on `address`
        `age` seconds ago: the same entries as this router's own (`placed` / `finished`). A replica
        this router does not follow (another pool's, one it forgot) is not added."""
        r = self._replicas.get(address)
        if r is None:
            return
        if r.events:
            if kind == "placed" and age < self.pending_ttl:
                self._expire(r)
                now = self._clock()
                self._pend(r, keys, now + self.pending_ttl - max(0.0, age))
                if self.live_window > 0:
                    self._touch(r, keys, now)
        elif kind in ("placed", "finished"):
            self._remember(r, keys)
        if kind == "placed" and self._holds:
            self._consume(keys)

    # -- holds (module doc) --------------------------------------------------------------------
    def _known(self, prompt: Sequence[int], salt: str, r: _Replica) -> Sequence[int]:
        """The keys of `prompt`'s leading blocks for `r`'s salting that `match` computed last, if it
        was for this very prompt (the same list: at light load, until another request is placed)."""
        memo = self._memo
        return memo[2].get(r.salted, ()) if memo is not None and memo[0] is prompt and memo[1] == salt else ()

    def hold(self, address: str, prompt: Sequence[int], salt: str) -> None:
        """A request of `prompt` ended on `address`: hold the replica for the conversation's next turn."""
        r = self._replicas.get(address)
        if self.hold_ttl <= 0 or r is None:
            return
        keys = block_keys(prompt, self.tokens_per_block, salt if r.salted else "", first=self._known(prompt, salt, r))
        if keys:
            self._add_hold(address, keys[-1], self._clock())
            if self.on_hold is not None:
                self.on_hold(address, keys[-1])

    def remote_hold(self, address: str, key: int, age: float = 0.0) -> None:
        """Another router's hold, made `age` seconds ago (a replica this router does not follow: none)."""
        if self.hold_ttl > 0 and age < self.hold_ttl and address in self._replicas:
            self._add_hold(address, key, self._clock() - max(0.0, age))

    def _add_hold(self, address: str, key: int, when: float) -> None:
        self._drop_hold(key)
        self._holds[key] = address
        self._held_at.setdefault(address, {})[key] = when
        self._held_sum[address] = self._held_sum.get(address, 0.0) + when
        if len(self._holds) > MAX_HOLDS:
            self._drop_hold(next(iter(self._holds)))

    def _drop_hold(self, key: int) -> None:
        address = self._holds.pop(key, None)
        if address is not None:
            at = self._held_at.get(address)
            if at is not None and key in at:
                self._held_sum[address] -= at.pop(key)
                if not at:
                    del self._held_at[address], self._held_sum[address]

    def _consume(self, keys: Sequence[int]) -> None:
        holds = self._holds
        for key in keys:
            if key in holds:
                self._drop_hold(key)

    def held(self, prompt: Sequence[int], salt: str, addresses: Sequence[str]) -> dict[str, float]:
        """Per replica of `addresses` with holds, their weight: Σ (1 - age / `hold_ttl`) over the holds
        younger than `hold_ttl` (a fresh hold weighs 1). The replica that holds this prompt's own hold
        is left out: its conversation returns there. O(1) per replica (expiry from the oldest)."""
        if not self._holds:
            return {}
        now = self._clock()
        ttl = self.hold_ttl
        horizon = now - ttl
        memo = self._memo
        own = ""
        # The keys `match` just computed for this prompt, one chain per salting of the candidates (a
        # hold on a replica of another salting is not a candidate's); else both chains.
        chains = memo[2] if memo is not None and memo[0] is prompt and memo[1] == salt else {
            salted: block_keys(prompt, self.tokens_per_block, salt if salted else "") for salted in (True, False)}
        for salted, keys in chains.items():
            for key in reversed(keys):
                address = self._holds.get(key)
                if address is not None and self._replicas[address].salted is salted \
                        and self._held_at[address][key] >= horizon:
                    own = address
                    break
            if own:
                break
        out: dict[str, float] = {}
        for address in addresses:
            at = self._held_at.get(address)
            if not at or address == own:
                continue
            while at:
                key, when = next(iter(at.items()))
                if when >= horizon:
                    break
                self._drop_hold(key)
            n = len(at)
            if n:   # Σ (1 - (now - t) / ttl); another router's late hold may sit out of order: clamp
                out[address] = max(0.0, n - (n * now - self._held_sum[address]) / ttl)
        return out

    def holds(self) -> int:
        """Holds kept now (some may be past `hold_ttl`, dropped when next looked at)."""
        return len(self._holds)

    @staticmethod
    def _pend(r: _Replica, keys: Sequence[int], expiry: float) -> None:
        pending, held = r.pending, r.held
        for key in keys:
            if key not in held and pending.get(key, 0.0) < expiry:
                pending[key] = expiry
                pending.move_to_end(key)

    @staticmethod
    def _touch(r: _Replica, keys: Sequence[int], now: float) -> None:
        touched = r.touched
        for key in keys:
            touched[key] = now
            touched.move_to_end(key)

    def live(self, address: str) -> int:
        """Blocks of `address` touched in the last `live_window` seconds (0 without events)."""
        r = self._replicas.get(address)
        if r is None or not r.events:
            return 0
        self._expire_touched(r)
        return len(r.touched)

    def _expire_touched(self, r: _Replica) -> None:
        touched, held, pending = r.touched, r.held, r.pending
        horizon = self._clock() - self.live_window
        while touched:
            key, at = next(iter(touched.items()))
            if at > horizon and (key in held or key in pending):
                break
            touched.popitem(last=False)

    def finished(self, address: str, prompt: Sequence[int], reply: Sequence[int], salt: str) -> None:
        """A request ended there: its prompt and reply (event-less replicas only: history)."""
        r = self.replica(address)
        if not r.events:
            keys = block_keys([*prompt, *reply], self.tokens_per_block, salt if r.salted else "",
                              first=self._known(prompt, salt, r))
            self._remember(r, keys)
            if self.on_record is not None and keys:
                self.on_record(address, keys, "finished")

    @staticmethod
    def _remember(r: _Replica, keys: Sequence[int]) -> None:
        # Tail first, so the chain's head is the most recent and suffixes are evicted first (as
        # the engines release a request's blocks tail first).
        for key in reversed(keys):
            r.history[key] = None
            r.history.move_to_end(key)
        while len(r.history) > r.history_capacity:
            r.history.popitem(last=False)

    def _expire(self, r: _Replica) -> None:
        now = self._clock()
        while r.pending:
            _key, expiry = next(iter(r.pending.items()))
            if expiry > now:
                break
            r.pending.popitem(last=False)

    # -- lookup -------------------------------------------------------------------------------
    def match(self, prompt: Sequence[int], addresses: Sequence[str], salt: str = "",
              live: dict[str, tuple[int, int, int]] | None = None) -> dict[str, int]:
        """Per replica, how many leading full blocks of `prompt` it is believed to hold. With `live`
        given, it is filled for each replica with events: (blocks held or pending there, its live
        blocks, how many of the matched blocks are among them)."""
        tpb = self.tokens_per_block
        limit = max(0, (len(prompt) - 1) // tpb)    # the engine always computes the last token
        if not limit:
            if live is not None:
                for address in addresses:
                    r = self._replicas.get(address)
                    if r is not None and r.events:
                        self._expire_touched(r)
                        live[address] = (len(r.held) + len(r.pending), len(r.touched), 0)
            return {}
        chains: dict[bool, list[int]] = {}
        depths: dict[str, int] = {}
        for address in addresses:
            r = self._replicas.get(address)
            if r is None:
                continue
            keys = chains.get(r.salted)
            if keys is None:
                keys = chains[r.salted] = block_keys(prompt, tpb, salt if r.salted else "", limit)
            if r.events:
                self._expire(r)
                held, pending = r.held, r.pending
                depth = 0
                for key in keys:
                    if key not in held and key not in pending:
                        break
                    depth += 1
                if live is not None:
                    self._expire_touched(r)
                    touched = r.touched
                    live[address] = (len(held) + len(pending), len(touched),
                                     sum(1 for key in keys[:depth] if key in touched))
            else:
                history = r.history
                depth = 0
                for key in keys:
                    if key not in history:
                        break
                    depth += 1
            if depth:
                depths[address] = depth
        self._memo = (prompt, salt, chains)
        return depths
