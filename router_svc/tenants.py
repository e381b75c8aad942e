"""Tenants: who may call, with which limits. Loaded from a YAML or TOML file.

Keys are stored as SHA-256 hex digests, never in plain text::

    tenants:
      - name: search-team
        api_key_sha256: 5e884898da...     # `tokenrelay hash-key KEY` prints it
        max_in_flight: 8                  # concurrent requests, cluster-wide (Redis leases)
        max_prompt_tokens: 0              # 0 = the model's context
        max_tokens_cap: 0                 # 0 = the model's context
        allowed_models: ["*"]
        priority_ceiling: high            # low | normal | high
        default_priority: normal
        weight: 1
"""

from __future__ import annotations

import hashlib
import hmac
import pathlib
import sys
from dataclasses import dataclass, field

import yaml

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

from services.errors import InvalidArgument, PermissionDenied, Unauthenticated

PRIORITIES = {"low": 1, "normal": 2, "high": 3}


def hash_key(api_key: str) -> str:
    return hashlib.sha256(api_key.encode()).hexdigest()


@dataclass(frozen=True)
class Tenant:
    name: str
    api_key_sha256: str
    max_in_flight: int = 8
    max_prompt_tokens: int = 0
    max_tokens_cap: int = 0
    allowed_models: tuple[str, ...] = ("*",)
    priority_ceiling: int = PRIORITIES["high"]
    default_priority: int = PRIORITIES["normal"]
    weight: float = 1.0
    extra: dict[str, object] = field(default_factory=dict, compare=False)

    def check_model(self, model: str) -> None:
        if model and "*" not in self.allowed_models and model not in self.allowed_models:
            raise PermissionDenied(f"tenant {self.name!r} may not use model {model!r}", "MODEL_NOT_ALLOWED")

    def resolve_priority(self, requested: int) -> int:
        priority = requested or self.default_priority
        if priority > self.priority_ceiling:
            raise PermissionDenied(f"tenant {self.name!r} may not use priority {priority}",
                                   "PRIORITY_NOT_ALLOWED")
        return priority


def _priority(value: object, default: str) -> int:
    name = str(value if value is not None else default).lower()
    if name not in PRIORITIES:
        raise ValueError(f"unknown priority {value!r} (expected one of {sorted(PRIORITIES)})")
    return PRIORITIES[name]


def _tenant(raw: dict[str, object]) -> Tenant:
    known = {"name", "api_key_sha256", "max_in_flight", "max_prompt_tokens", "max_tokens_cap",
             "allowed_models", "priority_ceiling", "default_priority", "weight"}
    digest = str(raw.get("api_key_sha256", "")).lower()
    if len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest):
        raise ValueError(f"tenant {raw.get('name')!r}: api_key_sha256 must be a SHA-256 hex digest")
    return Tenant(
        name=str(raw["name"]), api_key_sha256=digest,
        max_in_flight=int(raw.get("max_in_flight", 8)),  # type: ignore[call-overload]
        max_prompt_tokens=int(raw.get("max_prompt_tokens", 0)),  # type: ignore[call-overload]
        max_tokens_cap=int(raw.get("max_tokens_cap", 0)),  # type: ignore[call-overload]
        allowed_models=tuple(raw.get("allowed_models", ["*"])),  # type: ignore[arg-type]
        priority_ceiling=_priority(raw.get("priority_ceiling"), "high"),
        default_priority=_priority(raw.get("default_priority"), "normal"),
        weight=float(raw.get("weight", 1.0)),  # type: ignore[arg-type]
        extra={k: v for k, v in raw.items() if k not in known},
    )


class TenantRegistry:
    """Authenticates API keys against hashed keys (constant-time compare)."""

    def __init__(self, tenants: list[Tenant]) -> None:
        names = [t.name for t in tenants]
        if len(set(names)) != len(names):
            raise ValueError("duplicate tenant names")
        self._by_hash = {t.api_key_sha256: t for t in tenants}
        self.tenants = tenants

    @classmethod
    def from_file(cls, path: str | pathlib.Path) -> TenantRegistry:
        path = pathlib.Path(path)
        text = path.read_text()
        data = tomllib.loads(text) if path.suffix == ".toml" else yaml.safe_load(text)
        if not isinstance(data, dict) or not isinstance(data.get("tenants"), list):
            raise ValueError(f"{path}: expected a top-level 'tenants' list")
        return cls([_tenant(t) for t in data["tenants"]])

    def authenticate(self, api_key: str | None) -> Tenant:
        if not api_key:
            raise Unauthenticated("missing API key (metadata 'authorization: Bearer <key>')",
                                  "MISSING_API_KEY")
        digest = hash_key(api_key)
        tenant = self._by_hash.get(digest)
        # Dict lookup leaks nothing useful (the digest is of the caller's own input); compare
        # anyway in constant time so a future lookup change can't introduce a timing oracle.
        if tenant is None or not hmac.compare_digest(tenant.api_key_sha256, digest):
            raise Unauthenticated("unknown API key", "INVALID_API_KEY")
        return tenant


def api_key_from_metadata(metadata: tuple[tuple[str, str | bytes], ...] | None) -> str | None:
    for key, value in metadata or ():
        if isinstance(value, bytes):
            continue
        if key == "authorization":
            scheme, _, token = value.partition(" ")
            if scheme.lower() != "bearer" or not token:
                raise InvalidArgument("authorization must be 'Bearer <key>'", "BAD_AUTHORIZATION")
            return token.strip()
        if key == "x-api-key":
            return value.strip()
    return None
