"""Engine backends behind one interface, and the registry that builds one by name.

Factories import their backend lazily, so `sim` never imports torch.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

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
from .events import HealthState, IterationStats, KvBlock, KvEvent, KvEventType

if TYPE_CHECKING:
    from ..config import EngineSettings
    from .hf import HfConfig
    from .sim import SimConfig

__all__ = ["BACKENDS", "Backend", "FinishReason", "GenerationEvent", "GenerationRequest", "HealthState",
           "IterationStats", "KvBlock", "KvEvent", "KvEventType", "LoadSnapshot", "PrefixCacheStats", "Sink",
           "StepObserver", "StepStats", "create_backend"]


def _sim(config: SimConfig) -> Backend:
    from .sim import SimBackend

    return SimBackend(config)


def _hf(config: HfConfig) -> Backend:
    from .hf import HfBackend

    missing = [name for name in ("torch", "transformers") if importlib.util.find_spec(name) is None]
    if missing:  # a ValueError is reported in one line, before anything starts
        raise ValueError(f"--backend hf needs the 'hf' extra ({', '.join(missing)} not installed): "
                         "pip install 'tokenrelay[hf]'")
    if not config.model:
        raise ValueError("the hf backend needs --model (a Hugging Face model directory)")
    return HfBackend(config)


# Each factory takes its backend's own section of the engine settings (`EngineSettings.backend_config`).
BACKENDS: dict[str, Callable[[Any], Backend]] = {"sim": _sim, "hf": _hf}


def _needs(backend: str, extra: str, modules: tuple[str, ...]) -> None:
    missing = [name for name in modules if importlib.util.find_spec(name) is None]
    if missing:  # a ValueError is reported in one line, before anything starts
        raise ValueError(f"--backend {backend} needs the '{extra}' extra ({', '.join(missing)} not installed): "
                         f"pip install 'tokenrelay[{extra}]'")


def _trtllm_grpc(config: Any) -> Backend:
    _needs("trtllm-grpc", "trtllm-grpc", ("smg_grpc_proto",))
    from .trtllm_grpc import TrtllmGrpcBackend

    return TrtllmGrpcBackend(config)


def _triton(config: Any) -> Backend:
    _needs("triton", "triton", ("tritonclient", "numpy"))
    from .triton import TritonBackend

    return TritonBackend(config)


BACKENDS.update({"trtllm-grpc": _trtllm_grpc, "triton": _triton})


def _trtllm(config: Any) -> Backend:
    _needs("trtllm", "trtllm", ("tensorrt_llm",))
    from .trtllm import TrtllmBackend

    return TrtllmBackend(config)


BACKENDS["trtllm"] = _trtllm


def create_backend(settings: EngineSettings) -> Backend:
    factory = BACKENDS.get(settings.backend)
    if factory is None:
        raise ValueError(f"unknown backend {settings.backend!r}; choose one of {sorted(BACKENDS)}")
    return factory(settings.backend_config())
