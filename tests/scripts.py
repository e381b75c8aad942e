"""Importing the benchmark scripts under bench/ (not a package) from tests."""

from __future__ import annotations

import importlib.util
import pathlib
import sys
from types import ModuleType

REPO = pathlib.Path(__file__).resolve().parent.parent


def load_script(name: str) -> ModuleType:
    """bench/<name>.py as a module named <name>."""
    spec = importlib.util.spec_from_file_location(name, REPO / "bench" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve their module by name
    spec.loader.exec_module(module)
    return module
