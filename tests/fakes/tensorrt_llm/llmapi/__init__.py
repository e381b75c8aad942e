"""Fake `tensorrt_llm.llmapi`: the config classes the trtllm backend builds (trtllm-api.md)."""

from __future__ import annotations

import enum
from dataclasses import dataclass


class CapacitySchedulerPolicy(enum.Enum):
    GUARANTEED_NO_EVICT = "GUARANTEED_NO_EVICT"
    MAX_UTILIZATION = "MAX_UTILIZATION"
    STATIC_BATCH = "STATIC_BATCH"


@dataclass(kw_only=True)
class KvCacheConfig:
    enable_block_reuse: bool = True
    free_gpu_memory_fraction: float = 0.9
    max_tokens: int | None = None
    event_buffer_max_size: int = 0
    enable_partial_reuse: bool = True
    tokens_per_block: int = 32
    host_cache_size: int | None = None
    dtype: str = "auto"


@dataclass(kw_only=True)
class SchedulerConfig:
    capacity_scheduler_policy: CapacitySchedulerPolicy = CapacitySchedulerPolicy.GUARANTEED_NO_EVICT
