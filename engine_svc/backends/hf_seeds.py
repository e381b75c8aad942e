"""Per-request seeds for transformers continuous batching: one `torch.Generator` per seeded request.

transformers 5.24 samples a whole batch with one `torch.multinomial` call on the global RNG, so a
request's draws depend on what else shares its batch. `SeededSampler` replaces the model runner's
`_sample` (the step's last call, after the logits processors): it draws every row as transformers
does, then redraws the rows of seeded requests from their own generator, seeded once with the
request's seed. Same seed, prompt and sampling settings give the same tokens whatever else is
batched with it (up to float differences in the batched forward pass itself, which can flip a
draw whose probabilities are nearly tied). The cost is one small multinomial per seeded row per
step; a step without seeded requests runs transformers' own code.

Only where the step runs eagerly: with CUDA graphs, torch.compile or async batching (transformers
enables them on GPUs) the Python-level row loop cannot run inside the captured step, so
`available()` is False and the backend refuses seeds as before.

torch is imported when the sampler first runs (it is loaded by then: the backend's loader runs first).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch


class SeededSampler:
    def __init__(self, runner: Any) -> None:
        self.runner = runner
        self._original = runner._sample
        # internal request id -> seed; written on the event loop (submit, end), read by the step.
        self.seeds: dict[str, int] = {}
        self._generators: dict[str, torch.Generator] = {}   # the generation thread's own

    def available(self) -> bool:
        runner = self.runner
        eager = not getattr(runner, "pad_inputs", True) and getattr(runner, "_compiled_varlen", 1) is None \
            and getattr(runner, "_compiled_decode", 1) is None
        sync = not type(runner.inputs_and_outputs).__name__.endswith("AsyncIOs")
        return bool(eager and sync and runner.do_sample and not runner.return_logprobs)

    def install(self) -> bool:
        if not self.available():
            return False
        self.runner._sample = self
        return True

    def __call__(self, scores: torch.Tensor, output_ids: torch.Tensor) -> None:
        import torch

        seeded = self._seeded_rows() if self.seeds else []
        if not seeded:
            if self._generators:
                self._generators.clear()
            self._original(scores, output_ids)
            return
        probs = torch.nn.functional.softmax(scores[0], dim=-1)   # [rows, vocab], as transformers does
        next_tokens = torch.multinomial(probs, num_samples=1).squeeze(-1)
        for row, request_id in seeded:
            generator = self._generators.get(request_id)
            if generator is None:
                generator = torch.Generator(device=probs.device).manual_seed(self.seeds.get(request_id, 0))
                self._generators[request_id] = generator
            next_tokens[row] = torch.multinomial(probs[row], num_samples=1, generator=generator)[0]
        output_ids[0, :next_tokens.size(0)].copy_(next_tokens)
        for request_id in [r for r in self._generators if r not in self.seeds]:
            del self._generators[request_id]   # ended (finished or aborted)

    def _seeded_rows(self) -> list[tuple[int, str]]:
        # Rows are the scheduled requests that get a token this step, in batch order (the order
        # transformers' update_batch reads them back in).
        batch = self.runner.inputs_and_outputs.requests_in_batch
        ids = [future.state.request_id for future in batch if future.has_new_token]
        return [(row, request_id) for row, request_id in enumerate(ids) if request_id in self.seeds]
