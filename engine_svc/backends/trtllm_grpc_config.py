"""Settings of the `trtllm-grpc` backend (kept apart so the engine's settings import no client code)."""

from __future__ import annotations

from pydantic import Field

from services.config import Section, flag


class TrtllmGrpcConfig(Section):
    """A TensorRT-LLM gRPC server (`trtllm-serve --grpc`) this engine forwards to."""

    model: str = Field("", description="the model name to report (default: the server's model id)",
                       json_schema_extra=flag(None))   # set by the engine's --model
    address: str = Field("127.0.0.1:8001", min_length=1, description="host:port of the TrtllmService server")
    connect_timeout: float = Field(30.0, gt=0, description="seconds to wait for the server at start")
    health_interval: float = Field(5.0, ge=0, description="seconds between HealthCheck probes (0 = none)")
    health_timeout: float = Field(2.0, gt=0, description="seconds a HealthCheck probe may take")
    kv_events: bool = Field(True, description="subscribe to the server's KV-cache events")
    max_batch_size: int = Field(0, ge=0, description="requests the server runs at once (0 = the server's "
                                                     "GetModelInfo max_batch_size, else 256)")
