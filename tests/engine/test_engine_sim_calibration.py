"""The sim's `h200-llama8b-fp8` profile reproduces TensorRT-LLM's published H200 throughput for Llama 3.1 8B
FP8 (perf-overview.md, `trtllm-bench throughput`: every request queued at once) within 10%:
27,911 output tokens/s at ISL/OSL 128/128, 17,744 at 1000/1000, 12,194 at 2048/2048.

Each point is checked twice: the cost model's steady state (`predicted_throughput`), and the
backend itself run unpaced (``time_scale=0``: steps run back to back and the simulated seconds
are summed) through its real admission, KV reservation and batching."""

from __future__ import annotations

import asyncio

import pytest

from engine_svc.backends.base import FinishReason, GenerationEvent
from engine_svc.backends.sim import SimBackend
from engine_svc.backends.sim_cost import SimConfig, predicted_throughput, steady_batch
from engine_svc.backends.sim_fit import Run, fit, measure
from tests.engine.engine_testkit import req


class _Counter:
    """A sink that only counts (the runs emit up to 800k tokens; keeping every event costs more
    than the sim's steps)."""

    def __init__(self, requests: int) -> None:
        self.left = requests
        self.tokens = self.lengths = 0
        self.done = asyncio.Event()

    def __call__(self, event: GenerationEvent) -> None:
        self.tokens += len(event.token_ids)
        if event.finished:
            self.lengths += event.finish_reason is FinishReason.LENGTH
            self.left -= 1
            if not self.left:
                self.done.set()


PUBLISHED = {(128, 128): 27_911, (1000, 1000): 17_744, (2048, 2048): 12_194}


@pytest.mark.parametrize(("isl", "osl"), list(PUBLISHED))
def test_the_cost_model_predicts_the_published_throughput(isl: int, osl: int) -> None:
    config = SimConfig(profile="h200-llama8b-fp8")
    predicted = predicted_throughput(config, isl, osl)
    assert predicted == pytest.approx(PUBLISHED[isl, osl], rel=0.10), f"{predicted:.0f} tokens/s"


def test_long_requests_are_bounded_by_kv_capacity() -> None:
    config = SimConfig(profile="h200-llama8b-fp8")
    assert steady_batch(config, 128, 128) == 256                        # the batch cap
    assert steady_batch(config, 2048, 2048) == 25_000 // 128 == 195     # 4,096 tokens reserved each


@pytest.mark.parametrize(("isl", "osl"), list(PUBLISHED))
async def test_running_the_sim_reproduces_the_published_throughput(isl: int, osl: int) -> None:
    config = SimConfig(profile="h200-llama8b-fp8", time_scale=0.0)
    batch = steady_batch(config, isl, osl)
    backend = SimBackend(config)
    await backend.start()
    try:
        # Two full batches of distinct prompts (no prefix reuse, as in trtllm-bench's random-token
        # dataset), all queued at once.
        n = 2 * batch
        sink = _Counter(n)
        for i in range(n):
            backend.submit(req(f"r{i}", [i + 1] * (isl - 1) + [i], osl, ignore_eos=True), sink)
        await asyncio.wait_for(sink.done.wait(), 240)
        tokens = sink.tokens
        assert tokens == n * osl and sink.lengths == n and backend.cached_tokens_total == 0
        measured = tokens / backend.sim_seconds
    finally:
        await backend.close()
    assert measured == pytest.approx(PUBLISHED[isl, osl], rel=0.10), f"{measured:.0f} tokens/s"
    # The run agrees with the steady-state formula (ramp-up and drain of a finite run cost little).
    assert measured == pytest.approx(predicted_throughput(config, isl, osl), rel=0.05)


def test_fit_recovers_a_known_cost_model_from_exact_runs() -> None:
    truth = dict(prefill_time_per_token=40e-6, decode_step_time=0.004, decode_time_per_seq=0.0003,
                 decode_time_per_context_token=1e-6)
    config = SimConfig(**truth)
    runs = []
    for isl in (16, 128):
        for batch in (1, 4, 16):
            _, step = config.step_seconds(0, batch, int(batch * (isl + 8 / 2)))     # the mean step
            prefill, first_step = config.step_seconds(batch * isl, batch, batch * isl)
            runs.append(Run(batch, isl, 8, prefill + first_step, step))
    fitted = fit(runs)
    for name, value in truth.items():
        assert fitted[name] == pytest.approx(value, rel=1e-6), name


async def test_a_sim_calibrated_from_a_measured_backend_reproduces_its_costs() -> None:
    # The measured "real" backend is a sim paced in real time with known costs: the fit must find them.
    # Costs well above this machine's Python overhead per step, which adds to what is measured.
    truth = dict(prefill_time_per_token=100e-6, decode_step_time=0.01, decode_time_per_seq=0.001,
                 decode_time_per_context_token=4e-6)
    measured = SimBackend(SimConfig(**truth, vocab_size=1000))
    await measured.start()
    try:
        runs = await measure(measured, [1, 8], [16, 128], osl=6, vocab=1000)
    finally:
        await measured.close()
    fitted = fit(runs)
    # Wall-clock measurements on a shared CPU: loose bounds, but each part must be found.
    assert fitted["decode_step_time"] == pytest.approx(truth["decode_step_time"], rel=0.3)
    assert fitted["prefill_time_per_token"] == pytest.approx(truth["prefill_time_per_token"], rel=0.3)
    _, want = SimConfig(**truth).step_seconds(0, 8, 8 * 131)
    _, got = SimConfig(**fitted).step_seconds(0, 8, 8 * 131)
    assert got == pytest.approx(want, rel=0.2)
