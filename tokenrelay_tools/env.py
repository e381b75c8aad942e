"""The environment variables the tooling reads, each in one place (the services read theirs only
through `services.config`).

- ``TOKENRELAY_CACHE``: the cache root (default ``${XDG_CACHE_HOME:-~/.cache}/tokenrelay``): built
  models, the local mesh's state file and run directory;
- ``TOKENRELAY_API_KEY``: the key `generate`, `chat` and `bench` use when none is passed;
- ``TOKENRELAY_REDIS_URL``: the Redis `tokenrelay up` uses instead of starting its own;
- ``TOKENRELAY_BENCH_WORKLOADS``: more workload directories for `tokenrelay bench` (os.pathsep-separated).
"""

from __future__ import annotations

import os
import pathlib


def cache_root() -> pathlib.Path:
    """$TOKENRELAY_CACHE, else ${XDG_CACHE_HOME:-~/.cache}/tokenrelay."""
    if os.environ.get("TOKENRELAY_CACHE"):
        return pathlib.Path(os.environ["TOKENRELAY_CACHE"]).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME") or pathlib.Path.home() / ".cache"
    return pathlib.Path(xdg) / "tokenrelay"


def api_key() -> str:
    return os.environ.get("TOKENRELAY_API_KEY", "")


def redis_url() -> str:
    return os.environ.get("TOKENRELAY_REDIS_URL", "")


def bench_workload_dirs() -> list[pathlib.Path]:
    return [pathlib.Path(p) for p in os.environ.get("TOKENRELAY_BENCH_WORKLOADS", "").split(os.pathsep) if p]
