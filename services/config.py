"""Settings objects: one dataclass per service, every field documented, read in one place.

Each field's value comes from, in order of precedence: a command-line flag
(``--field-name``), an environment variable (``<PREFIX>FIELD_NAME``), the default.
The field's ``help`` metadata is the documentation shown by ``--help``.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import types
import typing
from collections.abc import Sequence
from typing import Any, TypeVar

T = TypeVar("T")


def setting(default: Any, help: str, **kw: Any) -> Any:
    """A documented settings field."""
    if isinstance(default, (list, dict)):
        return dataclasses.field(default_factory=lambda: type(default)(default),
                                 metadata={"help": help, **kw})
    return dataclasses.field(default=default, metadata={"help": help, **kw})


def _base_type(tp: Any) -> Any:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return _base_type(args[0])
    return tp


def _convert(tp: Any, raw: str) -> Any:
    base = _base_type(tp)
    if base is bool:
        if raw.lower() in ("1", "true", "yes", "on"):
            return True
        if raw.lower() in ("0", "false", "no", "off", ""):
            return False
        raise ValueError(f"not a boolean: {raw!r}")
    if typing.get_origin(base) is list:
        (item,) = typing.get_args(base) or (str,)
        return [_convert(item, p.strip()) for p in raw.split(",") if p.strip()]
    return base(raw)


def parse_settings(cls: type[T], argv: Sequence[str] | None, *, prog: str, env_prefix: str,
                   description: str = "") -> T:
    """Build ``cls`` from flags, then environment variables, then defaults."""
    hints = typing.get_type_hints(cls)
    parser = argparse.ArgumentParser(prog=prog, description=description or cls.__doc__,
                                     formatter_class=argparse.HelpFormatter)
    fields = [f for f in dataclasses.fields(cls) if f.init]  # type: ignore[arg-type]
    for f in fields:
        env = env_prefix + f.name.upper()
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc,operator]
        flag = "--" + f.name.replace("_", "-")
        is_bool = _base_type(hints[f.name]) is bool
        shown = default if is_bool else repr(default)
        # argparse %-formats help texts
        help_text = f"{f.metadata.get('help', '')} [env {env}] (default: {shown})".replace("%", "%%")
        if is_bool:
            parser.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction, default=None, help=help_text)
        else:
            parser.add_argument(flag, dest=f.name, default=None, metavar=f.name.upper(), help=help_text)
    ns = parser.parse_args(argv)
    values: dict[str, Any] = {}
    for f in fields:
        flag_value = getattr(ns, f.name)
        env_value = os.environ.get(env_prefix + f.name.upper())
        try:
            if isinstance(flag_value, bool):
                values[f.name] = flag_value
            elif flag_value is not None:
                values[f.name] = _convert(hints[f.name], flag_value)
            elif env_value is not None:
                values[f.name] = _convert(hints[f.name], env_value)
        except ValueError as exc:
            parser.error(f"{f.name}: {exc}")
    return cls(**values)
