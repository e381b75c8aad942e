"""Locating the development data in ../shared/data (never shipped with the project)."""

from __future__ import annotations

import os
import pathlib

import pytest

REPO = pathlib.Path(__file__).resolve().parent.parent
SHARED_DATA = pathlib.Path(os.environ.get("TOKENRELAY_SHARED_DATA", REPO.parent / "shared" / "data"))


def shared_path(*parts: str) -> pathlib.Path:
    """A path under ../shared/data, or skip the test saying why."""
    path = SHARED_DATA.joinpath(*parts)
    if not path.exists():
        pytest.skip(f"{path} is absent (development data from ../shared/data; not shipped)")
    return path
