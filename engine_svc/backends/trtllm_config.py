"""Settings of the `trtllm` backend (TensorRT-LLM's LLM API, PyTorch backend), and how they become
the `LLM(...)` constructor's arguments. Importing this module needs no tensorrt_llm: the engine's
settings and `--help` load it on a base install.

The knobs are the ones that decide a deployment's throughput and memory (see TensorRT-LLM's LLM
API reference, `LlmArgs` and `KvCacheConfig`): batch and token budgets, the KV cache's share of free GPU memory
and its precision, chunked prefill, the capacity scheduler's policy, tensor parallelism and the
KV-event buffer. KV block reuse is always on (prefix caching is the point of a prefix-aware
router); ``event_buffer_size`` 0 turns KV events off.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from services.config import Section, flag

SchedulerPolicy = Literal["guaranteed_no_evict", "max_utilization", "static_batch"]


class TrtllmConfig(Section):
    """TensorRT-LLM in process: token ids in (no tokenizer), streamed token ids out."""

    model: str = Field("", description="model directory (a Hugging Face checkpoint, e.g. an FP8 ModelOpt one)",
                       json_schema_extra=flag(None))   # set by the engine's --model
    max_batch_size: int = Field(2048, ge=1, description="requests scheduled per iteration (TensorRT-LLM's "
                                                        "max_batch_size)")
    max_num_tokens: int = Field(8192, ge=1, description="tokens (prefill + decode) per iteration; without "
                                                        "chunked prefill also the longest prompt")
    max_seq_len: int = Field(0, ge=0, description="longest prompt + output (0 = the model's context)")
    kv_free_memory_fraction: float = Field(0.9, gt=0, lt=1, description="share of the GPU memory left after "
                                                                        "the weights given to the KV cache")
    kv_cache_dtype: Literal["auto", "fp8", "nvfp4", "bfloat16", "float16"] = Field(
        "auto", description="KV cache precision (auto = the checkpoint's)")
    tokens_per_block: int = Field(32, ge=1, description="tokens per KV block")
    enable_chunked_prefill: bool = Field(False, description="split long prompts over iterations")
    scheduler_policy: SchedulerPolicy = Field("guaranteed_no_evict", description="capacity scheduler policy")
    tensor_parallel_size: int = Field(1, ge=1, description="GPUs one model instance spans")
    event_buffer_size: int = Field(4096, ge=0, description="KV-cache events the engine buffers between polls "
                                                           "(0 = no KV events)")
    poll_timeout: float = Field(0.05, gt=0, description="seconds one poll of stats / KV events waits when the "
                                                        "engine has none queued")
    end_id: int = Field(-1, ge=-1, description="end-of-sequence id (-1 = the model's generation_config.json)")


def llm_kwargs(config: TrtllmConfig, llmapi: Any) -> dict[str, Any]:
    """The `LLM(**kwargs)` of a config; ``llmapi`` is the `tensorrt_llm.llmapi` module."""
    policy = getattr(llmapi.CapacitySchedulerPolicy, config.scheduler_policy.upper())
    kwargs: dict[str, Any] = dict(
        model=config.model, skip_tokenizer_init=True, tensor_parallel_size=config.tensor_parallel_size,
        backend="pytorch", max_batch_size=config.max_batch_size, max_num_tokens=config.max_num_tokens,
        enable_chunked_prefill=config.enable_chunked_prefill, enable_iter_perf_stats=True,
        kv_cache_config=llmapi.KvCacheConfig(
            enable_block_reuse=True, free_gpu_memory_fraction=config.kv_free_memory_fraction,
            event_buffer_max_size=config.event_buffer_size, tokens_per_block=config.tokens_per_block,
            dtype=config.kv_cache_dtype),
        scheduler_config=llmapi.SchedulerConfig(capacity_scheduler_policy=policy))
    if config.max_seq_len:
        kwargs["max_seq_len"] = config.max_seq_len
    return kwargs
