"""Tenants: who may call, with which limits — a validated schema loaded from a YAML or TOML file.

Keys are stored as SHA-256 hex digests, never in plain text::

    version: 1                            # optional; 1 is the only version
    tenants:
      - name: search-team
        api_key_sha256: 5e884898da...     # `tokenrelay hash-key KEY` prints it
        max_in_flight: 8                  # concurrent requests, cluster-wide (the admission queue's leases)
        max_prompt_tokens: 0              # 0 = the model's context
        max_tokens_cap: 0                 # 0 = the model's context
        allowed_models: ["*"]
        priority_ceiling: high            # low | normal | high
        default_priority: normal
        weight: 1                         # share of the engines when tenants compete (fair queue)
        max_queued: 64                    # requests waiting in the queue (unset = the router's default)
        tokens_per_minute: 0              # prompt + completion tokens per minute (0 = unlimited)
        allow_control_tokens: false       # special-token text in prompts/messages is parsed as tokens

Every field of `Tenant` is documented there. A file with an unknown key, a value of the wrong type
or out of range, two tenants of one name or one key refuses to load as a whole (`TenantsFileError`,
one line per problem naming the file, the tenant and the key); nothing is ever served with a limit
silently dropped. Reloading at runtime is `router_svc.tenants_reload`.
"""

from __future__ import annotations

import difflib
import hashlib
import hmac
import pathlib
import sys
from collections.abc import Sequence
from typing import Annotated, Any, Literal, Protocol

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictInt,
    StrictStr,
    ValidationError,
    ValidationInfo,
    field_serializer,
    field_validator,
    model_validator,
)

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

from services.errors import Reason

PRIORITIES = {"low": 1, "normal": 2, "high": 3}
PRIORITY_NAMES = {v: k for k, v in PRIORITIES.items()}
_HEX = "0123456789abcdef"
# Values never echoed in a message: a key pasted into api_key_sha256 by mistake must not reach a log.
_NEVER_ECHO = {"api_key_sha256"}
# pydantic's wording speaks Python ("a valid tuple"); the reader of this message edits YAML or TOML.
_PLAIN = {"int_type": "must be an integer", "float_type": "must be a number",
          "string_type": "must be a string (quote it)", "tuple_type": "must be a list",
          "list_type": "must be a list", "dict_type": "must be a mapping", "too_short": "must not be empty"}

Count = Annotated[StrictInt, Field(ge=0, le=2**31 - 1)]


def hash_key(api_key: str) -> str:
    return hashlib.sha256(api_key.encode()).hexdigest()


class TenantsFileError(ValueError):
    """The tenants file cannot be served: unreadable, unparsable, or failing the schema."""


class Tenant(BaseModel):
    """One caller of the router: its key, its limits and what it may ask for."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    name: StrictStr = Field(
        pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$",
        description="unique id of the tenant: 1-64 letters, digits, '.', '_', '-' (starting with a letter "
                    "or digit). Labels metrics and logs, names the Redis lease key and scopes session ids "
                    "and request ids, so it never contains '/' or ':'.")
    api_key_sha256: StrictStr = Field(
        description="SHA-256 hex digest (64 hex digits) of the tenant's API key, never the key itself "
                    "(`tokenrelay hash-key KEY`). Unique across tenants.")
    max_in_flight: Annotated[StrictInt, Field(ge=1, le=2**31 - 1)] = Field(
        8, description="requests the tenant may have in flight at once, cluster-wide (Redis leases); "
                             "one more is refused with RESOURCE_EXHAUSTED/TENANT_CONCURRENCY_LIMIT.")
    max_queued: Count | None = Field(
        None, description="requests of the tenant that may wait in the admission queue (for its own "
                          "max_in_flight or for room in the engine pool); unset = the router's "
                          "--default-max-queued; 0 = never wait: refused at once with TENANT_CONCURRENCY_LIMIT "
                          "or TENANT_QUEUE_FULL.")
    tokens_per_minute: Count = Field(
        0, description="prompt + completion tokens the tenant may use per minute, cluster-wide; 0 = unlimited. "
                       "Charged at admission on the estimate (prompt + max_tokens), settled with the actual "
                       "tokens when the request ends (a reply that runs past the budget is not cut; its overrun "
                       "is charged). A request waits in the queue while the budget refills, or is refused with "
                       "TOKEN_RATE_LIMITED and a retry-after when that wait is beyond its deadline.")
    max_prompt_tokens: Count = Field(
        0, description="longest prompt in tokens, after the chat template; 0 = the model's context. "
                       "Longer is refused with INVALID_ARGUMENT/PROMPT_TOO_LONG.")
    max_tokens_cap: Count = Field(
        0, description="largest max_tokens a request may ask for; 0 = the model's context. More is refused "
                       "with INVALID_ARGUMENT/INVALID_MAX_TOKENS.")
    allowed_models: tuple[Annotated[StrictStr, Field(min_length=1)], ...] = Field(
        ("*",), min_length=1,
        description="model names the tenant may request; \"*\" = any. A request naming no model is served "
                    "the default model. Others are refused with PERMISSION_DENIED/MODEL_NOT_ALLOWED.")
    priority_ceiling: int = Field(
        PRIORITIES["high"], description="highest priority the tenant may ask for: low | normal | high. Above "
                                        "it a request is refused with PERMISSION_DENIED/PRIORITY_NOT_ALLOWED.")
    default_priority: int = Field(
        PRIORITIES["normal"], description="priority of a request that names none: low | normal | high, at most "
                                          "priority_ceiling (default: normal, or low when the ceiling is low).")
    allow_control_tokens: bool = Field(
        False, strict=True,
        description="whether special-token text in the tenant's prompt or chat messages (\"<|endoftext|>\", "
                    "\"<end_of_turn>\", ...) is parsed as the control tokens it spells. false (the default): it "
                    "is tokenized as ordinary text, so a tenant cannot forge turn markers or end-of-text; the "
                    "chat template's own tokens stay control tokens either way.")
    weight: float = Field(
        1.0, gt=0, le=1e6, strict=True,
        description="the tenant's share when tenants compete for the engines, relative to the others' "
                    "weights: within a priority class, backlogged tenants are served tokens in proportion "
                    "to their weights (start-time fair queuing on prompt + completion tokens).")

    @model_validator(mode="before")
    @classmethod
    def _default_priority_under_ceiling(cls, data: Any) -> Any:
        # A tenant capped at `low` that names no default gets `low`, not a default above its own ceiling.
        if isinstance(data, dict) and "default_priority" not in data \
                and str(data.get("priority_ceiling", "")).lower() == "low":
            return {**data, "default_priority": "low"}
        return data

    @field_validator("api_key_sha256", mode="after")
    @classmethod
    def _digest(cls, value: str) -> str:
        digest = value.lower()
        if len(digest) != 64 or any(c not in _HEX for c in digest):
            raise ValueError("must be a SHA-256 hex digest (64 hex digits; `tokenrelay hash-key KEY`), "
                             "never the key itself")
        return digest

    @field_validator("priority_ceiling", "default_priority", mode="before")
    @classmethod
    def _priority(cls, value: Any) -> int:
        if not isinstance(value, str) or value.lower() not in PRIORITIES:
            raise ValueError(f"must be one of low, normal, high (got {value!r})")
        return PRIORITIES[value.lower()]

    @field_validator("default_priority", mode="after")
    @classmethod
    def _under_ceiling(cls, value: int, info: ValidationInfo) -> int:
        ceiling = info.data.get("priority_ceiling")
        if ceiling is not None and value > ceiling:
            raise ValueError(f"{PRIORITY_NAMES[value]} is above priority_ceiling {PRIORITY_NAMES[ceiling]}")
        return value

    @field_serializer("priority_ceiling", "default_priority")
    def _priority_name(self, value: int) -> str:
        return PRIORITY_NAMES[value]

    def check_model(self, model: str) -> None:
        if model and "*" not in self.allowed_models and model not in self.allowed_models:
            raise Reason.MODEL_NOT_ALLOWED.error(f"tenant {self.name!r} may not use model {model!r}")

    def resolve_priority(self, requested: int) -> int:
        priority = requested or self.default_priority
        if priority > self.priority_ceiling:
            raise Reason.PRIORITY_NOT_ALLOWED.error(f"tenant {self.name!r} may not use priority {priority}")
        return priority


def tenant_limits(tenant: Tenant, default_max_queued: int) -> tuple[int, int, int, float]:
    """The admission queue's view of a tenant: max_in_flight, max_queued, tokens_per_minute, weight."""
    queued = default_max_queued if tenant.max_queued is None else tenant.max_queued
    return tenant.max_in_flight, queued, tenant.tokens_per_minute, tenant.weight


class _TenantsFile(BaseModel):
    model_config = ConfigDict(extra="forbid")

    version: Literal[1] = 1
    tenants: list[Any] = Field(min_length=1)


class Authenticator(Protocol):
    """What the servicer needs: an API key in, the caller's tenant out (or Unauthenticated)."""

    def authenticate(self, api_key: str | None) -> Tenant: ...


def _key(loc: Sequence[int | str]) -> str:
    return ".".join(str(part) for part in loc)


def _problem(err: Any, fields: set[str], what: str = "key") -> str:
    key, kind = _key(err["loc"]), err["type"]
    if kind == "extra_forbidden":
        close = difflib.get_close_matches(key, fields, n=1)
        return f"unknown {what} {key!r}" + (f" (did you mean {close[0]!r}?)" if close else "")
    if kind == "missing":
        return f"missing {what} {key!r}"
    msg = _PLAIN.get(kind) or err["msg"].removeprefix("Value error, ")
    if str(err["loc"][0]) in _NEVER_ECHO or "input" not in err or kind == "value_error":
        return f"{what} {key!r}: {msg}"
    return f"{what} {key!r}: {msg} (got {err['input']!r})"


def _who(raw: Any, index: int) -> str:
    name = raw.get("name") if isinstance(raw, dict) else None
    return f"tenant {name!r}" if isinstance(name, str) and name else f"tenant #{index + 1}"


def parse_tenants(data: Any, source: str) -> list[Tenant]:
    """Validate a parsed tenants document; raise TenantsFileError listing every problem."""
    if not isinstance(data, dict):
        raise TenantsFileError(f"{source}: expected a mapping with a top-level 'tenants' list")
    try:
        doc = _TenantsFile.model_validate(data)
    except ValidationError as exc:
        raise TenantsFileError("\n".join(
            f"{source}: {_problem(e, set(_TenantsFile.model_fields), 'top-level key')}"
            for e in exc.errors())) from None
    problems: list[str] = []
    tenants: list[Tenant] = []
    fields = set(Tenant.model_fields)
    for i, raw in enumerate(doc.tenants):
        who = _who(raw, i)
        if not isinstance(raw, dict):
            problems.append(f"{source}: {who}: expected a mapping of keys, got {type(raw).__name__}")
            continue
        try:
            tenants.append(Tenant.model_validate(raw))
        except ValidationError as exc:
            problems.extend(f"{source}: {who}: {_problem(e, fields)}" for e in exc.errors())
    names: dict[str, Tenant] = {}
    hashes: dict[str, Tenant] = {}
    for t in tenants:
        if t.name in names:
            problems.append(f"{source}: tenant {t.name!r}: duplicate name")
        if t.api_key_sha256 in hashes:
            problems.append(f"{source}: tenant {t.name!r}: same api_key_sha256 as tenant "
                            f"{hashes[t.api_key_sha256].name!r} (one key must map to one tenant)")
        names.setdefault(t.name, t)
        hashes.setdefault(t.api_key_sha256, t)
    if problems:
        raise TenantsFileError("\n".join(problems))
    return tenants


def load_text(text: str, source: str, *, toml: bool) -> list[Tenant]:
    try:
        data = tomllib.loads(text) if toml else yaml.safe_load(text)
    except (tomllib.TOMLDecodeError, yaml.YAMLError) as exc:
        where = " ".join(str(exc).replace('in "<unicode string>", ', "").split())  # one line per problem
        raise TenantsFileError(f"{source}: not valid {'TOML' if toml else 'YAML'}: {where}") from None
    return parse_tenants(data, source)


class TenantRegistry:
    """Authenticates API keys against hashed keys (constant-time compare). Immutable once built."""

    def __init__(self, tenants: Sequence[Tenant]) -> None:
        self.tenants = tuple(tenants)
        self._by_hash = {t.api_key_sha256: t for t in self.tenants}
        if len({t.name for t in self.tenants}) != len(self.tenants) or len(self._by_hash) != len(self.tenants):
            raise TenantsFileError("duplicate tenant names or API key hashes")

    @classmethod
    def from_text(cls, text: str, source: str, *, toml: bool = False) -> TenantRegistry:
        return cls(load_text(text, source, toml=toml))

    @classmethod
    def from_file(cls, path: str | pathlib.Path) -> TenantRegistry:
        path = pathlib.Path(path)
        try:
            text = path.read_text()
        except (OSError, UnicodeDecodeError) as exc:
            raise TenantsFileError(f"{path}: cannot read: {exc}") from None
        return cls.from_text(text, str(path), toml=path.suffix == ".toml")

    def authenticate(self, api_key: str | None) -> Tenant:
        if not api_key:
            raise Reason.MISSING_API_KEY.error("missing API key (metadata 'authorization: Bearer <key>')")
        digest = hash_key(api_key)
        tenant = self._by_hash.get(digest)
        # Dict lookup leaks nothing useful (the digest is of the caller's own input); compare
        # anyway in constant time so a future lookup change can't introduce a timing oracle.
        if tenant is None or not hmac.compare_digest(tenant.api_key_sha256, digest):
            raise Reason.INVALID_API_KEY.error("unknown API key")
        return tenant


def api_key_from_metadata(metadata: tuple[tuple[str, str | bytes], ...] | None) -> str | None:
    for key, value in metadata or ():
        if isinstance(value, bytes):
            continue
        if key == "authorization":
            scheme, _, token = value.partition(" ")
            if scheme.lower() != "bearer" or not token:
                raise Reason.BAD_AUTHORIZATION.error("authorization must be 'Bearer <key>'")
            return token.strip()
        if key == "x-api-key":
            return value.strip()
    return None
