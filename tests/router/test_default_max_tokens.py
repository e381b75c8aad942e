"""A request that omits max_tokens (0 on the wire, as proto3 sends an unset field) gets the router's
`--default-max-tokens`, bounded by the tenant's cap and what the model's context leaves after the
prompt; it used to be refused with INVALID_MAX_TOKENS (issue 14)."""

from __future__ import annotations

import pytest

from router_svc.config import LimitSettings
from router_svc.tenants import Tenant
from router_svc.types import Done, GenerateInput, Sampling
from router_svc.validation import DEFAULT_BOUNDS, Bounds, check_lengths, validate_input
from services.errors import InvalidArgument, Reason
from tests.router.core_fakes import TENANT, core

OPEN = Tenant(name="a", api_key_sha256="0" * 64)


def _resolved(ids: list[int], tenant: Tenant = OPEN, context: int = 4096, default: int = 256) -> int:
    sampling = Sampling(max_tokens=0)
    check_lengths(ids, sampling, tenant, context, Bounds(default_max_tokens=default))
    return sampling.max_tokens


def test_an_omitted_max_tokens_gets_the_default_within_the_tenant_cap_and_the_context() -> None:
    validate_input(GenerateInput(Sampling(max_tokens=0), prompt="hi"), None)   # no longer refused
    assert _resolved([1] * 10) == 256
    assert _resolved([1] * 10, default=32) == 32
    assert _resolved([1] * 10, Tenant(name="c", api_key_sha256="1" * 64, max_tokens_cap=100)) == 100
    assert _resolved([1] * 4000) == 96                           # the context left after the prompt
    assert _resolved([1] * 10, context=0) == 256                 # context unknown: the default alone
    explicit = Sampling(max_tokens=300)
    check_lengths([1] * 10, explicit, OPEN, 4096, DEFAULT_BOUNDS)
    assert explicit.max_tokens == 300                            # an explicit value is never changed
    assert LimitSettings().default_max_tokens == DEFAULT_BOUNDS.default_max_tokens == 256


def test_a_negative_max_tokens_is_still_refused() -> None:
    with pytest.raises(InvalidArgument) as info:
        validate_input(GenerateInput(Sampling(max_tokens=-1), prompt="hi"), None)
    assert info.value.reason == Reason.INVALID_MAX_TOKENS


async def test_the_router_sends_the_engine_the_resolved_max_tokens() -> None:
    c = core(bounds=Bounds(default_max_tokens=7))
    inp = GenerateInput(Sampling(max_tokens=0), prompt="hi")
    events = [e async for e in c.router.generate(TENANT, inp)]
    assert isinstance(events[-1], Done)
    assert inp.sampling.max_tokens == 7
