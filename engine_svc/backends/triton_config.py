"""Settings of the `triton` backend (kept apart so the engine's settings import no client code)."""

from __future__ import annotations

from pydantic import Field

from services.config import Section, flag


class TritonConfig(Section):
    """A Triton Inference Server running TensorRT-LLM's backend (a decoupled ``tensorrt_llm`` model)."""

    model: str = Field("", description="the model name to report (default: --triton-model-name)",
                       json_schema_extra=flag(None))   # set by the engine's --model
    url: str = Field("127.0.0.1:8001", min_length=1, description="host:port of Triton's gRPC endpoint")
    model_name: str = Field("tensorrt_llm", min_length=1, description="the Triton model taking token ids "
                                                                      "(TensorRT-LLM's C++ backend model)")
    end_id: int = Field(-1, ge=-1, description="end id sent when a request names no EOS id (-1 = send none)")
    pad_id: int = Field(-1, ge=-1, description="pad id (-1 = the end id)")
    max_context: int = Field(0, ge=0, description="the model's context, prompt + max_tokens (0 = not checked "
                                                  "here; Triton rejects what is too long)")
    vocab_size: int = Field(0, ge=0, description="vocabulary size for checking prompt ids (0 = not checked)")
    max_batch_size: int = Field(64, ge=1, description="requests the model runs at once (reported as capacity)")
    connect_timeout: float = Field(30.0, gt=0, description="seconds to wait at start for the model to be ready")
    health_interval: float = Field(5.0, ge=0, description="seconds between readiness probes (0 = none)")
    stop_timeout: float = Field(5.0, gt=0, description="seconds a stopped request's stream may take to close "
                                                       "before it is cancelled")
    request_id_parameter: str = Field("", description="also send each request's id as this request parameter "
                                                      "(for Python models, which cannot read Triton's request "
                                                      "id; empty = none)")
