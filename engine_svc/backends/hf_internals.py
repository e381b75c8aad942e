"""What the `hf` backend reads from transformers' and torch's internals, read defensively: a
version that renames something degrades to a safe default instead of failing the engine.

Imports nothing heavy at module level (each function takes what it needs from its arguments).
"""

from __future__ import annotations

from typing import Any


def eos_ids(model: Any) -> tuple[int, ...]:
    eos = getattr(model.generation_config, "eos_token_id", None)
    if eos is None:
        eos = getattr(model.config, "eos_token_id", None)
    if eos is None:
        return ()
    return tuple(int(e) for e in ([eos] if isinstance(eos, int) else eos) if int(e) >= 0)


def emulated_half_precision(model: Any, torch: Any) -> bool:
    """A bf16/fp16 model on a CPU that has no native instructions for it (oneDNN says which)."""
    if model.device.type != "cpu" or model.dtype not in (torch.bfloat16, torch.float16):
        return False
    probe = {torch.bfloat16: "_is_mkldnn_bf16_supported", torch.float16: "_is_mkldnn_fp16_supported"}[model.dtype]
    try:
        return not bool(getattr(torch.ops.mkldnn, probe)())
    except (AttributeError, RuntimeError):
        return False


def kv_tokens(cache: Any, fallback: int) -> int:
    """The longest request (prompt + generated) the KV cache holds on its own. With sliding-window
    layers (Gemma 3) that is more than num_blocks x block_size: those layers keep only the window."""
    try:
        from transformers.generation.continuous_batching.model_runner import infer_max_single_request_tokens

        return int(infer_max_single_request_tokens(cache)) or fallback
    except (ImportError, AttributeError, TypeError):  # another transformers version
        return fallback


def manager_load(manager: Any) -> tuple[int, int, int, int]:
    """(active, queued, kv blocks total, kv blocks referenced) read from the manager's internals.

    These are private attributes of transformers 5.24; read defensively so that a version that
    renames them degrades to zeros instead of failing GetLoad.
    """
    processor = getattr(manager, "batch_processor", None)
    scheduler = getattr(processor, "scheduler", None)
    cache = getattr(processor, "cache", None)
    if scheduler is None or cache is None:
        return 0, 0, 0, 0
    try:
        active = len(scheduler.active_requests)
        queued = len(scheduler.waiting_requests) + manager.input_queue.qsize()
        allocator = next(iter(cache.cache_allocators.values()))
        used = len(set().union(*list(allocator.block_table.values())))
        return active, queued, int(allocator.num_blocks), used
    except (AttributeError, StopIteration, RuntimeError):
        return 0, 0, 0, 0
