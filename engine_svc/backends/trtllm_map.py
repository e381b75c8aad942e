"""TensorRT-LLM's shapes to the contract's and back, as pure functions (no tensorrt_llm import):
iteration stats and KV-cache event dicts in, `IterationStats` / `KvEvent` out; finish reasons;
the model's end and extra EOS ids; the `SamplingParams` keyword arguments of a request.

The dict shapes are those of ``get_stats_async`` / ``get_kv_cache_events_async`` documented in
TensorRT-LLM's LLM API reference (camelCase stats keys; events ``{"event_id", "window_size",
"data": {"type": ...}}``). Some versions hand stats over as JSON strings: both are read.
"""

from __future__ import annotations

import json
import pathlib
from typing import Any

from .base import FinishReason, GenerationRequest
from .events import IterationStats, KvBlock, KvEvent, KvEventType, hit_rate

_FINISH = {"stop": FinishReason.STOP, "length": FinishReason.LENGTH, "cancelled": FinishReason.CANCELLED}
_EVENT_TYPES = {t.value: t for t in KvEventType}


def _as_dict(item: Any) -> dict[str, Any]:
    if isinstance(item, (str, bytes)):
        item = json.loads(item)
    return item if isinstance(item, dict) else {}


def stats_from_trtllm(item: Any) -> IterationStats:
    """One `get_stats_async` item as the contract's iteration stats."""
    d = _as_dict(item)
    kv = d.get("kvCacheStats") or {}
    ifb = d.get("inflightBatchingStats") or {}
    reused, missed = int(kv.get("reusedBlocks", 0)), int(kv.get("missedBlocks", 0))
    total, free = int(kv.get("maxNumBlocks", 0)), int(kv.get("freeNumBlocks", 0))
    rate = kv.get("cacheHitRate")
    return IterationStats(
        iteration=int(d.get("iter", 0)), active=int(d.get("numActiveRequests", 0)),
        queued=int(d.get("numQueuedRequests", 0)), max_active=int(d.get("maxNumActiveRequests", 0)),
        kv_blocks_total=total, kv_blocks_used=int(kv.get("usedNumBlocks", total - free)), kv_blocks_free=free,
        kv_blocks_reused=reused, kv_blocks_missed=missed,
        kv_cache_hit_rate=float(rate) if rate is not None else hit_rate(reused, missed),
        tokens_per_block=int(kv.get("tokensPerBlock", 0)), context_requests=int(ifb.get("numContextRequests", 0)),
        generation_requests=int(ifb.get("numGenRequests", 0)), paused_requests=int(ifb.get("numPausedRequests", 0)),
        iteration_latency_ms=float(d.get("iterLatencyMS", 0.0)))


def _new_value(field: Any) -> int:
    # `updated` events carry {"old_value", "new_value"} per changed field, or nothing.
    if isinstance(field, dict):
        return int(field.get("new_value", 0))
    return int(field or 0)


def kv_event_from_trtllm(item: Any) -> KvEvent | None:
    """One `get_kv_cache_events_async` item as a `KvEvent`; None for a type this code does not know."""
    d = _as_dict(item)
    data = d.get("data") or {}
    kind = _EVENT_TYPES.get(str(data.get("type", "")))
    if kind is None:
        return None
    event_id, window = int(d.get("event_id", 0)), int(d.get("window_size") or 0)
    if kind is KvEventType.STORED:
        blocks = tuple(KvBlock(int(b["block_hash"]), tuple(int(t["token_id"]) for t in b.get("tokens", ())),
                               int(b.get("cache_level") or 0), int(b.get("priority") or 0))
                       for b in data.get("blocks", ()))
        parent = data.get("parent_hash")
        return KvEvent(event_id, kind, int(parent) if parent is not None else None, blocks, window_size=window)
    if kind is KvEventType.REMOVED:
        return KvEvent(event_id, kind, block_hashes=tuple(int(h) for h in data.get("block_hashes", ())),
                       window_size=window)
    if kind is KvEventType.CREATED:
        return KvEvent(event_id, kind, window_size=window, num_blocks_per_cache_level=tuple(
            int(n) for n in data.get("num_blocks_per_cache_level", ())))
    block = KvBlock(int(data.get("block_hash", 0)), (), _new_value(data.get("cache_level")),
                    _new_value(data.get("priority")))
    return KvEvent(event_id, kind, blocks=(block,), window_size=window)


def finish_reason(name: str | None, generated: int, max_tokens: int) -> FinishReason | None:
    """The contract's finish reason of a finished output; None for 'timeout' (the caller fails the
    request with DEADLINE_EXCEEDED) and an unnamed finish is read from the length."""
    if name == "timeout":
        return None
    known = _FINISH.get(name or "")
    if known is not None:
        return known
    return FinishReason.LENGTH if generated >= max_tokens else FinishReason.STOP


def model_eos_ids(model_dir: str) -> list[int]:
    """EOS ids from the model's generation_config.json (else config.json), in their order; the
    first is TensorRT-LLM's ``end_id``, the others go into ``stop_token_ids``."""
    for name in ("generation_config.json", "config.json"):
        path = pathlib.Path(model_dir) / name
        if not path.is_file():
            continue
        eos = json.loads(path.read_text()).get("eos_token_id")
        if eos is None:
            continue
        return [int(e) for e in (eos if isinstance(eos, list) else [eos])]
    return []


def sampling_kwargs(request: GenerationRequest, model_eos: list[int], end_id: int) -> dict[str, Any]:
    """`SamplingParams(**kwargs)` of a request. Zero sampling values mean "default", which is
    greedy in TensorRT-LLM when temperature, top_p and top_k are all None. ``end_id`` is always set
    (required without a tokenizer); every other EOS id, the model's and the request's, becomes a
    stop token unless the request ignores EOS."""
    stops = list(dict.fromkeys(request.stop_token_ids))
    if not request.ignore_eos:
        stops += [e for e in dict.fromkeys([*model_eos, *request.eos_token_ids]) if e != end_id and e not in stops]
    kwargs: dict[str, Any] = dict(
        max_tokens=request.max_tokens, end_id=end_id, pad_id=end_id, ignore_eos=request.ignore_eos,
        stop_token_ids=stops or None, detokenize=False,
        temperature=request.temperature or None, top_p=request.top_p or None, top_k=request.top_k or None)
    if request.seed is not None:
        kwargs["seed"] = request.seed
    return kwargs
