"""A naive monolithic server: the baseline of the starvation bench (bench/bench_starvation.py).

One process, one event loop, built the way naive servers are: the Inference.Generate handler
tokenizes the prompt inline (`tokenizer.encode` on the event loop), submits the ids to the same
simulated engine engine_svc runs (`engine_svc.backends.create_backend`, same settings), and
decodes each new token inline. While it encodes a 32k-token prompt nothing else on the loop runs:
not the engine's step loop, not the other streams. That is what is measured, so this file breaks
the house rule "CPU-bound work never on the event loop" on purpose. No auth: any key is accepted.

A sampler thread records (monotonic time, engine active, queued, prompt tokens admitted, engine
busy seconds charged by the cost model) every `--sample-interval` seconds and writes them to
`--load-trace` as JSON at shutdown. `Tokenizer.encode` holds the GIL, so the sampler pauses during
an encode; the backend cannot change state then either (only the blocked loop mutates it), so the
last sample before the pause stays true for all of it. CLOCK_MONOTONIC is system-wide on Linux, so
the bench lines these samples up with its own client timestamps.

    python bench/monolith.py --tokenizer DIR_OR_JSON --port 0 --port-file F --load-trace T.json
"""

from __future__ import annotations

import asyncio
import json
import os
import pathlib
import sys
import threading
import time
import uuid
from typing import ClassVar, Literal

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

from pydantic import Field
from tokenizers import Tokenizer

from engine_svc.backends import Backend, GenerationEvent, GenerationRequest, StepStats, create_backend
from engine_svc.backends.sim import SimConfig
from engine_svc.config import EngineSettings
from services.config import Settings, load_settings
from services.grpc_util import GrpcServer, wait_for_shutdown_signal, write_port_file
from services.logging import configure_logging
from services.proto.tokenrelay.v1 import common_pb2, inference_pb2, inference_pb2_grpc
from services.wire import FINISH_CODES


class MonolithSettings(Settings):
    """Naive monolith: inline tokenization + the sim engine in one process (bench baseline)."""

    ENV_PREFIX: ClassVar[str] = "TOKENRELAY_MONOLITH_"
    PROG: ClassVar[str] = "python bench/monolith.py"

    tokenizer: str = Field("", description="model directory or tokenizer.json (required)")
    host: str = Field("127.0.0.1", description="address to bind")
    port: int = Field(0, ge=0, le=65535, description="port to bind (0 = ephemeral; see --port-file)")
    port_file: str = Field("", description="write the bound port here once serving")
    sim_max_context: int = Field(40_960, ge=1, description="sim: model context (prompt + max_tokens)")
    sim_vocab_size: int = Field(0, ge=0, description="sim: vocabulary of generated ids (0 = the tokenizer's)")
    sim_prefill_time_per_token: float = Field(SimConfig().prefill_time_per_token, ge=0,
                                              description="sim: seconds per uncached prompt token")
    load_trace: str = Field("", description="write the engine load samples here (JSON) at shutdown")
    sample_interval: float = Field(0.01, gt=0, description="seconds between engine load samples")
    log_level: str = Field("WARNING", description="log level")
    log_format: Literal["json", "console"] = Field("console", description="log format")
    shutdown_grace: float = Field(5.0, ge=0, description="seconds in-flight streams get to finish on SIGTERM")


class LoadSampler:
    """Owns the sampling thread; `busy` is fed by the backend's step observer on the loop."""

    def __init__(self, backend: Backend, interval: float) -> None:
        self.backend, self.interval = backend, interval
        self.busy = 0.0
        self.samples: list[tuple[float, int, int, int, float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="load-sampler", daemon=True)
        backend.step_observer = self._on_step

    def _on_step(self, step: StepStats) -> None:
        self.busy += step.prefill_seconds + step.decode_seconds

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            load = self.backend.load()
            self.samples.append((time.monotonic(), load.active, load.queued, load.prompt_tokens_total,
                                 self.busy))

    def start(self) -> None:
        self._thread.start()

    def close(self, path: str) -> None:
        self._stop.set()
        self._thread.join()
        if path:
            tmp = f"{path}.tmp"
            with open(tmp, "w") as f:
                json.dump({"samples": self.samples}, f)
            os.replace(tmp, path)


class MonolithServicer(inference_pb2_grpc.InferenceServicer):
    def __init__(self, tokenizer: Tokenizer, backend: Backend, eos_ids: list[int]) -> None:
        self.tokenizer, self.backend, self.eos_ids = tokenizer, backend, eos_ids

    async def Generate(self, request: inference_pb2.GenerateRequest, context: object):  # type: ignore[no-untyped-def]
        t0 = time.monotonic()
        ids = self.tokenizer.encode(request.prompt).ids  # inline, on the event loop: the naive way
        t_tok = time.monotonic()
        s = request.sampling
        req = GenerationRequest(request.request_id or uuid.uuid4().hex, ids, s.max_tokens,
                                stop_token_ids=list(s.stop_token_ids), eos_token_ids=self.eos_ids,
                                ignore_eos=s.ignore_eos)
        events: asyncio.Queue[GenerationEvent] = asyncio.Queue()
        self.backend.validate(req)
        # Submitted before `accepted` is sent, so the bench may read `accepted` as "the engine has it".
        self.backend.submit(req, events.put_nowait)
        generated, cached, reason, t_first, finished = 0, 0, "length", None, False
        try:
            yield inference_pb2.GenerateResponse(accepted=inference_pb2.Accepted(
                request_id=req.request_id, prompt_tokens=len(ids)))
            while not finished:
                event = await events.get()
                finished = event.finished
                cached = cached or event.cached_tokens
                reason = event.finish_reason.value if event.finish_reason else reason
                if event.token_ids:
                    t_first = t_first or time.monotonic()
                    generated += len(event.token_ids)
                    delta = inference_pb2.Delta(text=self.tokenizer.decode(event.token_ids))
                    if request.return_token_ids:
                        delta.token_ids.extend(event.token_ids)
                    yield inference_pb2.GenerateResponse(delta=delta)
        finally:
            if not finished:  # the client went away: free the engine's slot
                self.backend.abort(req.request_id)
        now = time.monotonic()
        first = t_first or now
        yield inference_pb2.GenerateResponse(done=inference_pb2.Done(
            finish_reason=FINISH_CODES[reason],
            usage=common_pb2.Usage(prompt_tokens=len(ids), cached_tokens=cached, completion_tokens=generated),
            timings=common_pb2.Timings(ttft_seconds=first - t0, total_seconds=now - t0,
                                       tokenize_seconds=t_tok - t0, decode_seconds=now - first)))


def _eos_ids(tokenizer: Tokenizer) -> list[int]:
    ids = (tokenizer.token_to_id(t) for t in ("</s>", "<|endoftext|>", "<|eot_id|>", "<eos>"))
    return [i for i in ids if i is not None][:1]


async def serve(settings: MonolithSettings) -> None:
    path = pathlib.Path(settings.tokenizer)
    tokenizer = Tokenizer.from_file(str(path / "tokenizer.json" if path.is_dir() else path))
    # The same backend factory and settings as engine_svc, so both sides simulate the same GPU.
    backend = create_backend(EngineSettings(backend="sim", sim=SimConfig(
        max_context=settings.sim_max_context, prefill_time_per_token=settings.sim_prefill_time_per_token,
        vocab_size=settings.sim_vocab_size or tokenizer.get_vocab_size())))
    sampler = LoadSampler(backend, settings.sample_interval)
    await backend.start()
    name = inference_pb2.DESCRIPTOR.services_by_name["Inference"].full_name
    server = GrpcServer(settings.host, settings.port, [name])
    inference_pb2_grpc.add_InferenceServicer_to_server(
        MonolithServicer(tokenizer, backend, _eos_ids(tokenizer)), server.server)
    await server.start()
    sampler.start()
    try:
        write_port_file(settings.port_file, server.port)
        await wait_for_shutdown_signal()
        await server.stop(settings.shutdown_grace)
    finally:
        sampler.close(settings.load_trace)
        await backend.close()


def main(argv: list[str] | None = None) -> None:
    settings = load_settings(MonolithSettings, argv)
    if not settings.tokenizer:
        raise SystemExit("bench/monolith.py: --tokenizer is required")
    configure_logging(settings.log_level, settings.log_format, "monolith")
    asyncio.run(serve(settings))


if __name__ == "__main__":
    main()
