"""scripts/install.sh, run for real: its redis step with redis-server hidden from PATH (apt-get runs),
as a user without sudo (a message, no apt-get), through sudo, and its Python steps into a throwaway venv."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sysconfig

import pytest

from tests.packaging.pkgkit import REPO, clean_env, copy_tree, hiding_bin, make_venv

SCRIPT = REPO / "scripts" / "install.sh"
REDIS = {"redis-server"}
# `id -u` answers as an unprivileged user; everything else goes to the real id.
NOT_ROOT = {"id": 'if [ "$1" = "-u" ]; then echo 1000; else exec /usr/bin/id "$@"; fi'}


def _run(path: str, *args: str, timeout: float = 120, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["/bin/bash", str(SCRIPT), *args], env=clean_env(PATH=path, **env),
                          capture_output=True, text=True, timeout=timeout)


def _can_apt() -> bool:
    return os.geteuid() == 0 or subprocess.run(["sudo", "-n", "true"], capture_output=True).returncode == 0


@pytest.mark.skipif(not _can_apt(), reason="apt-get needs root or passwordless sudo")
@pytest.mark.skipif(not pathlib.Path("/usr/bin/apt-get").exists(), reason="not a Debian/Ubuntu machine")
def test_redis_step_installs_redis_server_with_apt_when_it_is_missing(tmp_path: pathlib.Path) -> None:
    bin_dir = hiding_bin(tmp_path / "bin", REDIS)
    out = _run(f"{bin_dir}:/usr/sbin:/sbin", "--only", "redis", timeout=300)
    assert out.returncode == 0, out.stderr
    assert "redis-server not found: installing it with" in out.stderr
    # It is installed (already was: apt-get's reinstall check), just not on the PATH this test gave.
    assert "redis-server is installed but not on this PATH" in out.stderr
    assert pathlib.Path("/usr/bin/redis-server").exists()


def test_redis_step_as_a_user_without_sudo_says_what_to_do(tmp_path: pathlib.Path) -> None:
    bin_dir = hiding_bin(tmp_path / "bin", REDIS | {"sudo"}, NOT_ROOT)
    out = _run(f"{bin_dir}:/usr/sbin:/sbin", "--only", "redis")
    assert out.returncode == 1
    assert "redis-server is missing and installing it needs root, but sudo is not installed" in out.stderr
    assert "--redis-url" in out.stderr and "Traceback" not in out.stderr


def test_redis_step_as_a_user_goes_through_sudo(tmp_path: pathlib.Path) -> None:
    calls = tmp_path / "sudo-calls"
    fake_sudo = {"sudo": f'echo "$*" >> {calls}', **NOT_ROOT}  # records the command, runs nothing
    bin_dir = hiding_bin(tmp_path / "bin", REDIS, fake_sudo)
    out = _run(f"{bin_dir}:/usr/sbin:/sbin", "--only", "redis")
    assert out.returncode == 0, out.stderr
    assert calls.read_text().splitlines() == [
        "env DEBIAN_FRONTEND=noninteractive apt-get update -qq",
        "env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server",
    ]


def test_bad_arguments_and_help() -> None:
    path = os.environ["PATH"]
    assert "unknown step 'redi'" in _run(path, "--only", "redi").stderr
    assert _run(path, "--frobnicate").returncode == 1
    helped = _run(path, "--help")
    assert helped.returncode == 0 and "--only STEP" in helped.stdout


@pytest.mark.skipif(not pathlib.Path("/usr/lib/python3", "EXTERNALLY-MANAGED").exists()
                    and not any(pathlib.Path("/usr/lib").glob("python3.*/EXTERNALLY-MANAGED")),
                    reason="no PEP 668 system Python here")
def test_an_externally_managed_system_python_is_refused_before_installing() -> None:
    out = _run(os.environ["PATH"], "--only", "torch,project", PYTHON="/usr/bin/python3")
    assert out.returncode == 1
    assert "externally managed Python (PEP 668)" in out.stderr and "python3 -m venv" in out.stderr


@pytest.mark.slow
def test_python_steps_install_into_the_active_venv(tmp_path: pathlib.Path) -> None:
    """An activated venv (VIRTUAL_ENV, its bin first on PATH, no $PYTHON) gets the project; the
    venv sees this interpreter's packages, so torch & co. are 'already satisfied', not downloaded."""
    tree = copy_tree(tmp_path / "tree")
    venv = tmp_path / "venv"
    python = make_venv(venv, system_site_packages=True)
    bin_dir = hiding_bin(tmp_path / "bin", set())
    out = subprocess.run(["/bin/bash", str(tree / "scripts" / "install.sh"), "--only", "torch,project"],
                         env=clean_env(PATH=f"{venv / 'bin'}:{bin_dir}:/usr/sbin:/sbin", VIRTUAL_ENV=str(venv)),
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    assert f"[install] python: {python}" in out.stderr
    where = subprocess.run([str(python), "-c", "import tokenrelay_tools; print(tokenrelay_tools.__file__)"],
                           cwd=tmp_path, env=clean_env(), capture_output=True, text=True, check=True)
    assert where.stdout.strip() == str(tree / "tokenrelay_tools" / "__init__.py")  # editable, from the copy
    helped = subprocess.run([str(venv / "bin" / "tokenrelay"), "--help"], env=clean_env(), capture_output=True,
                            text=True, timeout=60)
    assert helped.returncode == 0, helped.stderr
    # The interpreter running this test still has its own install (the venv shadowed it, never replaced it).
    purelib = pathlib.Path(sysconfig.get_path("purelib"))
    assert not any(str(tree) in p.read_text(errors="replace") for p in purelib.glob("__editable__*tokenrelay*"))
