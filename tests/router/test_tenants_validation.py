"""Pure-logic tests of tenants and request validation (no network)."""

from __future__ import annotations

import pytest

from router_svc.tenants import Tenant, TenantRegistry, api_key_from_metadata, hash_key
from router_svc.types import GenerateInput, Sampling
from router_svc.validation import check_lengths, validate_input
from services.errors import InvalidArgument, PermissionDenied, Unauthenticated


def _registry(tmp_path, suffix: str) -> TenantRegistry:
    path = tmp_path / f"tenants{suffix}"
    digest = hash_key("secret-a")
    if suffix == ".toml":
        path.write_text(f'[[tenants]]\nname = "a"\napi_key_sha256 = "{digest}"\nmax_in_flight = 3\n'
                        'priority_ceiling = "normal"\nallowed_models = ["m1"]\n')
    else:
        path.write_text(f"tenants:\n  - name: a\n    api_key_sha256: {digest}\n    max_in_flight: 3\n"
                        "    priority_ceiling: normal\n    allowed_models: [m1]\n")
    return TenantRegistry.from_file(path)


@pytest.mark.parametrize("suffix", [".yaml", ".toml"])
def test_tenants_file_and_auth(tmp_path, suffix):
    reg = _registry(tmp_path, suffix)
    tenant = reg.authenticate("secret-a")
    assert tenant.name == "a" and tenant.max_in_flight == 3
    with pytest.raises(Unauthenticated) as e:
        reg.authenticate("secret-b")
    assert e.value.reason == "INVALID_API_KEY"
    with pytest.raises(Unauthenticated) as e:
        reg.authenticate(None)
    assert e.value.reason == "MISSING_API_KEY"
    with pytest.raises(PermissionDenied) as e:
        tenant.check_model("m2")
    assert e.value.reason == "MODEL_NOT_ALLOWED"
    tenant.check_model("m1")
    with pytest.raises(PermissionDenied) as e:
        tenant.resolve_priority(3)
    assert e.value.reason == "PRIORITY_NOT_ALLOWED"
    assert tenant.resolve_priority(0) == 2


def test_plain_keys_are_rejected_in_tenants_file(tmp_path):
    path = tmp_path / "t.yaml"
    path.write_text("tenants:\n  - name: a\n    api_key_sha256: not-a-hash\n")
    with pytest.raises(ValueError, match="SHA-256"):
        TenantRegistry.from_file(path)


def test_metadata_key_extraction():
    assert api_key_from_metadata((("authorization", "Bearer k1"),)) == "k1"
    assert api_key_from_metadata((("x-api-key", "k2"),)) == "k2"
    assert api_key_from_metadata(()) is None
    with pytest.raises(InvalidArgument):
        api_key_from_metadata((("authorization", "Basic abc"),))


@pytest.mark.parametrize(("inp", "reason"), [
    (GenerateInput(Sampling(max_tokens=-1), prompt="hi"), "INVALID_MAX_TOKENS"),   # 0 = the default
    (GenerateInput(Sampling(max_tokens=4, temperature=-1), prompt="hi"), "INVALID_TEMPERATURE"),
    (GenerateInput(Sampling(max_tokens=4, top_p=1.5), prompt="hi"), "INVALID_TOP_P"),
    (GenerateInput(Sampling(max_tokens=4, stop=[""]), prompt="hi"), "INVALID_STOP"),
    (GenerateInput(Sampling(max_tokens=4)), "MISSING_INPUT"),
    (GenerateInput(Sampling(max_tokens=4), prompt="  "), "EMPTY_PROMPT"),
    (GenerateInput(Sampling(max_tokens=4), token_ids=[]), "EMPTY_PROMPT"),
    (GenerateInput(Sampling(max_tokens=4), messages=[]), "EMPTY_PROMPT"),
])
def test_validation_reasons(inp, reason):
    with pytest.raises(InvalidArgument) as e:
        validate_input(inp, None)
    assert e.value.reason == reason


def test_length_checks():
    tenant = Tenant(name="a", api_key_sha256="0" * 64, max_prompt_tokens=10)
    check_lengths([1, 2, 3], Sampling(max_tokens=5), tenant, 16)
    cases = [([1] * 11, 1, 100, "PROMPT_TOO_LONG"), ([1] * 8, 9, 16, "CONTEXT_LENGTH_EXCEEDED"),
             ([1] * 8, 1, 8, "PROMPT_TOO_LONG"), ([], 1, 16, "EMPTY_PROMPT")]
    for ids, max_tokens, ctx, reason in cases:
        with pytest.raises(InvalidArgument) as e:
            check_lengths(ids, Sampling(max_tokens=max_tokens), tenant, ctx)
        assert e.value.reason == reason
