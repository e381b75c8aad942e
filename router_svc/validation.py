"""Request validation: every bad input gets INVALID_ARGUMENT with a precise reason.

Every client-supplied string has a bound (`Bounds`, from the `limits` settings): request_id,
session_id, model, stop strings, each chat message's role and content, the number of messages,
the prompt. Token counts are bounded after tokenizing (`check_lengths`), which also resolves an
omitted `max_tokens` (0: proto3 cannot tell unset from 0) to `Bounds.default_max_tokens`, within the
tenant's cap and the context the prompt leaves.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from services.errors import Reason

from .tenants import Tenant
from .types import GenerateInput, Sampling, TokenizerMeta

MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256
MAX_REQUEST_ID = 128
MAX_DELTA_TOKENS = 4096
MAX_DELTA_INTERVAL_MS = 10_000
DEFAULT_MAX_TOKENS = 256


@dataclass(frozen=True)
class Bounds:
    """Length bounds of client strings (defaults = the `limits` settings' defaults)."""

    max_session_id: int = 128
    max_model_name: int = 256
    max_messages: int = 1024
    max_role_chars: int = 64
    max_content_chars: int = 1_000_000
    default_max_tokens: int = DEFAULT_MAX_TOKENS
    max_stream_requests: int = 1024


DEFAULT_BOUNDS = Bounds()


def _check_sampling(s: Sampling) -> None:
    if s.max_tokens < 0:
        raise Reason.INVALID_MAX_TOKENS.error("max_tokens must be at least 1 (or 0 for the server's default)")
    if not math.isfinite(s.temperature) or not 0.0 <= s.temperature <= 100.0:
        raise Reason.INVALID_TEMPERATURE.error("sampling.temperature must be in [0, 100]")
    if not math.isfinite(s.top_p) or not 0.0 <= s.top_p <= 1.0:
        raise Reason.INVALID_TOP_P.error("sampling.top_p must be in [0, 1] (0 = off)")
    if len(s.stop) > MAX_STOP_STRINGS:
        raise Reason.TOO_MANY_STOP_STRINGS.error(f"at most {MAX_STOP_STRINGS} stop strings")
    for stop in s.stop:
        if not stop or len(stop) > MAX_STOP_CHARS:
            raise Reason.INVALID_STOP.error(f"stop strings must have 1..{MAX_STOP_CHARS} characters")


def check_messages(messages: list[tuple[str, str]], bounds: Bounds = DEFAULT_BOUNDS) -> None:
    if len(messages) > bounds.max_messages:
        raise Reason.TOO_MANY_MESSAGES.error(f"at most {bounds.max_messages} messages")
    for role, content in messages:
        if len(role) > bounds.max_role_chars:
            raise Reason.TOO_MANY_MESSAGES.error(f"a message role is longer than {bounds.max_role_chars}")
        if len(content) > bounds.max_content_chars:
            raise Reason.TOO_MANY_MESSAGES.error(f"a message is longer than {bounds.max_content_chars} characters")


def check_ids(inp: GenerateInput, bounds: Bounds = DEFAULT_BOUNDS) -> None:
    """The bounded identifiers and options: cheap, so checked before anything else."""
    if len(inp.request_id) > MAX_REQUEST_ID:
        raise Reason.INVALID_REQUEST_ID.error(f"request_id longer than {MAX_REQUEST_ID}")
    if len(inp.session_id) > bounds.max_session_id:
        raise Reason.INVALID_SESSION_ID.error(f"session_id longer than {bounds.max_session_id}")
    if len(inp.model) > bounds.max_model_name:
        raise Reason.INVALID_MODEL.error(f"model longer than {bounds.max_model_name}")
    if not 0 <= inp.min_delta_tokens <= MAX_DELTA_TOKENS:
        raise Reason.INVALID_DELTA_OPTIONS.error(f"min_delta_tokens must be in [0, {MAX_DELTA_TOKENS}]")
    if not 0 <= inp.min_delta_interval_ms <= MAX_DELTA_INTERVAL_MS:
        raise Reason.INVALID_DELTA_OPTIONS.error(f"min_delta_interval_ms must be in [0, {MAX_DELTA_INTERVAL_MS}]")


def validate_input(inp: GenerateInput, meta: TokenizerMeta | None, bounds: Bounds = DEFAULT_BOUNDS) -> None:
    _check_sampling(inp.sampling)
    check_ids(inp, bounds)
    given = [x for x in (inp.prompt, inp.messages, inp.token_ids) if x is not None]
    if len(given) != 1:
        raise Reason.MISSING_INPUT.error("exactly one of prompt, messages, token_ids is required")
    if inp.prompt is not None:
        if not inp.prompt.strip():
            raise Reason.EMPTY_PROMPT.error("prompt is empty")
        if len(inp.prompt) > bounds.max_content_chars:
            raise Reason.INPUT_TOO_LARGE.error(f"prompt longer than {bounds.max_content_chars} characters")
    if inp.messages is not None:
        if not inp.messages:
            raise Reason.EMPTY_PROMPT.error("messages is empty")
        check_messages(inp.messages, bounds)
    if inp.token_ids is not None:
        if not inp.token_ids:
            raise Reason.EMPTY_PROMPT.error("token_ids is empty")
        if meta is not None and meta.vocab_size and max(inp.token_ids) >= meta.vocab_size:
            raise Reason.INVALID_TOKEN_ID.error(f"token id beyond the vocabulary ({meta.vocab_size})")
    if meta is not None and meta.vocab_size and max(inp.sampling.stop_token_ids, default=0) >= meta.vocab_size:
        raise Reason.INVALID_TOKEN_ID.error(f"stop token id beyond the vocabulary ({meta.vocab_size})")


def check_lengths(ids: list[int], sampling: Sampling, tenant: Tenant, max_context: int,
                  bounds: Bounds = DEFAULT_BOUNDS) -> None:
    """Bound the prompt and the reply in tokens; an omitted max_tokens (0) becomes the default here."""
    if not ids:
        raise Reason.EMPTY_PROMPT.error("prompt tokenizes to nothing")
    if tenant.max_prompt_tokens and len(ids) > tenant.max_prompt_tokens:
        raise Reason.PROMPT_TOO_LONG.error(
            f"prompt has {len(ids)} tokens; tenant limit is {tenant.max_prompt_tokens}")
    if max_context and len(ids) >= max_context:
        raise Reason.PROMPT_TOO_LONG.error(f"prompt has {len(ids)} tokens; the model's context is {max_context}")
    if sampling.max_tokens == 0:
        sampling.max_tokens = min(bounds.default_max_tokens, tenant.max_tokens_cap or bounds.default_max_tokens,
                                  max_context - len(ids) if max_context else bounds.default_max_tokens)
        return
    if tenant.max_tokens_cap and sampling.max_tokens > tenant.max_tokens_cap:
        raise Reason.MAX_TOKENS_TOO_LARGE.error(
            f"max_tokens {sampling.max_tokens} above the tenant cap {tenant.max_tokens_cap}")
    if max_context and len(ids) + sampling.max_tokens > max_context:
        raise Reason.CONTEXT_LENGTH_EXCEEDED.error(
            f"prompt ({len(ids)}) + max_tokens ({sampling.max_tokens}) exceeds the context ({max_context})")
