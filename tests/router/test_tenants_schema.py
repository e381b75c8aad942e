"""The tenants file schema: every documented field loads; unknown keys, bad types, impossible values and
duplicates refuse the whole file with a message naming the tenant and the key (real files, no network)."""

from __future__ import annotations

import pathlib

import pytest

from router_svc.tenants import PRIORITIES, Tenant, TenantRegistry, TenantsFileError, hash_key

KEY_A, KEY_B = hash_key("key-a"), hash_key("key-b")


def _write(tmp_path: pathlib.Path, body: str, name: str = "tenants.yaml") -> pathlib.Path:
    path = tmp_path / name
    path.write_text(body)
    return path


def _one(tmp_path: pathlib.Path, extra: str, name: str = "search-team") -> pathlib.Path:
    return _write(tmp_path, f"tenants:\n  - name: {name}\n    api_key_sha256: {KEY_A}\n{extra}")


def _refused(path: pathlib.Path) -> str:
    with pytest.raises(TenantsFileError) as e:
        TenantRegistry.from_file(path)
    return str(e.value)


def test_every_documented_field_loads(tmp_path):
    path = _write(tmp_path, f"""version: 1
tenants:
  - name: search-team
    api_key_sha256: {KEY_A.upper()}
    weight: 2.5
    priority_ceiling: normal
    default_priority: low
    max_in_flight: 16
    max_queued: 64
    tokens_per_minute: 120000
    max_prompt_tokens: 4096
    max_tokens_cap: 512
    allowed_models: [m1, m2]
  - name: batch.jobs_2
    api_key_sha256: {KEY_B}
""")
    reg = TenantRegistry.from_file(path)
    a = reg.authenticate("key-a")
    assert (a.name, a.api_key_sha256, a.weight, a.priority_ceiling, a.default_priority) == (
        "search-team", KEY_A, 2.5, PRIORITIES["normal"], PRIORITIES["low"])
    assert (a.max_in_flight, a.max_queued, a.tokens_per_minute, a.max_prompt_tokens, a.max_tokens_cap) == (
        16, 64, 120000, 4096, 512)
    assert a.allowed_models == ("m1", "m2")
    b = reg.authenticate("key-b")
    assert (b.max_in_flight, b.max_queued, b.tokens_per_minute, b.allowed_models, b.weight) == (8, None, 0, ("*",), 1.0)
    assert (b.priority_ceiling, b.default_priority) == (PRIORITIES["high"], PRIORITIES["normal"])
    assert b.model_dump()["priority_ceiling"] == "high"  # dumps as written
    # Every field is documented, so `--help`-style listings and the README can be generated from it.
    assert all(f.description for f in Tenant.model_fields.values())


def test_toml_file_loads(tmp_path):
    path = _write(tmp_path, f'[[tenants]]\nname = "a"\napi_key_sha256 = "{KEY_A}"\ntokens_per_minute = 10\n',
                  "tenants.toml")
    assert TenantRegistry.from_file(path).authenticate("key-a").tokens_per_minute == 10


def test_ceiling_low_without_default_gets_low(tmp_path):
    tenant = TenantRegistry.from_file(_one(tmp_path, "    priority_ceiling: low\n")).authenticate("key-a")
    assert tenant.default_priority == tenant.priority_ceiling == PRIORITIES["low"]


def test_unknown_key_is_refused_with_tenant_and_key(tmp_path):
    message = _refused(_one(tmp_path, "    tokens_per_mintue: 1000\n"))
    assert message == (f"{tmp_path / 'tenants.yaml'}: tenant 'search-team': unknown key 'tokens_per_mintue' "
                       "(did you mean 'tokens_per_minute'?)")


@pytest.mark.parametrize(("extra", "expected"), [
    ("    max_in_flight: '8'\n", "key 'max_in_flight': must be an integer (got '8')"),
    ("    max_in_flight: 8.5\n", "key 'max_in_flight': must be an integer (got 8.5)"),
    ("    max_prompt_tokens: true\n", "key 'max_prompt_tokens': must be an integer (got True)"),
    ("    weight: heavy\n", "key 'weight': must be a number (got 'heavy')"),
    ("    allowed_models: m1\n", "key 'allowed_models': must be a list (got 'm1')"),
    ("    allowed_models: [m1, 3]\n", "key 'allowed_models.1': must be a string (quote it) (got 3)"),
    ("    priority_ceiling: 3\n", "key 'priority_ceiling': must be one of low, normal, high (got 3)"),
    ("    priority_ceiling: urgent\n", "key 'priority_ceiling': must be one of low, normal, high (got 'urgent')"),
])
def test_bad_type_is_refused(tmp_path, extra, expected):
    assert _refused(_one(tmp_path, extra)) == f"{tmp_path / 'tenants.yaml'}: tenant 'search-team': {expected}"


@pytest.mark.parametrize(("extra", "expected"), [
    ("    max_in_flight: 0\n", "key 'max_in_flight': Input should be greater than or equal to 1"),
    ("    max_queued: -1\n", "key 'max_queued': Input should be greater than or equal to 0"),
    ("    tokens_per_minute: -5\n", "key 'tokens_per_minute': Input should be greater than or equal to 0"),
    ("    max_tokens_cap: -1\n", "key 'max_tokens_cap': Input should be greater than or equal to 0"),
    ("    weight: 0\n", "key 'weight': Input should be greater than 0"),
    ("    weight: .nan\n", "key 'weight': Input should be a finite number"),
    ("    allowed_models: []\n", "key 'allowed_models': must not be empty"),
    ("    priority_ceiling: normal\n    default_priority: high\n",
     "key 'default_priority': high is above priority_ceiling normal"),
])
def test_impossible_value_is_refused(tmp_path, extra, expected):
    assert _refused(_one(tmp_path, extra)).startswith(f"{tmp_path / 'tenants.yaml'}: tenant 'search-team': {expected}")


def test_a_plain_key_is_refused_and_never_echoed(tmp_path):
    path = _write(tmp_path, "tenants:\n  - name: a\n    api_key_sha256: my-secret-api-key\n")
    message = _refused(path)
    assert "tenant 'a': key 'api_key_sha256': must be a SHA-256 hex digest" in message
    assert "my-secret-api-key" not in message


def test_unnamed_tenants_are_named_by_position_and_every_problem_listed(tmp_path):
    path = _write(tmp_path, f"tenants:\n  - name: ok\n    api_key_sha256: {KEY_A}\n"
                            f"  - api_key_sha256: {KEY_B}\n    max_in_fligth: 2\n  - just-a-string\n"
                            "  - name: bad/name\n    api_key_sha256: " + "0" * 64 + "\n")  # YAML: an int
    lines = _refused(path).splitlines()
    src = str(path)
    assert lines[0] == f"{src}: tenant #2: missing key 'name'"
    assert lines[1] == f"{src}: tenant #2: unknown key 'max_in_fligth' (did you mean 'max_in_flight'?)"
    assert lines[2] == f"{src}: tenant #3: expected a mapping of keys, got str"
    assert lines[3].startswith(f"{src}: tenant 'bad/name': key 'name': String should match pattern")
    assert lines[4] == f"{src}: tenant 'bad/name': key 'api_key_sha256': must be a string (quote it)"
    assert len(lines) == 5


def test_duplicates_are_refused(tmp_path):
    src = tmp_path / "tenants.yaml"
    dup_name = _write(tmp_path, f"tenants:\n  - {{name: a, api_key_sha256: {KEY_A}}}\n"
                                f"  - {{name: a, api_key_sha256: {KEY_B}}}\n")
    assert _refused(dup_name) == f"{src}: tenant 'a': duplicate name"
    dup_key = _write(tmp_path, f"tenants:\n  - {{name: a, api_key_sha256: {KEY_A}}}\n"
                               f"  - {{name: b, api_key_sha256: {KEY_A.upper()}}}\n")
    assert _refused(dup_key) == (f"{src}: tenant 'b': same api_key_sha256 as tenant 'a' "
                                 "(one key must map to one tenant)")


@pytest.mark.parametrize(("body", "expected"), [
    ("tenant: []\n", ["missing top-level key 'tenants'", "unknown top-level key 'tenant' (did you mean 'tenants'?)"]),
    (f"version: 2\ntenants:\n  - {{name: a, api_key_sha256: {KEY_A}}}\n",
     ["top-level key 'version': Input should be 1"]),
    ("tenants: []\n", ["top-level key 'tenants': must not be empty"]),
    ("", ["expected a mapping with a top-level 'tenants' list"]),
    ("tenants: [\n", ["not valid YAML"]),
])
def test_top_level_is_validated(tmp_path, body, expected):
    lines = _refused(_write(tmp_path, body)).splitlines()
    assert len(lines) == len(expected)
    for line, want in zip(lines, expected, strict=True):
        assert line.startswith(f"{tmp_path / 'tenants.yaml'}: {want}")


def test_missing_file_is_a_tenants_file_error(tmp_path):
    assert "cannot read" in _refused(tmp_path / "absent.yaml")
