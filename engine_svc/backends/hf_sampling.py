"""Cheaper per-request top-k / top-p warpers for transformers continuous batching.

transformers 5.24's per-request warpers sort the whole vocabulary for every row, every step, even
for rows that filter nothing: with Gemma 3's 262k-token vocabulary that is ~300 ms per sort of 16
rows on a 2-core CPU, several times the forward pass itself. These subclasses give the same
results and only pay for what a row asks for: top-k uses a partial `torch.topk` up to the largest
k of the batch (a greedy row is k=1), rows without a limit are left alone, and top-p sorts only
the rows whose top_p < 1. They replace the manager's warper instances before it starts (the
processor list and its argument tensors are unchanged).

Imports torch and transformers: import this module only from the hf backend's loader.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers.generation.continuous_batching.cb_logits_processors import (
    ContinuousBatchingTopKLogitsWarper,
    ContinuousBatchingTopPLogitsWarper,
)


class FastTopK(ContinuousBatchingTopKLogitsWarper):
    def __call__(self, scores: torch.Tensor, tensor_arg: torch.Tensor) -> torch.Tensor:
        rows, vocab = scores.shape
        top_k = tensor_arg[:rows].clamp(max=vocab).to(torch.int64)
        limited = top_k < vocab
        if not bool(limited.any()):
            return scores
        kmax = int(top_k[limited].max())
        values = torch.topk(scores, kmax, dim=-1).values  # descending, like the sort it replaces
        thresholds = values.gather(-1, (top_k.clamp(max=kmax) - 1).unsqueeze(-1))
        thresholds = thresholds.masked_fill(~limited.unsqueeze(-1), float("-inf"))
        return scores.masked_fill(scores < thresholds, self.filter_value)


class FastTopP(ContinuousBatchingTopPLogitsWarper):
    def __call__(self, scores: torch.Tensor, tensor_arg: torch.Tensor) -> torch.Tensor:
        rows = scores.size(0)
        top_p = tensor_arg[:rows].view(dtype=torch.float32)
        nucleus = top_p < 1.0
        if not bool(nucleus.any()):
            return scores
        if bool(nucleus.all()):
            return super().__call__(scores, tensor_arg)
        index = nucleus.nonzero().squeeze(-1)
        out = scores.clone()
        out[index] = super().__call__(scores[index], tensor_arg[:rows][index])
        return out


def install_fast_warpers(manager: Any) -> int:
    """Swap the manager's top-k / top-p warpers for the fast ones; returns how many were swapped.
    Must run before ``manager.start()`` (the generation thread reads the list when it starts)."""
    processors = manager.logit_processor.logits_processor
    swapped = 0
    for i, processor in enumerate(processors):
        for slow, fast in ((ContinuousBatchingTopKLogitsWarper, FastTopK),
                           (ContinuousBatchingTopPLogitsWarper, FastTopP)):
            if type(processor) is slow:
                replacement = fast.__new__(fast)
                replacement.__dict__.update(processor.__dict__)
                processors[i] = replacement
                swapped += 1
    return swapped
