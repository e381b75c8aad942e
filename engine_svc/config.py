"""engine_svc settings: flags > TOKENRELAY_ENGINE_* environment > config file > defaults.

Each backend's section is that backend's own config model (`SimConfig`, `HfConfig`), so a knob is
declared once: its type, range, default and help live next to the code that uses it.
"""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field, model_validator

from services.config import MaskedUrl, Section, ServiceSettings, conflict, flag, section

from .backends.hf import HfConfig
from .backends.sim import SimConfig
from .backends.triton_config import TritonConfig
from .backends.trtllm_config import TrtllmConfig
from .backends.trtllm_grpc_config import TrtllmGrpcConfig


class RegistrySettings(Section):
    """The replica registry: this engine's entry in the routers' Redis (engine_svc/registration.py)."""

    redis_url: MaskedUrl = Field("", description="Redis of the routers' admission pool (their --redis-url) to "
                                                 "register this engine in (empty = not registered; routers then "
                                                 "need it in their --engines)")
    pool: str = Field("default", min_length=1, max_length=64, pattern=r"^[A-Za-z0-9._-]+$",
                      description="the routers' admission pool (their --pool): the registry's Redis key "
                                  "tq:{pool}:engines shares its hash tag")
    engine_pool: str = Field("default", min_length=1, max_length=64, pattern=r"^[A-Za-z0-9._-]+$",
                             json_schema_extra=flag("engine_pool"),
                             description="this engine's traffic pool (routers' --traffic-split names pools)")
    advertise_address: str = Field("", max_length=256, json_schema_extra=flag("advertise_address"),
                                   description="the host:port routers should dial (empty = the bound host and "
                                               "port; a wildcard host becomes this machine's name)")
    heartbeat: float = Field(1.0, ge=0.05, le=60, description="seconds between writes of the entry (and at once "
                                                              "when the health changes)")
    ttl: float = Field(3.0, ge=0.1, le=600, description="seconds the entry lives without a heartbeat: routers drop "
                                                        "an engine that stops beating after this")

    @model_validator(mode="after")
    def _ttl_covers_beats(self) -> RegistrySettings:
        if self.ttl < 2 * self.heartbeat:
            raise conflict("--registry-ttl must be at least twice --registry-heartbeat", "ttl", "heartbeat")
        return self


class EngineSettings(ServiceSettings):
    """engine_svc: token ids in, token ids streamed out, behind one backend interface."""

    ENV_PREFIX: ClassVar[str] = "TOKENRELAY_ENGINE_"
    PROG: ClassVar[str] = "engine_svc"

    backend: Literal["sim", "hf", "trtllm", "trtllm-grpc", "triton"] = Field("sim", description="engine backend")
    model: str = Field("", description="hf: model directory (config.json + safetensors); sim: the model name "
                                       f"to report (default {SimConfig().model})")
    max_queued: int = Field(1024, ge=0, description="requests that may wait beyond the running batch; more "
                                                    "are rejected with OVERLOADED")
    frame_port: int = Field(-1, ge=-1, le=65535, json_schema_extra=flag("frame_port"),
                            description="also serve the routers' stream as framed protobuf on this plaintext TCP "
                                        "port of the same host (0 = any free port, -1 = off; told to routers in "
                                        "load polls; they use it when their engine channels are plaintext and "
                                        "fall back to gRPC when it does not answer): a message each way costs "
                                        "fewer thread hand-offs than over gRPC (services/frames.py). Only with "
                                        "--security-mode plaintext")
    sim: SimConfig = section(SimConfig, "sim backend", prefix="sim_")
    hf: HfConfig = section(HfConfig, "hf backend", prefix="hf_")
    trtllm: TrtllmConfig = section(TrtllmConfig, "trtllm backend (TensorRT-LLM's LLM API in process)", prefix="trtllm_")
    trtllm_grpc: TrtllmGrpcConfig = section(TrtllmGrpcConfig, "trtllm-grpc backend (a trtllm-serve --grpc server)",
                                            prefix="trtllm_grpc_")
    triton: TritonConfig = section(TritonConfig, "triton backend (Triton with the TensorRT-LLM backend)",
                                   prefix="triton_")
    registry: RegistrySettings = section(RegistrySettings, "replica registry (routers' --engine-registry)",
                                         prefix="registry_")

    @model_validator(mode="after")
    def _frames_are_plaintext(self) -> EngineSettings:
        if self.frame_port >= 0 and self.security.mode != "plaintext":
            raise conflict("--frame-port serves plaintext only: turn it off (-1) with --security-mode "
                           f"{self.security.mode}", "frame_port", "security.mode")
        return self

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
