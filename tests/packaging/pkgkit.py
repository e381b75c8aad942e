"""Helpers of the packaging tests: a copy of the working tree, throwaway venvs, a PATH that hides tools."""

from __future__ import annotations

import fnmatch
import os
import pathlib
import shutil
import subprocess
import sys

REPO = pathlib.Path(__file__).resolve().parents[2]
# Build outputs and caches: a copy without them builds as a fresh checkout does.
_NOT_COPIED = (".git", "build", "dist", "*.egg-info", "__pycache__", ".venv", ".mypy_cache", ".ruff_cache",
               ".pytest_cache", "bench/results", ".whl", ".gl", ".devcarry")


def copy_tree(dest: pathlib.Path) -> pathlib.Path:
    """The working tree (uncommitted edits included) copied to `dest`, so builds never write into the repo."""
    names_out = [p for p in _NOT_COPIED if "/" not in p]

    def ignore(directory: str, names: list[str]) -> set[str]:
        rel = pathlib.Path(directory).relative_to(REPO)
        return {n for n in names if any(fnmatch.fnmatch(n, p) for p in names_out) or str(rel / n) in _NOT_COPIED}

    shutil.copytree(REPO, dest, ignore=ignore, symlinks=True)
    return dest


def make_venv(path: pathlib.Path, system_site_packages: bool = False) -> pathlib.Path:
    """A new virtualenv; returns its python."""
    argv = [sys.executable, "-m", "venv", str(path)]
    if system_site_packages:
        argv.append("--system-site-packages")
    subprocess.run(argv, check=True, timeout=120)
    return path / "bin" / "python"


def clean_env(**overrides: str) -> dict[str, str]:
    """This process's environment without what would point a child at the repo or another venv."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME", "PYTHON", "PYTEST_CURRENT_TEST")}
    env.update(overrides)
    return env


def hiding_bin(dest: pathlib.Path, hidden: set[str], fakes: dict[str, str] | None = None) -> pathlib.Path:
    """A directory of links to every tool of /usr/bin (/bin is the same here, or is added) except
    `hidden`, plus `fakes` (name → shell script body): a PATH of it and /usr/sbin:/sbin hides them."""
    dest.mkdir(parents=True)
    for directory in (pathlib.Path("/usr/bin"), pathlib.Path("/bin")):
        for tool in directory.iterdir():
            link = dest / tool.name
            if tool.name not in hidden and not link.exists() and not link.is_symlink():
                link.symlink_to(tool)
    for name, body in (fakes or {}).items():
        (dest / name).unlink(missing_ok=True)
        (dest / name).write_text("#!/bin/sh\n" + body + "\n")
        (dest / name).chmod(0o755)
    return dest
