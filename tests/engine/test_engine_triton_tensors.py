"""The `triton` backend's tensors: what it sends for a request, and what it refuses (no server)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

pytest.importorskip("tritonclient.grpc", reason="the triton extra (tritonclient) is not installed")

from tritonclient.grpc import InferInput, InferRequestedOutput

from engine_svc.backends.triton_config import TritonConfig
from engine_svc.backends.triton_tensors import ModelInterface, TensorBuilder, stop_words
from services.errors import InvalidArgument, Reason
from tests.engine.engine_testkit import req

FULL = {"input_ids", "input_lengths", "request_output_len", "end_id", "pad_id", "streaming", "stop",
        "stop_words_list", "temperature", "runtime_top_k", "runtime_top_p", "random_seed", "beam_width",
        "exclude_input_in_output"}


def builder(inputs: set[str] = FULL, **config: Any) -> TensorBuilder:
    return TensorBuilder(TritonConfig(**config), ModelInterface(frozenset(inputs), True), InferInput,
                         InferRequestedOutput)


def tensors(item: dict[str, Any]) -> dict[str, tuple[str, list[int]]]:
    return {t.name(): (t.datatype(), t.shape()) for t in item["inputs"]}


def test_stop_words_list_layout() -> None:
    words = stop_words([7, 9, 11])
    assert words.shape == (1, 2, 3) and words.dtype == np.int32
    assert words[0].tolist() == [[7, 9, 11], [1, 2, 3]]   # ids, cumulative end offsets


def test_a_greedy_request_with_eos_and_stop_ids() -> None:
    b = builder(end_id=5)
    request = req("r", [1, 2, 3], max_tokens=9, eos_token_ids=[50, 51], stop_token_ids=[60])
    item = b.request(request, "r#1")
    shapes = tensors(item)
    assert item["request_id"] == "r#1" and item["model_name"] == "tensorrt_llm" and "parameters" not in item
    assert shapes["input_ids"] == ("INT32", [1, 3]) and shapes["request_output_len"] == ("INT32", [1, 1])
    assert shapes["streaming"] == ("BOOL", [1, 1]) and shapes["runtime_top_k"] == ("INT32", [1, 1])
    assert shapes["stop_words_list"] == ("INT32", [1, 2, 2])   # 51 and 60: the end id (50) travels alone
    assert "stop" not in shapes and "temperature" not in shapes
    assert b.end_id(request) == 50 and b.stop_ids(request) == {50, 51, 60}
    stop = tensors(b.request(request, "r#1", stop=True))
    assert stop["stop"] == ("BOOL", [1, 1])


def test_ignore_eos_sends_no_end_id_and_the_fallback_end_id_counts() -> None:
    b = builder(end_id=5)
    assert b.end_id(req("i", [1], eos_token_ids=[50], ignore_eos=True)) == -1
    assert "end_id" not in tensors(b.request(req("i", [1], eos_token_ids=[50], ignore_eos=True), "i#1"))
    assert b.stop_ids(req("f", [1])) == {5}
    assert builder().stop_ids(req("n", [1])) == frozenset()


def test_sampling_and_the_seed_name_follow_the_model() -> None:
    sampled = req("s", [1], temperature=0.8, top_p=0.5, top_k=3, seed=9)
    assert {"temperature", "runtime_top_p", "runtime_top_k", "random_seed"} <= tensors(
        builder().request(sampled, "s#1")).keys()
    renamed = builder((FULL - {"random_seed"}) | {"seed"})
    assert "seed" in tensors(renamed.request(sampled, "s#1"))
    bare = builder({"input_ids", "input_lengths", "request_output_len"}, request_id_parameter="rid")
    bare.check(req("g", [1]))   # greedy needs nothing
    item = bare.request(req("g", [1]), "g#1")
    assert set(tensors(item)) == {"input_ids", "input_lengths", "request_output_len"}
    assert item["parameters"] == {"rid": "g#1"}
    with pytest.raises(InvalidArgument) as refused:
        bare.check(sampled)
    assert refused.value.reason == Reason.UNSUPPORTED_SAMPLING
    assert "temperature" in refused.value.message and "random_seed" in refused.value.message


def test_the_model_interface_from_its_config() -> None:
    config = {"config": {"input": [{"name": "input_ids"}, {"name": "stop"}],
                         "model_transaction_policy": {"decoupled": True}}}
    assert ModelInterface.from_config(config) == ModelInterface(frozenset({"input_ids", "stop"}), True)
    assert not ModelInterface.from_config({"input": []}).decoupled
