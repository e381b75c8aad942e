"""The `hf` backend under a long prompt: chunked prefill with short prompts first (issue 14 item 5),
cancellation in every phase, KV sizing and the prefix cache (issue 13 "hf hardened").

The ordering tests are exact (which request's first token comes first), not timings. The figures
for the report come from running this module: ``python -m tests.engine.test_engine_hf_prefill``.
"""

from __future__ import annotations

import asyncio
import pathlib
import sys
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from engine_svc.backends.base import FinishReason, GenerationEvent
from engine_svc.backends.hf import HfBackend, HfConfig
from services.errors import InvalidArgument
from tests.engine.engine_testkit import Collector, poll, req

LONG = 4096          # prompt tokens of the long request
CONTEXT = 8192


def build_long_context_model(out: pathlib.Path, hidden: int = 64, layers: int = 2) -> pathlib.Path:
    """A random-weight Llama with an 8k context (tests/tiny_model.py's models stop at 512)."""
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(7)
    config = LlamaConfig(vocab_size=512, hidden_size=hidden, intermediate_size=2 * hidden,
                         num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=CONTEXT, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    LlamaForCausalLM(config).eval().save_pretrained(out)
    GenerationConfig(bos_token_id=1, eos_token_id=2, pad_token_id=0).save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def long_model(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    return build_long_context_model(tmp_path_factory.mktemp("long-llama"))


# 4096 + 64 tokens of KV for the long prompt and a few short ones: 160 blocks of 32.
SETTINGS: dict[str, Any] = dict(num_blocks=160, block_size=32, max_batch_tokens=256, max_batch_size=8,
                                threads=1)


@pytest.fixture
async def make_hf() -> AsyncIterator[Callable[..., Any]]:
    started: list[HfBackend] = []

    async def make(model: pathlib.Path, **overrides: Any) -> HfBackend:
        backend = HfBackend(HfConfig(model=str(model), **{**SETTINGS, **overrides}))
        await backend.start()
        started.append(backend)
        return backend

    yield make
    for backend in started:
        await backend.close()


class Timeline:
    """Every event of every request, with its arrival time, in arrival order."""

    def __init__(self) -> None:
        self.events: list[tuple[float, GenerationEvent]] = []
        self.submitted: dict[str, float] = {}

    def sink(self, event: GenerationEvent) -> None:
        self.events.append((time.perf_counter(), event))

    def first_token_at(self, request_id: str) -> float | None:
        return next((t for t, e in self.events if e.request_id == request_id and e.token_ids), None)

    def finished(self, request_id: str) -> GenerationEvent | None:
        return next((e for _, e in self.events if e.request_id == request_id and e.finished), None)

    def order_of_first_tokens(self) -> list[str]:
        seen: list[str] = []
        for _, event in self.events:
            if event.token_ids and event.request_id not in seen:
                seen.append(event.request_id)
        return seen

    def ttft(self, request_id: str) -> float:
        at = self.first_token_at(request_id)
        assert at is not None, request_id
        return at - self.submitted[request_id]


def done(collector: Collector, request_id: str) -> bool:
    return request_id in collector.events and collector.last(request_id).finished


def long_prompt(n: int = LONG, offset: int = 0) -> list[int]:
    return [1, *((i * 7 + offset) % 500 + 3 for i in range(n - 1))]


SHORT = [1, 40, 41, 42, 43, 44]


async def long_then_short(backend: HfBackend, short_tokens: int = 5, long_len: int = LONG,
                          short: list[int] = SHORT) -> Timeline:
    """A long prompt, and a short request submitted once the long one is being prefilled."""
    timeline = Timeline()
    timeline.submitted["long"] = time.perf_counter()
    backend.submit(req("long", long_prompt(long_len), 2, ignore_eos=True), timeline.sink)
    await poll(lambda: backend.load().active >= 1, timeout=60, what="the long prompt to start prefilling")
    timeline.submitted["short"] = time.perf_counter()
    backend.submit(req("short", short, short_tokens, ignore_eos=True), timeline.sink)
    await poll(lambda: timeline.finished("long") and timeline.finished("short"), timeout=300,
               what="both requests to finish")
    return timeline


async def test_fifo_holds_a_short_request_behind_a_long_prefill(make_hf, long_model) -> None:
    """The defect, reproduced with transformers' own scheduler: the short request's first token
    comes only after the whole long prefill."""
    backend = await make_hf(long_model, scheduler="fifo")
    timeline = await long_then_short(backend)
    assert timeline.order_of_first_tokens() == ["long", "short"]


async def test_short_first_serves_a_short_request_during_a_long_prefill(make_hf, long_model) -> None:
    backend = await make_hf(long_model)
    timeline = await long_then_short(backend, short_tokens=5)
    # The short request is served (all 5 tokens) while the long prompt is still being prefilled.
    finished_short = next(t for t, e in timeline.events if e.request_id == "short" and e.finished)
    long_first = timeline.first_token_at("long")
    assert long_first is not None and finished_short < long_first
    assert timeline.finished("short").finish_reason is FinishReason.LENGTH
    assert timeline.finished("long").finish_reason is FinishReason.LENGTH
    assert backend.load().active == 0


async def test_a_prompt_longer_than_a_step_goes_before_a_longer_one(make_hf, long_model) -> None:
    """A 600-token chat prompt (three steps of 256) arriving during a 4096-token prefill waits for
    its own three steps, not the other's sixteen."""
    backend = await make_hf(long_model)
    timeline = await long_then_short(backend, short_tokens=3, short=long_prompt(600, offset=3))
    finished_short = next(t for t, e in timeline.events if e.request_id == "short" and e.finished)
    long_first = timeline.first_token_at("long")
    assert long_first is not None and finished_short < long_first


async def test_long_prompts_share_the_steps(make_hf, long_model) -> None:
    """prefill_chunk_tokens: two long prompts advance side by side, so the second is not queued
    behind the whole first one. "a" decodes 4 tokens once its prefill ends: one prompt after the
    other, "a" would be done 8 steps before "b" had its first token; side by side, "b"'s first
    token comes with "a"'s."""
    backend = await make_hf(long_model, max_batch_tokens=256, prefill_chunk_tokens=128)
    timeline = Timeline()
    backend.submit(req("a", long_prompt(2048, 0), 4, ignore_eos=True), timeline.sink)
    backend.submit(req("b", long_prompt(2048, 1), 1, ignore_eos=True), timeline.sink)
    await poll(lambda: timeline.finished("a") and timeline.finished("b"), timeout=300, what="both prompts")
    finished_a = next(t for t, e in timeline.events if e.request_id == "a" and e.finished)
    first_b = timeline.first_token_at("b")
    assert first_b is not None and first_b <= finished_a


async def test_abort_mid_prefill_ends_with_cancelled_and_frees_the_kv(make_hf, long_model) -> None:
    backend = await make_hf(long_model)
    sink = Collector()
    backend.submit(req("long", long_prompt(), 4, ignore_eos=True), sink)
    await poll(lambda: backend.load().kv_blocks_used >= 8, timeout=60, what="the prefill to be under way")
    assert sink.count("long") == 0  # still prefilling: no token yet
    assert backend.abort("long")
    assert sink.last("long").finished and sink.last("long").finish_reason is FinishReason.CANCELLED
    await poll(lambda: backend.load().active == 0 and backend.load().kv_blocks_used == 0, timeout=60,
               what="the aborted prefill to leave the batch and free its blocks")
    assert sink.count("long") == 0  # nothing after CANCELLED
    after = Collector()
    backend.submit(req("after", [1, 5, 6], 3, ignore_eos=True), after)
    await poll(lambda: done(after, "after"), timeout=60, what="a request after the abort")
    assert len(after.tokens("after")) == 3


async def test_abort_mid_decode_and_while_queued(make_hf, long_model) -> None:
    backend = await make_hf(long_model, max_batch_size=1)
    sink = Collector()
    backend.submit(req("decoding", [1, 5, 6, 7], 500, ignore_eos=True), sink)
    await poll(lambda: sink.count("decoding") >= 3, timeout=60, what="decoding")
    backend.submit(req("queued", [1, 8, 9], 4, ignore_eos=True), sink)  # one slot, taken: it waits
    await poll(lambda: backend.load().queued >= 1, timeout=60, what="the second request to be queued")
    assert backend.abort("queued") and backend.abort("decoding")
    for name in ("queued", "decoding"):
        assert sink.last(name).finish_reason is FinishReason.CANCELLED
    await poll(lambda: backend.load().active == 0 and backend.load().queued == 0
               and backend.load().kv_blocks_used == 0, timeout=60, what="both to be gone")
    assert not backend.abort("decoding")


async def test_a_prompt_the_kv_cache_cannot_hold_is_refused(make_hf, long_model) -> None:
    """KV sizing is explicit: the engine's context is what its KV cache holds, so a prompt that can
    never fit is refused up front instead of stalling (or crashing) the generation thread."""
    backend = await make_hf(long_model, num_blocks=16, block_size=32)   # 512 tokens of KV
    assert backend.max_context == 512 and backend.load().kv_blocks_total == 16
    with pytest.raises(InvalidArgument) as info:
        backend.validate(req("big", long_prompt(600), 4))
    assert info.value.reason == "CONTEXT_LENGTH_EXCEEDED"
    ok = Collector()
    backend.submit(req("fits", long_prompt(400), 4, ignore_eos=True), ok)
    await poll(lambda: done(ok, "fits"), timeout=60, what="a prompt that fits")


async def test_prefix_cache_hits_are_reported(make_hf, long_model) -> None:
    backend = await make_hf(long_model)
    shared = long_prompt(200)
    first = Collector()
    backend.submit(req("first", [*shared, 9], 2, ignore_eos=True), first)
    await poll(lambda: done(first, "first"), timeout=60, what="the first request")
    second = Collector()
    backend.submit(req("second", [*shared, 10], 2, ignore_eos=True), second)
    await poll(lambda: done(second, "second"), timeout=60, what="the second request")
    assert first.events["first"][0].cached_tokens == 0
    # 200 shared tokens = 6 full blocks of 32 (192 tokens) found in the cache.
    assert second.events["second"][0].cached_tokens == 192
    stats = backend.prefix_cache_stats()
    assert stats is not None and stats.hit_blocks == 6 and stats.miss_blocks == 6
    assert backend.load().cached_tokens_total == 192


async def test_a_dead_generation_thread_fails_requests_retryably_and_marks_the_engine_dead(
        make_hf, long_model) -> None:
    """transformers ends its generation thread on any error in a step (an OOM, a kernel failure):
    every live request must end with a reason the router retries elsewhere, and the engine must
    say it is dead rather than accept work it will never do."""
    from engine_svc.backends.events import HealthState
    from services.errors import Unavailable

    backend = await make_hf(long_model)
    sink = Collector()
    backend.submit(req("victim", [1, 5, 6, 7], 500, ignore_eos=True), sink)
    await poll(lambda: sink.count("victim") >= 2, timeout=60, what="decoding")

    def broken_step() -> bool:
        raise RuntimeError("simulated device failure")

    backend._manager.batch_processor.prepare_next_batch = broken_step
    await poll(lambda: done(sink, "victim"), timeout=60, what="the victim to end")
    last = sink.last("victim")
    assert last.finish_reason is FinishReason.ERROR and last.error_reason == "ENGINE_UNAVAILABLE"
    await poll(lambda: backend.health() is HealthState.DEAD, timeout=30, what="the engine to be dead")
    assert "simulated device failure" in backend.health_detail
    with pytest.raises(Unavailable) as refused:
        backend.submit(req("late", [1, 2], 2), Collector())
    assert refused.value.reason == "ENGINE_UNAVAILABLE"


async def test_per_request_seeds_reproduce_whatever_shares_the_batch(make_hf, long_model) -> None:
    backend = await make_hf(long_model)

    def sampled(name: str, seed: int) -> Any:
        return req(name, [1, 50, 51, 52], 16, temperature=1.0, seed=seed, ignore_eos=True)

    alone = Collector()
    backend.submit(sampled("a", 7), alone)
    await poll(lambda: done(alone, "a"), timeout=60, what="the seeded request alone")
    batched = Collector()
    backend.submit(req("noise", long_prompt(300), 12, temperature=1.0, ignore_eos=True), batched)
    backend.submit(sampled("b", 7), batched)
    backend.submit(sampled("c", 8), batched)
    await poll(lambda: all(done(batched, n) for n in ("noise", "b", "c")), timeout=60, what="the batch")
    assert len(alone.tokens("a")) == 16
    assert batched.tokens("b") == alone.tokens("a")      # same seed: same draws, other rows or not
    assert batched.tokens("c") != alone.tokens("a")      # another seed: other draws
    assert backend._seeds == {}                          # forgotten once finished


async def test_auto_dtype_runs_half_precision_natively_or_in_float32(make_hf, tmp_path) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    bf16 = tmp_path / "bf16"
    AutoModelForCausalLM.from_pretrained(build_long_context_model(tmp_path / "fp32")).to(torch.bfloat16) \
        .save_pretrained(bf16)
    (bf16 / "generation_config.json").write_text((tmp_path / "fp32" / "generation_config.json").read_text())
    backend = await make_hf(bf16, dtype="auto")
    native = torch.ops.mkldnn._is_mkldnn_bf16_supported()
    assert backend._manager.model.dtype == (torch.bfloat16 if native else torch.float32)


# ------------------------------------------------------------------------------------ figures


async def _measure(model: pathlib.Path, long_len: int, **settings: Any) -> dict[str, float]:
    backend = HfBackend(HfConfig(model=str(model), **{**SETTINGS, **settings}))
    await backend.start()
    try:
        alone = Timeline()
        alone.submitted["short"] = time.perf_counter()
        backend.submit(req("short", [1, 40, 41, 42, 43, 44], 1, ignore_eos=True), alone.sink)
        await poll(lambda: alone.finished("short"), timeout=60)
        timeline = await long_then_short(backend, short_tokens=1, long_len=long_len)
        return {"short_alone": alone.ttft("short"), "short_during_long": timeline.ttft("short"),
                "long_ttft": timeline.ttft("long")}
    finally:
        await backend.close()


async def _figures(long_len: int, hidden: int, layers: int) -> None:
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        model = build_long_context_model(pathlib.Path(tmp), hidden=hidden, layers=layers)
        blocks = (long_len + 256) // 32 + 1
        for scheduler in ("fifo", "short_first"):
            for batch_tokens in (256, 512):
                figures = await _measure(model, long_len, scheduler=scheduler, num_blocks=blocks,
                                         max_batch_tokens=batch_tokens)
                _print(f"long={long_len} hidden={hidden} layers={layers}", scheduler, batch_tokens, figures)


async def _default_model_figures(long_len: int, batch_tokens: list[int], dtype: str = "auto") -> None:
    """The default model (Gemma 3 270M, bf16) as `tokenrelay up` runs it (--hf-dtype auto)."""
    from tests import artefacts

    model = artefacts.path("gemma-3-270m")
    for scheduler in ("fifo", "short_first"):
        for tokens in batch_tokens:
            figures = await _measure(model, long_len, scheduler=scheduler, dtype=dtype, threads=0,
                                     num_blocks=256, max_batch_tokens=tokens, max_batch_size=32)
            _print(f"gemma-3-270m {dtype} long={long_len}", scheduler, tokens, figures)


def _print(what: str, scheduler: str, batch_tokens: int, figures: dict[str, float]) -> None:
    print(f"{what} scheduler={scheduler:11s} max_batch_tokens={batch_tokens}: "
          + " ".join(f"{k}={v * 1000:.0f}ms" for k, v in figures.items()), flush=True)


if __name__ == "__main__":
    # python -m tests.engine.test_engine_hf_prefill [LONG HIDDEN LAYERS]   (a random-weight Llama)
    # python -m tests.engine.test_engine_hf_prefill gemma DTYPE LONG [BATCH_TOKENS...]
    if sys.argv[1:2] == ["gemma"]:
        asyncio.run(_default_model_figures(int(sys.argv[3]), [int(a) for a in sys.argv[4:]] or [256, 512],
                                           sys.argv[2]))
    else:
        asyncio.run(_figures(*([int(a) for a in sys.argv[1:]] or [8000, 256, 4])))
