"""Request validation: every bad input gets INVALID_ARGUMENT with a precise reason."""

from __future__ import annotations

import math

from services.errors import Reason

from .tenants import Tenant
from .types import GenerateInput, Sampling, TokenizerMeta

MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256
MAX_REQUEST_ID = 128


def _check_sampling(s: Sampling) -> None:
    if s.max_tokens < 1:
        raise Reason.INVALID_MAX_TOKENS.error("sampling.max_tokens must be >= 1")
    if not math.isfinite(s.temperature) or not 0.0 <= s.temperature <= 100.0:
        raise Reason.INVALID_TEMPERATURE.error("sampling.temperature must be in [0, 100]")
    if not math.isfinite(s.top_p) or not 0.0 <= s.top_p <= 1.0:
        raise Reason.INVALID_TOP_P.error("sampling.top_p must be in [0, 1] (0 = off)")
    if len(s.stop) > MAX_STOP_STRINGS:
        raise Reason.TOO_MANY_STOP_STRINGS.error(f"at most {MAX_STOP_STRINGS} stop strings")
    for stop in s.stop:
        if not stop or len(stop) > MAX_STOP_CHARS:
            raise Reason.INVALID_STOP.error(f"stop strings must have 1..{MAX_STOP_CHARS} characters")


def validate_input(inp: GenerateInput, meta: TokenizerMeta | None) -> None:
    _check_sampling(inp.sampling)
    if len(inp.request_id) > MAX_REQUEST_ID:
        raise Reason.INVALID_REQUEST_ID.error(f"request_id longer than {MAX_REQUEST_ID}")
    given = [x for x in (inp.prompt, inp.messages, inp.token_ids) if x is not None]
    if len(given) != 1:
        raise Reason.MISSING_INPUT.error("exactly one of prompt, messages, token_ids is required")
    if inp.prompt is not None and not inp.prompt.strip():
        raise Reason.EMPTY_PROMPT.error("prompt is empty")
    if inp.messages is not None and not inp.messages:
        raise Reason.EMPTY_PROMPT.error("messages is empty")
    if inp.token_ids is not None:
        if not inp.token_ids:
            raise Reason.EMPTY_PROMPT.error("token_ids is empty")
        if meta is not None and meta.vocab_size and max(inp.token_ids) >= meta.vocab_size:
            raise Reason.INVALID_TOKEN_ID.error(f"token id beyond the vocabulary ({meta.vocab_size})")


def check_lengths(ids: list[int], sampling: Sampling, tenant: Tenant, max_context: int) -> None:
    if not ids:
        raise Reason.EMPTY_PROMPT.error("prompt tokenizes to nothing")
    if tenant.max_prompt_tokens and len(ids) > tenant.max_prompt_tokens:
        raise Reason.PROMPT_TOO_LONG.error(
            f"prompt has {len(ids)} tokens; tenant limit is {tenant.max_prompt_tokens}")
    if tenant.max_tokens_cap and sampling.max_tokens > tenant.max_tokens_cap:
        raise Reason.MAX_TOKENS_TOO_LARGE.error(
            f"max_tokens {sampling.max_tokens} above the tenant cap {tenant.max_tokens_cap}")
    if not max_context:
        return
    if len(ids) >= max_context:
        raise Reason.PROMPT_TOO_LONG.error(f"prompt has {len(ids)} tokens; the model's context is {max_context}")
    if len(ids) + sampling.max_tokens > max_context:
        raise Reason.CONTEXT_LENGTH_EXCEEDED.error(
            f"prompt ({len(ids)}) + max_tokens ({sampling.max_tokens}) exceeds the context ({max_context})")
