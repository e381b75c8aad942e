"""The transport security section every service's settings compose, and nothing else.

Today the only mode is ``plaintext`` (loopback and trusted networks); TLS and mutual TLS arrive in a
later release as further modes of this same section, so every place that opens a channel or binds a
port already takes one (`services.channels`). Key material is never echoed: secret fields are
`SecretStr`, shown as ``**********`` by repr and ``--help``.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class SecuritySettings(BaseModel):
    """How a service's gRPC server and its channels to other services are secured."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    mode: Literal["plaintext"] = Field(
        "plaintext", description="transport security: plaintext (TLS and mTLS are planned modes of this setting)")


PLAINTEXT = SecuritySettings()
