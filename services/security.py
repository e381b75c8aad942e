"""The transport security section every service's settings compose, and the checks of its files.

One section says both sides of a process (docs/security.md):

- ``mode`` secures this process's own gRPC server port: ``plaintext``; ``tls`` (it presents
  ``cert_file``/``key_file``; callers need no certificate: the router's public port); ``mtls``
  (callers must also present a certificate signed by a CA in ``ca_file``, or the handshake fails:
  the tokenizer's and engines' ports).
- ``client_mode`` secures the channels it opens (the router's to tokenizers and engines, health
  checks, the client library); unset = the same as ``mode``. ``tls`` verifies the server against
  ``ca_file`` (empty: gRPC's default roots) and the host of the address, or ``server_name``; ``mtls``
  also presents ``client_cert_file``/``client_key_file`` (default: ``cert_file``/``key_file``).

Key material stays in files: the settings hold paths only, so nothing secret can reach a log. The
files are checked when the settings are built (one line per problem: missing, unreadable, not PEM,
an encrypted key, a key that does not match its certificate, an expired certificate), with the
standard library's ssl module; `services.channels` reads them when it binds or opens.
"""

from __future__ import annotations

import datetime
import os
import ssl
from collections.abc import Sequence
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic_core import PydanticCustomError

Mode = Literal["plaintext", "tls", "mtls"]


# -- checks of PEM files (shared with router_svc's Redis settings) --------------------------------

def _read_text(path: str) -> str:
    if not os.path.exists(path):
        raise ValueError(f"{path}: no such file")
    if not os.path.isfile(path):
        raise ValueError(f"{path}: not a regular file")
    try:
        with open(path, "rb") as f:
            return f.read(1 << 20).decode("ascii", errors="replace")
    except OSError as exc:
        raise ValueError(f"{path}: cannot read it ({exc.strerror or exc})") from None


def _decode_cert(path: str) -> dict[str, Any] | None:
    """The first certificate of a PEM file as the ssl module decodes a peer's (None when this
    Python's ssl lacks the decoder; it is CPython's, present since 2.7 but not public API)."""
    decode = getattr(getattr(ssl, "_ssl", None), "_test_decode_cert", None)
    if decode is None:
        return None
    try:
        return decode(path)  # type: ignore[no-any-return]
    except (ssl.SSLError, OSError, ValueError):
        return None


def check_cert_file(path: str) -> str:
    """``path`` if it holds a readable, currently valid PEM certificate (chain); else ValueError."""
    if "-----BEGIN CERTIFICATE-----" not in _read_text(path):
        raise ValueError(f"{path}: no PEM certificate in it (-----BEGIN CERTIFICATE-----)")
    cert = _decode_cert(path)
    if cert is None:
        return path
    now = datetime.datetime.now(datetime.timezone.utc).timestamp()
    if "notAfter" in cert and ssl.cert_time_to_seconds(cert["notAfter"]) < now:
        raise ValueError(f"{path}: the certificate expired on {cert['notAfter']}")
    if "notBefore" in cert and ssl.cert_time_to_seconds(cert["notBefore"]) > now:
        raise ValueError(f"{path}: the certificate is not valid before {cert['notBefore']}")
    return path


def check_key_file(path: str) -> str:
    """``path`` if it holds a readable, unencrypted PEM private key; else ValueError."""
    text = _read_text(path)
    if "ENCRYPTED" in text:
        raise ValueError(f"{path}: the private key is encrypted (tokenrelay reads unencrypted keys; "
                         "protect the file with its permissions)")
    if "PRIVATE KEY-----" not in text:
        raise ValueError(f"{path}: no PEM private key in it (-----BEGIN ... PRIVATE KEY-----)")
    return path


def check_ca_file(path: str) -> str:
    """``path`` if it holds at least one PEM certificate the ssl module loads as a trust anchor."""
    if "-----BEGIN CERTIFICATE-----" not in _read_text(path):
        raise ValueError(f"{path}: no PEM certificate in it (-----BEGIN CERTIFICATE-----)")
    try:
        ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT).load_verify_locations(cafile=path)
    except ssl.SSLError as exc:
        raise ValueError(f"{path}: cannot load it as CA certificates ({exc.reason or exc})") from None
    return path


def check_pair(cert: str, key: str) -> str | None:
    """Why ``key`` cannot serve ``cert`` (None when it can): loaded together as OpenSSL would."""
    try:
        ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_cert_chain(cert, key)
    except ssl.SSLError as exc:
        if "key values mismatch" in str(exc).lower():   # OpenSSL: X509 KEY_VALUES_MISMATCH
            return f"the private key in {key} does not match the certificate in {cert}"
        return f"cannot load {cert} with the key {key} ({exc.reason or exc})"
    except OSError as exc:
        return f"cannot load {cert} with the key {key} ({exc.strerror or exc})"
    return None


def _conflict(message: str, *fields: str) -> PydanticCustomError:
    # services.config.conflict's shape (that module imports this one): the loader names the fields.
    return PydanticCustomError("settings_conflict", message, {"fields": fields})


# -- the section ----------------------------------------------------------------------------------

class SecuritySettings(BaseModel):
    """How a service's gRPC server and its channels to other services are secured."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    mode: Mode = Field("plaintext", description="this service's server port: plaintext, tls (presents "
                       "--security-cert-file; callers need no certificate) or mtls (callers must also present "
                       "a certificate signed by a CA in --security-ca-file)")
    client_mode: Mode | None = Field(None, description="the channels this process opens (the router's to "
                                     "tokenizers and engines, health checks): plaintext, tls (verify the "
                                     "server against --security-ca-file) or mtls (also present a client "
                                     "certificate); unset = the same as --security-mode")
    cert_file: str = Field("", description="PEM certificate (chain) this process presents: its server's, and "
                           "its client certificate on mtls channels unless --security-client-cert-file is set")
    key_file: str = Field("", description="PEM private key of --security-cert-file (unencrypted; keep the "
                          "file private; never read into logs)")
    ca_file: str = Field("", description="PEM CA certificates this process trusts: they verify the servers "
                         "it calls (empty = gRPC's default roots) and, in mtls mode, its callers' certificates")
    client_cert_file: str = Field("", description="PEM client certificate for mtls channels (empty = "
                                  "--security-cert-file)")
    client_key_file: str = Field("", description="PEM private key of --security-client-cert-file")
    server_name: str = Field("", max_length=253, description="name to verify in the certificates of the "
                             "servers this process calls instead of the host in their address (one shared "
                             "certificate, addresses by IP)")

    @field_validator("cert_file", "client_cert_file")
    @classmethod
    def _certificate(cls, path: str) -> str:
        return check_cert_file(path) if path else path

    @field_validator("key_file", "client_key_file")
    @classmethod
    def _private_key(cls, path: str) -> str:
        return check_key_file(path) if path else path

    @field_validator("ca_file")
    @classmethod
    def _authorities(cls, path: str) -> str:
        return check_ca_file(path) if path else path

    @property
    def channel_mode(self) -> str:
        """How this process's own channels are secured (``client_mode``, else ``mode``)."""
        return self.client_mode or self.mode

    @property
    def client_identity(self) -> tuple[str, str]:
        """The certificate and key this process presents on mtls channels."""
        if self.client_cert_file:
            return self.client_cert_file, self.client_key_file
        return self.cert_file, self.key_file

    @model_validator(mode="after")
    def _consistent(self) -> SecuritySettings:
        needed: list[str] = []
        if self.mode in ("tls", "mtls"):
            needed += ["cert_file", "key_file"]
        if self.mode == "mtls":
            needed.append("ca_file")
        missing = [f for f in needed if not getattr(self, f)]
        if missing:
            raise _conflict(f"--security-mode {self.mode} needs {_and(missing)}", "mode", *missing)
        if bool(self.client_cert_file) != bool(self.client_key_file):
            raise _conflict("set both a client certificate and its key, or neither", "client_cert_file",
                            "client_key_file")
        if self.channel_mode == "mtls" and not all(self.client_identity):
            raise _conflict("mtls channels need a client certificate and key (--security-client-cert-file and "
                            "--security-client-key-file, or --security-cert-file and --security-key-file)",
                            "client_mode", "cert_file", "key_file")
        used = {"cert_file": self.mode != "plaintext" or (self.channel_mode == "mtls" and not self.client_cert_file),
                "key_file": self.mode != "plaintext" or (self.channel_mode == "mtls" and not self.client_cert_file),
                "ca_file": self.mode == "mtls" or self.channel_mode != "plaintext",
                "client_cert_file": self.channel_mode == "mtls", "client_key_file": self.channel_mode == "mtls",
                "server_name": self.channel_mode != "plaintext"}
        unused = [f for f, is_used in used.items() if getattr(self, f) and not is_used]
        if unused:   # most likely a forgotten --security-mode: refuse rather than serve plaintext
            one = len(unused) == 1
            raise _conflict(f"{_and(unused)} {'is' if one else 'are'} set, but neither --security-mode "
                            f"{self.mode} nor channels in {self.channel_mode} use {'it' if one else 'them'}",
                            "mode", "client_mode", *unused)
        pairs = [(self.cert_file, self.key_file)] if self.cert_file and self.key_file else []
        if self.client_cert_file and self.client_key_file:
            pairs.append((self.client_cert_file, self.client_key_file))
        for cert, key in pairs:
            problem = check_pair(cert, key)
            if problem:
                fields = ("cert_file", "key_file") if cert == self.cert_file else ("client_cert_file",
                                                                                     "client_key_file")
                raise _conflict(problem, *fields)
        return self

    @classmethod
    def for_client(cls, ca_file: str = "", *, cert_file: str = "", key_file: str = "",
                   server_name: str = "") -> SecuritySettings:
        """Settings of a client only (no server): tls with ``ca_file`` (empty = gRPC's default roots),
        mtls when a certificate and key are given too."""
        return cls(client_mode="mtls" if cert_file else "tls", ca_file=ca_file, client_cert_file=cert_file,
                   client_key_file=key_file, server_name=server_name)

    def self_client(self) -> SecuritySettings:
        """The channel side that reaches this process's own server (health probes of itself): its
        server's mode, trusting its own certificate (whichever CA signed it) under a name in it."""
        if self.mode == "plaintext":
            return self.model_copy(update={"client_mode": "plaintext"})
        return self.model_copy(update={"client_mode": self.mode, "ca_file": self.cert_file,
                                       "server_name": certificate_name(self.cert_file)})


def certificate_name(path: str) -> str:
    """A name the certificate in ``path`` is valid for: its first DNS name, else its first IP
    address, else its common name ("" when it cannot be decoded)."""
    cert = _decode_cert(path) or {}
    sans = cert.get("subjectAltName", ())
    for kind in ("DNS", "IP Address"):
        for key, value in sans:
            if key == kind:   # a wildcard name: one name it covers
                return "probe" + str(value).strip()[1:] if str(value).startswith("*.") else str(value).strip()
    for rdn in cert.get("subject", ()):
        for key, value in rdn:
            if key == "commonName":
                return str(value)
    return ""


def _and(fields: Sequence[str]) -> str:
    flags = [f"--security-{f.replace('_', '-')}" for f in fields]
    return flags[0] if len(flags) == 1 else ", ".join(flags[:-1]) + " and " + flags[-1]


PLAINTEXT = SecuritySettings()
