"""engine_svc settings (flags > TOKENRELAY_ENGINE_* environment variables > defaults)."""

from __future__ import annotations

from dataclasses import dataclass

from services.config import setting

from .backends.hf import HfConfig
from .backends.sim import SimConfig

_SIM = SimConfig()
_HF = HfConfig()


@dataclass
class EngineSettings:
    """engine_svc: token ids in, token ids streamed out, behind one backend interface."""

    host: str = setting("127.0.0.1", "address to bind")
    port: int = setting(0, "port to bind (0 = ephemeral; see --port-file)")
    port_file: str = setting("", "write the bound port here once serving")
    backend: str = setting("sim", "engine backend: sim | hf")
    model: str = setting("", "hf: model directory (config.json + safetensors); "
                             f"sim: the model name to report (default {_SIM.model})")
    max_queued: int = setting(1024, "requests that may wait beyond the running batch; more are "
                                    "rejected with ENGINE_OVERLOADED")

    sim_max_batch_size: int = setting(_SIM.max_batch_size, "sim: requests decoded per step")
    sim_max_num_tokens: int = setting(_SIM.max_num_tokens, "sim: prompt tokens admitted per step")
    sim_num_blocks: int = setting(_SIM.num_blocks, "sim: KV cache blocks")
    sim_tokens_per_block: int = setting(_SIM.tokens_per_block, "sim: tokens per KV block")
    sim_vocab_size: int = setting(_SIM.vocab_size, "sim: vocabulary size of generated ids")
    sim_max_context: int = setting(_SIM.max_context, "sim: model context (prompt + max_tokens)")
    sim_prefill_time_per_token: float = setting(_SIM.prefill_time_per_token,
                                                "sim: seconds per uncached prompt token")
    sim_decode_step_time: float = setting(_SIM.decode_step_time, "sim: fixed seconds per decode step")
    sim_decode_time_per_seq: float = setting(_SIM.decode_time_per_seq,
                                             "sim: extra decode-step seconds per running request")
    sim_eos_probability: float = setting(_SIM.eos_probability,
                                         "sim: chance per token of emitting the request's EOS id")

    hf_device: str = setting(_HF.device, "hf: torch device (cpu, cuda, cuda:1, ...)")
    hf_dtype: str = setting(_HF.dtype, "hf: float32 | bfloat16 | float16 | auto (the checkpoint's)")
    hf_threads: int = setting(_HF.threads, "hf: torch.set_num_threads (0 = torch's default)")
    hf_num_blocks: int = setting(_HF.num_blocks, "hf: KV cache blocks")
    hf_block_size: int = setting(_HF.block_size, "hf: tokens per KV block (page)")
    hf_max_batch_tokens: int = setting(_HF.max_batch_tokens, "hf: tokens per forward pass")
    hf_max_batch_size: int = setting(_HF.max_batch_size, "hf: requests per forward pass")
    hf_random_weights: bool = setting(False, "hf: build the model from config.json with random weights "
                                             "(capacity tests of a model shape; outputs are noise)")
    hf_sampling: bool = setting(_HF.sampling, "hf: allow temperature > 0 (per-request temperature, "
                                              "top_p, top_k); off = a greedy-only engine")

    metrics_port: int = setting(-1, "Prometheus /metrics port (0 = ephemeral, -1 = off)")
    metrics_port_file: str = setting("", "write the bound metrics port here")
    otlp_endpoint: str = setting("", "OTLP gRPC endpoint for traces (empty = no export)")
    log_level: str = setting("INFO", "log level")
    log_format: str = setting("json", "json | console")
    shutdown_grace: float = setting(10.0, "seconds in-flight streams get to finish on SIGTERM")
