"""Engine backends behind one interface, and the registry that builds one by name.

Factories import their backend lazily, so `sim` never imports torch.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from .base import (
    Backend,
    FinishReason,
    GenerationEvent,
    GenerationRequest,
    LoadSnapshot,
    PrefixCacheStats,
    Sink,
    StepObserver,
    StepStats,
)

if TYPE_CHECKING:
    from ..config import EngineSettings

__all__ = ["BACKENDS", "Backend", "FinishReason", "GenerationEvent", "GenerationRequest",
           "LoadSnapshot", "PrefixCacheStats", "Sink", "StepObserver", "StepStats", "create_backend"]


def _sim(s: EngineSettings) -> Backend:
    from .sim import SimBackend, SimConfig

    return SimBackend(SimConfig(
        model=s.model or SimConfig.model, max_batch_size=s.sim_max_batch_size,
        max_num_tokens=s.sim_max_num_tokens, num_blocks=s.sim_num_blocks,
        tokens_per_block=s.sim_tokens_per_block, vocab_size=s.sim_vocab_size,
        max_context=s.sim_max_context, prefill_time_per_token=s.sim_prefill_time_per_token,
        decode_step_time=s.sim_decode_step_time, decode_time_per_seq=s.sim_decode_time_per_seq,
        eos_probability=s.sim_eos_probability))


def _hf(s: EngineSettings) -> Backend:
    from .hf import HfBackend, HfConfig

    if not s.model:
        raise ValueError("the hf backend needs --model (a Hugging Face model directory)")
    return HfBackend(HfConfig(
        model=s.model, device=s.hf_device, dtype=s.hf_dtype, threads=s.hf_threads,
        num_blocks=s.hf_num_blocks, block_size=s.hf_block_size,
        max_batch_tokens=s.hf_max_batch_tokens, max_batch_size=s.hf_max_batch_size,
        sampling=s.hf_sampling, random_weights=s.hf_random_weights))


BACKENDS: dict[str, Callable[[EngineSettings], Backend]] = {"sim": _sim, "hf": _hf}


def create_backend(settings: EngineSettings) -> Backend:
    factory = BACKENDS.get(settings.backend)
    if factory is None:
        raise ValueError(f"unknown backend {settings.backend!r}; choose one of {sorted(BACKENDS)}")
    return factory(settings)
