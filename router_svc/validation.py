"""Request validation: every bad input gets INVALID_ARGUMENT with a precise reason."""

from __future__ import annotations

import math

from services.errors import InvalidArgument

from .tenants import Tenant
from .types import GenerateInput, Sampling, TokenizerMeta

MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256
MAX_REQUEST_ID = 128


def _check_sampling(s: Sampling) -> None:
    if s.max_tokens < 1:
        raise InvalidArgument("sampling.max_tokens must be >= 1", "INVALID_MAX_TOKENS")
    if not math.isfinite(s.temperature) or not 0.0 <= s.temperature <= 100.0:
        raise InvalidArgument("sampling.temperature must be in [0, 100]", "INVALID_TEMPERATURE")
    if not math.isfinite(s.top_p) or not 0.0 <= s.top_p <= 1.0:
        raise InvalidArgument("sampling.top_p must be in [0, 1] (0 = off)", "INVALID_TOP_P")
    if len(s.stop) > MAX_STOP_STRINGS:
        raise InvalidArgument(f"at most {MAX_STOP_STRINGS} stop strings", "TOO_MANY_STOP_STRINGS")
    for stop in s.stop:
        if not stop or len(stop) > MAX_STOP_CHARS:
            raise InvalidArgument(f"stop strings must have 1..{MAX_STOP_CHARS} characters", "INVALID_STOP")


def validate_input(inp: GenerateInput, meta: TokenizerMeta | None) -> None:
    _check_sampling(inp.sampling)
    if len(inp.request_id) > MAX_REQUEST_ID:
        raise InvalidArgument(f"request_id longer than {MAX_REQUEST_ID}", "INVALID_REQUEST_ID")
    given = [x for x in (inp.prompt, inp.messages, inp.token_ids) if x is not None]
    if len(given) != 1:
        raise InvalidArgument("exactly one of prompt, messages, token_ids is required", "MISSING_INPUT")
    if inp.prompt is not None and not inp.prompt.strip():
        raise InvalidArgument("prompt is empty", "EMPTY_PROMPT")
    if inp.messages is not None and not inp.messages:
        raise InvalidArgument("messages is empty", "EMPTY_PROMPT")
    if inp.token_ids is not None:
        if not inp.token_ids:
            raise InvalidArgument("token_ids is empty", "EMPTY_PROMPT")
        if meta is not None and meta.vocab_size and max(inp.token_ids) >= meta.vocab_size:
            raise InvalidArgument(f"token id beyond the vocabulary ({meta.vocab_size})", "INVALID_TOKEN_ID")


def check_lengths(ids: list[int], sampling: Sampling, tenant: Tenant, max_context: int) -> None:
    if not ids:
        raise InvalidArgument("prompt tokenizes to nothing", "EMPTY_PROMPT")
    if tenant.max_prompt_tokens and len(ids) > tenant.max_prompt_tokens:
        raise InvalidArgument(f"prompt has {len(ids)} tokens; tenant limit is {tenant.max_prompt_tokens}",
                              "PROMPT_TOO_LONG")
    if tenant.max_tokens_cap and sampling.max_tokens > tenant.max_tokens_cap:
        raise InvalidArgument(
            f"max_tokens {sampling.max_tokens} above the tenant cap {tenant.max_tokens_cap}",
            "MAX_TOKENS_TOO_LARGE")
    if not max_context:
        return
    if len(ids) >= max_context:
        raise InvalidArgument(f"prompt has {len(ids)} tokens; the model's context is {max_context}",
                              "PROMPT_TOO_LONG")
    if len(ids) + sampling.max_tokens > max_context:
        raise InvalidArgument(
            f"prompt ({len(ids)}) + max_tokens ({sampling.max_tokens}) exceeds the context ({max_context})",
            "CONTEXT_LENGTH_EXCEEDED")
