"""A real Triton Inference Server (NVIDIA PyTriton) serving a fake model with the tensorrt_llm tensor interface.

Run as a process of its own (``python tests/fakes/triton_trtllm_server.py --port-file F``): it binds
ephemeral ports, writes the gRPC port to ``F`` once the model is loaded, and serves until SIGTERM.

The model ``tensorrt_llm`` is decoupled (streaming): it takes the inputs of TensorRT-LLM's Triton
backend (``input_ids`` [1, N], ``input_lengths``, ``request_output_len``, ``end_id``, ``streaming``,
``stop``, ``stop_words_list`` [1, 2, W], sampling scalars) and streams ``output_ids`` [1, 1, k] and
``sequence_length`` [1, 1] responses, one token each. Token k of a request is
``(input_ids[-1] + k + 1) % VOCAB``, so a test can place an end id or stop id on the path. Behaviours a
test asks for through the prompt's first token: ``ERROR_AFTER_2`` fails the request after two tokens.
``STEP_SECONDS`` paces tokens like an engine step (the engine's speed, not a synchronisation).
A request with ``stop`` true ends the live generation whose ``tokenrelay_request_id`` parameter
matches (Python models cannot read Triton's request id, hence the parameter).
The model ``live_requests`` answers how many generations are running (``count`` [1]), so a test can
see that a stopped request really ended inside the server.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import pathlib
import signal
import socket

import numpy as np
from pytriton.model_config import ModelConfig, Tensor
from pytriton.triton import Triton, TritonConfig

VOCAB = 1000
ERROR_AFTER_2 = 999
STEP_SECONDS = 0.002

_live: dict[str, asyncio.Event] = {}


def _scalar(request, name: str, default):
    value = request.data.get(name)
    return default if value is None else value.reshape(-1)[0].item()


def _stop_ids(request) -> set[int]:
    words = request.data.get("stop_words_list")
    if words is None:
        return set()
    flat, offsets = words.reshape(2, -1)
    ids, start = set(), 0
    for end in offsets:
        if end < 0:
            break
        if end - start == 1:  # single-token stop words only: enough for the fake
            ids.add(int(flat[start]))
        start = int(end)
    return ids


def _response(tokens: list[int]) -> dict[str, np.ndarray]:
    return {"output_ids": np.array([[tokens]], dtype=np.int32),
            "sequence_length": np.array([[len(tokens)]], dtype=np.int32)}


async def generate(requests):
    request = requests[0]
    rid = str((request.parameters or {}).get("tokenrelay_request_id", ""))
    if _scalar(request, "stop", False):
        stopping = _live.get(rid)
        if stopping is not None:
            stopping.set()
        return
    prompt = request.data["input_ids"].reshape(-1).tolist()
    max_tokens = int(_scalar(request, "request_output_len", 16))
    end_id = int(_scalar(request, "end_id", -1))
    stop_ids = _stop_ids(request) | {end_id}
    stop = _live[rid] = asyncio.Event()
    try:
        last = prompt[-1]
        for k in range(max_tokens):
            if prompt[0] == ERROR_AFTER_2 and k == 2:
                raise RuntimeError("fake engine failure mid-stream")
            try:
                await asyncio.wait_for(stop.wait(), STEP_SECONDS)
                return  # stopped: Triton closes the request with the final flag
            except asyncio.TimeoutError:
                pass
            token = (last + k + 1) % VOCAB
            yield [_response([token])]
            if token in stop_ids:
                return
    finally:
        if _live.get(rid) is stop:
            del _live[rid]


def live_requests(requests):
    return [{"count": np.array([len(_live)], dtype=np.int32)} for _ in requests]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port-file", required=True, type=pathlib.Path)
    parser.add_argument("--workspace", type=pathlib.Path, help="PyTriton's workspace (default: a new one "
                                                               "under ~/.cache/pytriton)")
    parser.add_argument("--grpc-port", type=int, default=0, help="gRPC port (default: a free one); a restart "
                                                                 "on the same port is a restarted server")
    args = parser.parse_args()
    grpc_port = args.grpc_port or _free_port()
    config = TritonConfig(grpc_port=grpc_port, grpc_address="127.0.0.1", http_port=_free_port(),
                          http_address="127.0.0.1", allow_metrics=False, log_verbose=0, exit_timeout_secs=1)
    scalar_i32 = ("input_lengths", "request_output_len", "end_id", "pad_id", "beam_width", "runtime_top_k")
    inputs = [Tensor(name="input_ids", dtype=np.int32, shape=(-1, -1))]
    inputs += [Tensor(name=name, dtype=np.int32, shape=(-1, 1), optional=name != "input_lengths")
               for name in scalar_i32]
    inputs += [Tensor(name=name, dtype=np.float32, shape=(-1, 1), optional=True)
               for name in ("temperature", "runtime_top_p")]
    inputs += [Tensor(name="random_seed", dtype=np.uint64, shape=(-1, 1), optional=True),
               Tensor(name="stop_words_list", dtype=np.int32, shape=(-1, 2, -1), optional=True)]
    inputs += [Tensor(name=name, dtype=np.bool_, shape=(-1, 1), optional=True)
               for name in ("streaming", "stop", "exclude_input_in_output")]
    outputs = [Tensor(name="output_ids", dtype=np.int32, shape=(-1, -1, -1)),
               Tensor(name="sequence_length", dtype=np.int32, shape=(-1, -1))]
    with Triton(config=config, workspace=args.workspace) as triton:
        triton.bind(model_name="tensorrt_llm", infer_func=generate, inputs=inputs, outputs=outputs,
                    config=ModelConfig(batching=False, decoupled=True), strict=False)
        triton.bind(model_name="live_requests", infer_func=live_requests, inputs=[],
                    outputs=[Tensor(name="count", dtype=np.int32, shape=(1,))],
                    config=ModelConfig(batching=False))
        triton.run()
        tmp = args.port_file.with_suffix(".tmp")
        tmp.write_text(str(grpc_port))
        os.replace(tmp, args.port_file)
        signal.sigwait({signal.SIGTERM, signal.SIGINT})


if __name__ == "__main__":
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGINT})
    main()
