"""The `triton` backend's one edge with TensorRT-LLM's Triton tensors: requests in, token ids out.

Tensor names and shapes are those of tensorrtllm_backend's ``tensorrt_llm`` model (see
``trtllm-api.md``): every input has a leading batch dimension of 1. Optional inputs are sent only
when the deployed model declares them (read once from `get_model_config`), so a model that names its
seed ``seed`` rather than ``random_seed`` works, and one without sampling inputs refuses sampled
requests with UNSUPPORTED_SAMPLING instead of silently decoding greedily.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from services.errors import Reason

from .base import GenerationRequest
from .triton_config import TritonConfig

# Triton dtype names of the inputs this module may send.
_INPUT_DTYPES = {
    "input_ids": "INT32", "input_lengths": "INT32", "request_output_len": "INT32", "end_id": "INT32",
    "pad_id": "INT32", "beam_width": "INT32", "runtime_top_k": "INT32", "temperature": "FP32",
    "runtime_top_p": "FP32", "random_seed": "UINT64", "seed": "UINT64", "stop_words_list": "INT32",
    "streaming": "BOOL", "stop": "BOOL", "exclude_input_in_output": "BOOL",
}
_NUMPY = {"INT32": np.int32, "FP32": np.float32, "UINT64": np.uint64, "BOOL": np.bool_}


@dataclass(frozen=True, slots=True)
class ModelInterface:
    """What the deployed model accepts: its input names and whether it streams (decoupled)."""

    inputs: frozenset[str]
    decoupled: bool

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> ModelInterface:
        body = config.get("config", config)
        names = frozenset(str(i["name"]) for i in body.get("input", []))
        decoupled = bool(body.get("model_transaction_policy", {}).get("decoupled", False))
        return cls(names, decoupled)


def stop_words(ids: list[int]) -> np.ndarray:
    """``stop_words_list`` [1, 2, W]: row 0 the words' ids, row 1 their cumulative end offsets (-1 padded)."""
    flat = np.array([ids], dtype=np.int32)
    offsets = np.array([list(range(1, len(ids) + 1))], dtype=np.int32)
    return np.stack([flat, offsets], axis=1)


class TensorBuilder:
    """Builds the `stream_infer` request dicts of one model (tritonclient imported by the caller)."""

    def __init__(self, config: TritonConfig, interface: ModelInterface, infer_input: Any,
                 requested_output: Any) -> None:
        self.config = config
        self.interface = interface
        self._infer_input = infer_input
        self._outputs = [requested_output("output_ids"), requested_output("sequence_length")]
        self.seed_name = next((n for n in ("random_seed", "seed") if n in interface.inputs), "")

    def end_id(self, request: GenerationRequest) -> int:
        if request.ignore_eos:
            return -1
        return request.eos_token_ids[0] if request.eos_token_ids else self.config.end_id

    def stop_ids(self, request: GenerationRequest) -> frozenset[int]:
        """The ids that end the request in the server (sent as end id or stop words)."""
        end_id = self.end_id(request)
        return request.stop_set() | {end_id} if end_id >= 0 else request.stop_set()

    def check(self, request: GenerationRequest) -> None:
        """Refuse what the deployed model cannot do (raises UNSUPPORTED_SAMPLING)."""
        missing: list[str] = []
        if request.temperature > 0:
            wanted = (("temperature", True), ("runtime_top_p", request.top_p > 0), ("runtime_top_k", request.top_k > 0))
            missing = [name for name, asked in wanted if asked and name not in self.interface.inputs]
            if request.seed is not None and not self.seed_name:
                missing.append("random_seed")
        if missing:  # greedy needs nothing: TensorRT-LLM's default sampling is greedy
            raise Reason.UNSUPPORTED_SAMPLING.error(
                f"Triton model {self.config.model_name!r} has no input {', '.join(missing)}")

    def request(self, request: GenerationRequest, wire_id: str, *, stop: bool = False) -> dict[str, Any]:
        """One `stream_infer` item: the generation itself, or (``stop``) the request that ends it."""
        cfg = self.config
        values: dict[str, Any] = {
            "input_ids": [request.prompt_token_ids],
            "input_lengths": [[len(request.prompt_token_ids)]],
            "request_output_len": [[request.max_tokens]],
            "streaming": [[True]],
            "beam_width": [[1]],
            "exclude_input_in_output": [[True]],
        }
        end_id = self.end_id(request)
        if end_id >= 0:
            values["end_id"] = [[end_id]]
            pad = cfg.pad_id if cfg.pad_id >= 0 else end_id
            values["pad_id"] = [[pad]]
        words = sorted(request.stop_set() - {end_id})
        if words:
            values["stop_words_list"] = stop_words(words)
        if request.temperature > 0:
            values["temperature"] = [[request.temperature]]
            if request.top_p > 0:
                values["runtime_top_p"] = [[request.top_p]]
            if request.top_k > 0:
                values["runtime_top_k"] = [[request.top_k]]
            if request.seed is not None and self.seed_name:
                values[self.seed_name] = [[request.seed & 0xFFFFFFFFFFFFFFFF]]
        else:
            values["runtime_top_k"] = [[1]]  # greedy
        if stop:
            values["stop"] = [[True]]
        required = {"input_ids", "input_lengths", "request_output_len"}
        inputs = [self._tensor(name, value) for name, value in values.items()
                  if name in required or name in self.interface.inputs]
        item: dict[str, Any] = {"model_name": cfg.model_name, "inputs": inputs, "outputs": self._outputs,
                                "request_id": wire_id}
        if cfg.request_id_parameter:
            item["parameters"] = {cfg.request_id_parameter: wire_id}
        return item

    def _tensor(self, name: str, value: Any) -> Any:
        dtype = _INPUT_DTYPES[name]
        array: np.ndarray = np.asarray(value, dtype=_NUMPY[dtype])
        tensor = self._infer_input(name, list(array.shape), dtype)
        tensor.set_data_from_numpy(array)
        return tensor


def response_tokens(result: Any) -> tuple[list[int], bool]:
    """The new token ids of one streamed response (beam 0, padding dropped) and its final flag."""
    ids = result.as_numpy("output_ids")
    tokens: list[int] = []
    if ids is not None and ids.size:
        tokens = [int(t) for t in ids.reshape(-1, ids.shape[-1])[0] if t >= 0]
    params = result.get_response().parameters
    final = "triton_final_response" in params and bool(params["triton_final_response"].bool_param)
    return tokens, final
