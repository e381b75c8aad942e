"""Settings: one validated pydantic model per service, and the one loader that fills it.

A service's settings model composes sections (`ServerSettings`, `TelemetrySettings`,
`services.security.SecuritySettings`, and its own: an engine backend's config, the router's admission
section, ...). Every leaf field has a *flat name* (``sim_decode_step_time``): the section's flag prefix
plus the field name, or the name given with ``flag()``. It gives the flag (``--sim-decode-step-time``)
and the environment variable (``TOKENRELAY_ENGINE_SIM_DECODE_STEP_TIME``); in a config file the field
is nested by section (``sim: {decode_step_time: 0.001}``).

Precedence: flag > environment variable > config file (``--config FILE`` or ``<PREFIX>CONFIG``,
YAML or TOML) > default. Bad values of any source end the process with status 2 and one line per
problem naming the flag, the variable and the file key, as argparse does; secrets (`SecretStr`, the
password in a Redis URL) are never echoed.

Keyword construction takes the flat names as well (``EngineSettings(port=0, sim_vocab_size=1000)``),
which is what tests and tools use; configuration files take only the nested form.
"""

from __future__ import annotations

import argparse
import difflib
import os
import pathlib
import re
import sys
import types
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cache
from typing import Annotated, Any, ClassVar, Literal, NoReturn, TypeVar

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PlainSerializer,
    SecretStr,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic.fields import FieldInfo
from pydantic_core import PydanticCustomError
from pydantic_settings import TomlConfigSettingsSource, YamlConfigSettingsSource

from services.eventloop import LoopChoice, LoopUnavailable, resolve
from services.security import SecuritySettings

S = TypeVar("S", bound="Settings")

_URL_PASSWORD = re.compile(r"(?P<head>[a-z][a-z0-9+.-]*://[^:/@\s]*:)(?P<password>[^@\s]+)(?=@)", re.I)


def mask_url(url: str) -> str:
    """The URL with any password replaced by ``***`` (``redis://:pw@host`` -> ``redis://:***@host``)."""
    return _URL_PASSWORD.sub(r"\g<head>***", url)


# A URL that may carry a password: masked in repr, in JSON dumps (logs) and in error messages.
MaskedUrl = Annotated[str, PlainSerializer(mask_url, when_used="json")]


def flag(name: str | None = "", *, env_fallback: str = "") -> dict[str, Any]:
    """``json_schema_extra`` of a leaf field: its flat name when not the default one (``None`` = no
    flag and no variable: set by another setting), and a second, mesh-wide variable read when the
    service's own is unset."""
    return {"flag": name, "env_fallback": env_fallback}


def section(factory: Any, doc: str, *, prefix: str = "") -> Any:
    """A nested section field; ``prefix`` starts the flat names of its fields (``sim_``)."""
    return Field(default_factory=factory, description=doc, json_schema_extra={"flag_prefix": prefix})


def conflict(message: str, *fields: str) -> PydanticCustomError:
    """A cross-field validation error naming the fields involved (paths relative to the model)."""
    return PydanticCustomError("settings_conflict", message, {"fields": fields})


class Section(BaseModel):
    """Base of every settings section: typed, immutable, unknown keys refused."""

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)

    def __repr_args__(self) -> Any:
        for key, value in super().__repr_args__():
            yield key, mask_url(value) if isinstance(value, str) else value


# -- shared sections ----------------------------------------------------------------------------

Port = Annotated[int, Field(ge=0, le=65535)]
OptionalPort = Annotated[int, Field(ge=-1, le=65535)]


class ServerSettings(Section):
    """Where the gRPC server binds and how it stops."""

    host: str = Field("127.0.0.1", min_length=1, description="address to bind")
    port: Port = Field(0, description="port to bind (0 = ephemeral; see --port-file)")
    port_file: str = Field("", description="once serving, write the bound port here (atomically)")
    shutdown_grace: float = Field(10.0, ge=0, description="seconds in-flight calls get to finish on SIGTERM")
    event_loop: LoopChoice = Field(
        "auto", description="the process's asyncio event loop: uvloop, the standard library's, or auto (uvloop when "
        "installed); docs/architecture.md, 'Event loop'", json_schema_extra=flag(env_fallback="TOKENRELAY_EVENT_LOOP"))

    @field_validator("event_loop")
    @classmethod
    def _loop_installed(cls, value: LoopChoice) -> LoopChoice:
        try:
            resolve(value)       # the one rule: uvloop asked for and not installed
        except LoopUnavailable as exc:
            raise ValueError(str(exc)) from None
        return value


class TelemetrySettings(Section):
    """Logs, metrics and traces."""

    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"] = Field("INFO", description="log level")
    log_format: Literal["json", "console"] = Field("json", description="log format")
    metrics_port: OptionalPort = Field(-1, description="Prometheus /metrics port (0 = ephemeral, -1 = off)")
    metrics_port_file: str = Field("", description="write the bound metrics port here")
    otlp_endpoint: str = Field("", description="OTLP gRPC endpoint for traces (empty = no export)")
    trace_file: str = Field("", description="append finished spans here as JSON lines (debugging, tests)",
                            json_schema_extra=flag(env_fallback="TOKENRELAY_TRACE_FILE"))

    @field_validator("log_level", mode="before")
    @classmethod
    def _upper(cls, value: Any) -> Any:
        return value.upper() if isinstance(value, str) else value


class Settings(Section):
    """Base of a process's settings model: what `load_settings` fills (its variables start with
    ``ENV_PREFIX``; ``PROG`` names it in ``--help`` and in errors)."""

    ENV_PREFIX: ClassVar[str] = "TOKENRELAY_"
    PROG: ClassVar[str] = "tokenrelay"

    @model_validator(mode="before")
    @classmethod
    def _accept_flat_names(cls, data: Any) -> Any:
        """Keyword construction with the flags' names: ``port=0`` goes to ``server.port``."""
        if not isinstance(data, Mapping):
            return data
        by_name = {leaf.name: leaf for leaf in leaves(cls) if leaf.name}
        out: dict[str, Any] = {}
        flat: list[tuple[Leaf, Any]] = []
        for key, value in data.items():
            leaf = by_name.get(key)
            if leaf is not None and len(leaf.keys) > 1:
                flat.append((leaf, value))
            else:
                out[key] = value
        for leaf, value in flat:
            _put(out, leaf.keys, value)
        return out

    def public(self) -> dict[str, Any]:
        """What may be logged: secrets as ``**********``, URL passwords as ``***``."""
        return self.model_dump(mode="json", by_alias=True)


class ServiceSettings(Settings):
    """Base of a service's settings model: the shared sections plus the service's own fields."""

    server: ServerSettings = section(ServerSettings, "server")
    telemetry: TelemetrySettings = section(TelemetrySettings, "telemetry")
    security: SecuritySettings = section(SecuritySettings, "transport security", prefix="security_")


# -- the leaves of a settings model -------------------------------------------------------------

@dataclass(frozen=True)
class Leaf:
    keys: tuple[str, ...]         # config-file keys: ("sim", "decode_step_time") or ("backend",)
    name: str | None              # flat name (flag and variable); None = neither
    info: FieldInfo
    default: Any
    env_fallback: str
    section_doc: str

    @property
    def flag(self) -> str:
        return "--" + (self.name or "").replace("_", "-")

    def env(self, prefix: str) -> str:
        return prefix + (self.name or "").upper()

    @property
    def file_key(self) -> str:
        return ".".join(self.keys)

    @property
    def base(self) -> Any:
        return _base_type(self.info.annotation)

    @property
    def is_bool(self) -> bool:
        return self.base is bool

    @property
    def is_list(self) -> bool:
        return typing.get_origin(self.base) is list

    @property
    def secret(self) -> bool:
        return self.base is SecretStr


def _base_type(tp: Any) -> Any:
    origin = typing.get_origin(tp)
    if origin is Annotated:
        return _base_type(typing.get_args(tp)[0])
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return _base_type(args[0])
    return tp


def _key(name: str, info: FieldInfo) -> str:
    return info.alias or name


def _extra(info: FieldInfo) -> dict[str, Any]:
    return info.json_schema_extra if isinstance(info.json_schema_extra, dict) else {}


def _put(data: dict[str, Any], keys: Sequence[str], value: Any) -> None:
    """Set ``data[k1][k2]...`` (section objects on the way become dicts, so the value can join them)."""
    for key in keys[:-1]:
        current = data.get(key)
        if isinstance(current, BaseModel):
            current = current.model_dump(by_alias=True)
        data[key] = current = dict(current) if isinstance(current, Mapping) else {}
        data = current
    data[keys[-1]] = value


def _get(data: Mapping[str, Any], keys: Sequence[str]) -> tuple[bool, Any]:
    for key in keys:
        if not isinstance(data, Mapping) or key not in data:
            return False, None
        data = data[key]
    return True, data


@cache
def leaves(cls: type[BaseModel]) -> tuple[Leaf, ...]:
    """Every leaf field of a settings model, through its sections (a field whose default is a model)."""
    out: list[Leaf] = []

    def walk(model: BaseModel, keys: tuple[str, ...], prefix: str, doc: str) -> None:
        for attr, info in type(model).model_fields.items():
            key, default, extra = _key(attr, info), getattr(model, attr), _extra(info)
            if isinstance(default, BaseModel):
                walk(default, (*keys, key), prefix + extra.get("flag_prefix", ""),
                     " / ".join(filter(None, (doc, info.description or key))))
                continue
            name = extra.get("flag", "")
            if name == "":
                name = prefix + key
            out.append(Leaf((*keys, key), name, info, default, extra.get("env_fallback", ""), doc))

    walk(cls.model_construct(), (), "", "")
    names = [leaf.name for leaf in out if leaf.name]
    duplicates = {n for n in names if names.count(n) > 1}
    if duplicates:   # a model bug, found at its first use
        raise TypeError(f"{cls.__name__}: flat names used twice: {sorted(duplicates)}")
    return tuple(out)


# -- the loader -----------------------------------------------------------------------------------

def _shown_default(leaf: Leaf) -> str:
    value = leaf.default
    if isinstance(value, SecretStr):
        return "**********" if value.get_secret_value() else "''"
    if value is None:
        return "unset"
    if leaf.is_bool:
        return str(value)
    if isinstance(value, list):
        return repr(",".join(map(str, value)))
    return repr(mask_url(value) if isinstance(value, str) else value)


def build_parser(cls: type[Settings], prog: str | None = None) -> argparse.ArgumentParser:
    """argparse for every leaf of ``cls``, grouped by section; help shows variable, file key, default."""
    parser = argparse.ArgumentParser(prog=prog or cls.PROG, description=cls.__doc__,
                                     usage="%(prog)s [--config FILE] [--FLAG VALUE ...]  (see --help)")
    parser.add_argument("--config", metavar="FILE", default=None,
                        help=f"settings file, YAML (.yaml, .yml) or TOML (.toml), nested by section; "
                             f"flags and environment variables override it [env {cls.ENV_PREFIX}CONFIG]")
    groups: dict[str, Any] = {}
    for leaf in leaves(cls):
        if not leaf.name:
            continue
        target = parser
        if leaf.section_doc:
            if leaf.section_doc not in groups:
                groups[leaf.section_doc] = parser.add_argument_group(leaf.section_doc)
            target = groups[leaf.section_doc]
        env = leaf.env(cls.ENV_PREFIX) + (f" or {leaf.env_fallback}" if leaf.env_fallback else "")
        text = (f"{leaf.info.description or ''}{' (comma-separated)' if leaf.is_list else ''} "
                f"[env {env}; file {leaf.file_key}] (default: {_shown_default(leaf)})")
        text = text.replace("%", "%%")   # argparse %-formats help texts
        if leaf.is_bool:
            target.add_argument(leaf.flag, dest=leaf.name, action=argparse.BooleanOptionalAction,
                                default=None, help=text)
            continue
        choices = typing.get_args(leaf.base) if typing.get_origin(leaf.base) is Literal else ()
        metavar = "{" + ",".join(map(str, choices)) + "}" if choices else (leaf.name or "").upper()
        target.add_argument(leaf.flag, dest=leaf.name, default=None, metavar=metavar, help=text)
    return parser


def _read_file(path: str, cls: type[Settings]) -> dict[str, Any]:
    file = pathlib.Path(path)
    if not file.is_file():
        raise ValueError(f"config file {path}: not found")
    suffix = file.suffix.lower()
    if suffix not in (".yaml", ".yml", ".toml"):
        raise ValueError(f"config file {path}: unknown format {suffix!r} (use .yaml, .yml or .toml)")
    try:
        if suffix == ".toml":
            data = TomlConfigSettingsSource(cls, toml_file=file)()   # type: ignore[arg-type]
        else:
            data = YamlConfigSettingsSource(cls, yaml_file=file)()   # type: ignore[arg-type]
    except Exception as exc:  # the parsers' own errors (yaml.YAMLError, tomllib.TOMLDecodeError)
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ValueError(f"config file {path}: cannot parse: {first}") from exc
    if not isinstance(data, dict):
        raise ValueError(f"config file {path}: expected a mapping of settings at the top")
    return data


def _check_file_keys(data: Mapping[str, Any], cls: type[Settings], path: str) -> list[str]:
    """Problems with the file's keys: unknown ones (with the closest known one), sections not mappings."""
    known = {leaf.file_key for leaf in leaves(cls) if leaf.name}
    sections = {".".join(leaf.keys[:i]) for leaf in leaves(cls) for i in range(1, len(leaf.keys))}
    problems = []

    def check(mapping: Mapping[str, Any], head: str) -> None:
        for key, value in mapping.items():
            full = f"{head}{key}"
            if full in sections and isinstance(value, Mapping):
                check(value, full + ".")
            elif full in sections:
                problems.append(f"config file {path}: {full!r} must be a section (a mapping of settings)")
            elif full not in known:
                close = difflib.get_close_matches(full, sorted(known | sections), n=1)
                problems.append(f"config file {path}: unknown key {full!r}"
                                + (f" (did you mean {close[0]!r}?)" if close else ""))

    check(data, "")
    return problems


def _split_list(leaf: Leaf, raw: str) -> Any:
    return [part.strip() for part in raw.split(",") if part.strip()] if leaf.is_list else raw


def _names(cls: type[Settings], leaf: Leaf) -> str:
    if not leaf.name:
        return f"{leaf.file_key} in the config file"
    return f"{leaf.flag} ({leaf.env(cls.ENV_PREFIX)}; file {leaf.file_key})"


def _find_leaf(cls: type[Settings], loc: Sequence[Any]) -> Leaf | None:
    keys = tuple(str(part) for part in loc if isinstance(part, str))
    for leaf in leaves(cls):
        if keys[:len(leaf.keys)] == leaf.keys:
            return leaf
    return None


def _message(error: Any) -> str:
    return str(error["msg"]).removeprefix("Value error, ")


def _describe(cls: type[Settings], error: Any, origins: Mapping[tuple[str, ...], str]) -> str:
    loc = tuple(error["loc"])
    fields = (error.get("ctx") or {}).get("fields")
    if fields:   # a cross-field check: name every field involved
        base = tuple(p for p in loc if isinstance(p, str))
        found = [_find_leaf(cls, base + tuple(f.split("."))) for f in fields]
        return f"{' / '.join(_names(cls, leaf) for leaf in found if leaf)}: {_message(error)}"
    leaf = _find_leaf(cls, loc)
    if leaf is None:
        return f"{'.'.join(map(str, loc)) or 'settings'}: {_message(error)}"
    text = f"{_names(cls, leaf)}: {_message(error)}"
    origin = origins.get(leaf.keys)
    if origin and not leaf.secret:
        value = error.get("input")
        shown = mask_url(value) if isinstance(value, str) else value
        text += f" (got {shown!r} from {origin})"
    elif origin:
        text += f" (from {origin})"
    return text


def _fail(parser: argparse.ArgumentParser, problems: Sequence[str]) -> NoReturn:
    parser.print_usage(sys.stderr)
    for problem in problems:
        sys.stderr.write(f"{parser.prog}: error: {problem}\n")
    raise SystemExit(2)


def load_settings(cls: type[S], argv: Sequence[str] | None = None, *, prog: str | None = None,
                  environ: Mapping[str, str] | None = None) -> S:
    """Build ``cls`` from flags > environment variables > the config file > defaults; exit 2 on errors."""
    env = os.environ if environ is None else environ
    parser = build_parser(cls, prog)
    ns = parser.parse_args(argv)
    data: dict[str, Any] = {}
    origins: dict[tuple[str, ...], str] = {}
    config = ns.config or env.get(cls.ENV_PREFIX + "CONFIG", "")
    if config:
        try:
            data = _read_file(config, cls)
        except ValueError as exc:
            _fail(parser, [str(exc)])
        if problems := _check_file_keys(data, cls, config):
            _fail(parser, problems)
        for leaf in leaves(cls):
            if _get(data, leaf.keys)[0]:
                origins[leaf.keys] = f"{config} key {leaf.file_key}"
    for leaf in leaves(cls):
        if not leaf.name:
            continue
        value, origin = getattr(ns, leaf.name), leaf.flag
        if value is None:
            for name in (leaf.env(cls.ENV_PREFIX), leaf.env_fallback):
                if name and name in env:
                    value, origin = _split_list(leaf, env[name]), name
                    break
        elif not isinstance(value, bool):
            value = _split_list(leaf, value)
        if value is None:
            continue
        _put(data, leaf.keys, value)
        origins[leaf.keys] = origin
    try:
        return cls.model_validate(data)
    except ValidationError as exc:
        _fail(parser, [_describe(cls, error, origins) for error in exc.errors()])
