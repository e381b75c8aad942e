"""engine_svc settings: flags > TOKENRELAY_ENGINE_* environment > config file > defaults.

Each backend's section is that backend's own config model (`SimConfig`, `HfConfig`), so a knob is
declared once: its type, range, default and help live next to the code that uses it.
"""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field, model_validator

from services.config import ServiceSettings, conflict, section

from .backends.hf import HfConfig
from .backends.sim import SimConfig
from .backends.triton_config import TritonConfig
from .backends.trtllm_config import TrtllmConfig
from .backends.trtllm_grpc_config import TrtllmGrpcConfig


class EngineSettings(ServiceSettings):
    """engine_svc: token ids in, token ids streamed out, behind one backend interface."""

    ENV_PREFIX: ClassVar[str] = "TOKENRELAY_ENGINE_"
    PROG: ClassVar[str] = "engine_svc"

    backend: Literal["sim", "hf", "trtllm", "trtllm-grpc", "triton"] = Field("sim", description="engine backend")
    model: str = Field("", description="hf: model directory (config.json + safetensors); sim: the model name "
                                       f"to report (default {SimConfig().model})")
    max_queued: int = Field(1024, ge=0, description="requests that may wait beyond the running batch; more "
                                                    "are rejected with OVERLOADED")
    sim: SimConfig = section(SimConfig, "sim backend", prefix="sim_")
    hf: HfConfig = section(HfConfig, "hf backend", prefix="hf_")
    trtllm: TrtllmConfig = section(TrtllmConfig, "trtllm backend (TensorRT-LLM's LLM API in process)", prefix="trtllm_")
    trtllm_grpc: TrtllmGrpcConfig = section(TrtllmGrpcConfig, "trtllm-grpc backend (a trtllm-serve --grpc server)",
                                            prefix="trtllm_grpc_")
    triton: TritonConfig = section(TritonConfig, "triton backend (Triton with the TensorRT-LLM backend)",
                                   prefix="triton_")

    @model_validator(mode="after")
    def _hf_needs_a_model(self) -> EngineSettings:
        if self.backend == "hf" and not (self.model or self.hf.model):
            raise conflict("the hf backend needs --model (a Hugging Face model directory)", "model", "backend")
        return self

    def backend_config(self) -> SimConfig | HfConfig | TrtllmConfig | TrtllmGrpcConfig | TritonConfig:
        """The selected backend's section, with --model applied when given."""
        config: SimConfig | HfConfig = self.sim if self.backend == "sim" else self.hf
        if self.backend in ("trtllm", "trtllm-grpc", "triton"):   # sections named after their backend
            remote: TrtllmConfig | TrtllmGrpcConfig | TritonConfig = getattr(self, self.backend.replace("-", "_"))
            return remote.model_copy(update={"model": self.model}) if self.model else remote
        return config.model_copy(update={"model": self.model}) if self.model else config
