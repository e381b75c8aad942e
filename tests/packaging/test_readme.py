"""The README, run as a newcomer runs it (issue 14): every ```bash command and the ```python example,
in order, in a copy of the working tree, with a throwaway virtualenv and a throwaway HOME.

- `bash scripts/install.sh` runs with redis-server hidden from PATH, so its apt path runs (as root
  or through passwordless sudo; elsewhere redis stays visible and the test says so), into a venv that
  sees this interpreter's packages (torch & co. are "already satisfied", not downloaded);
- `tokenrelay up ...` runs in the background until it prints `ready` and is stopped with Ctrl-C
  (SIGINT) at the end; the other commands must exit 0; `chat` gets one line, then end of input;
- the HOME is empty but for the default model, linked from the test artefacts' copy when that one
  is built (else the first `up` builds it, as a user's does: about two minutes);
- rewrites, and only these: `tokenrelay up` without `--port` gets `--port 0` (a fixed port collides
  with whatever else runs here), and a bench's `--duration` is shortened;
- a block after `<!-- readme-test: skip: WHY -->` is not run: the GPU, Docker and Kubernetes
  commands, and the test command itself. The test prints them by name, and fails when the set of
  skipped blocks changes without this file saying so.
"""

from __future__ import annotations

import asyncio
import os
import pathlib
import shutil
import signal
import subprocess
import time

import pytest

from tests import artefacts
from tests.packaging.pkgkit import clean_env, copy_tree, hiding_bin, make_venv
from tests.packaging.readme_kit import Block, blocks, is_up, rewritten
from tests.waiting import poll
from tokenrelay_tools import default_model

SKIPPED = {"bash scripts/test.sh", "bash scripts/install.sh", "cd compose", "kubectl apply -f compose/k8s/"}
BENCH_DURATION = "3"


def _can_apt() -> bool:
    return pathlib.Path("/usr/bin/apt-get").exists() and (
        os.geteuid() == 0 or subprocess.run(["sudo", "-n", "true"], capture_output=True).returncode == 0)


def test_every_block_is_run_or_skipped_with_a_reason() -> None:
    found = blocks()
    run = [b for b in found if not b.skip]
    assert any(b.lang == "python" for b in run) and any("bash scripts/install.sh" in c for b in run
                                                        for c in b.commands())
    assert {b.commands()[0] for b in found if b.skip} == SKIPPED, [b.name for b in found if b.skip]
    assert all(b.skip.strip() for b in found if b.skip)


def test_the_rewrites() -> None:
    assert rewritten("tokenrelay up", "3") == "tokenrelay up --port 0"
    assert rewritten("tokenrelay up --engine sim --port 7 --run-dir x", "3").count("--port") == 1
    assert rewritten("tokenrelay bench --workload w --duration 30 --plot c/", "3") == \
        "tokenrelay bench --workload w --duration 3 --plot c/"
    assert rewritten('tokenrelay generate "tokenrelay up"', "3") == 'tokenrelay generate "tokenrelay up"'


class _Session:
    """One newcomer's shell: the copied tree, the venv, the HOME, the meshes it started."""

    def __init__(self, tmp: pathlib.Path) -> None:
        self.tmp = tmp
        self.tree = copy_tree(tmp / "tree")
        self.venv = tmp / "venv"
        self.python = make_venv(self.venv, system_site_packages=True)
        self.home = tmp / "home"
        self.home.mkdir()
        self.hidden = hiding_bin(tmp / "bin", {"redis-server"})
        self.background: list[tuple[str, subprocess.Popen[bytes], pathlib.Path]] = []
        self.notes: list[str] = []

    def env(self, hide_redis: bool = False) -> dict[str, str]:
        path = f"{self.hidden}:/usr/sbin:/sbin" if hide_redis else os.environ["PATH"]
        env = clean_env(HOME=str(self.home), VIRTUAL_ENV=str(self.venv), PATH=f"{self.venv / 'bin'}:{path}")
        for name in ("TOKENRELAY_CACHE", "XDG_CACHE_HOME", "TOKENRELAY_API_KEY", "TOKENRELAY_REDIS_URL"):
            env.pop(name, None)
        return env

    def seed_default_model(self) -> None:
        built = artefacts.optional("gemma-3-270m")
        if built is not None and default_model.is_built(built):
            models = self.home / ".cache" / "tokenrelay" / "models"
            models.mkdir(parents=True)
            (models / default_model.DEFAULT_MODEL_NAME).symlink_to(built)
        else:
            self.notes.append("the default model was not built yet: the first `tokenrelay up` builds it")

    async def run(self, command: str) -> None:
        if is_up(command):
            await self._start(command)
            return
        install = command.startswith("bash scripts/install.sh")
        hide = install and _can_apt()
        if install and not hide:
            self.notes.append("install.sh ran with redis-server visible: apt-get needs root or passwordless sudo")
        out = await asyncio.to_thread(subprocess.run, ["/bin/bash", "-c", command], cwd=self.tree, env=self.env(hide),
                                      input="Hello\n", capture_output=True, text=True, timeout=600 if install else 180)
        assert out.returncode == 0, f"{command}\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
        if hide:
            assert "redis-server not found: installing it with" in out.stderr, out.stderr

    def _spawn(self, command: str) -> tuple[subprocess.Popen[bytes], pathlib.Path]:
        log = self.tmp / f"up-{len(self.background)}.log"
        with open(log, "wb") as sink:
            proc = subprocess.Popen(["/bin/bash", "-c", f"exec {command}"], cwd=self.tree, env=self.env(),
                                    stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=sink)
        self.background.append((command, proc, log))
        return proc, log

    async def _start(self, command: str) -> None:
        proc, log = self._spawn(command)

        def ready() -> bool:
            assert proc.poll() is None, f"{command} exited {proc.returncode}:\n{log.read_text()[-3000:]}"
            return "] ready:" in log.read_text(errors="replace")

        await poll(ready, 420, f"{command} to print ready")

    def python_block(self, block: Block) -> None:
        script = self.tmp / f"readme-{block.line}.py"
        script.write_text(block.body)
        out = subprocess.run([str(self.python), str(script)], cwd=self.tmp, env=self.env(), capture_output=True,
                             text=True, timeout=180)
        assert out.returncode == 0, f"README.md:{block.line}\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
        assert "cancelled: False" in out.stdout, out.stdout

    def stop(self) -> list[str]:
        problems = []
        for command, proc, log in reversed(self.background):
            if proc.poll() is None:
                proc.send_signal(signal.SIGINT)     # Ctrl-C, as the README says
            try:
                code = proc.wait(90)
            except subprocess.TimeoutExpired:
                proc.kill()
                code = -9
            if code != 0:
                problems.append(f"{command} exited {code}:\n{log.read_text(errors='replace')[-2000:]}")
        return problems


@pytest.mark.slow
async def test_the_readme_runs_as_written(tmp_path: pathlib.Path) -> None:
    if shutil.which("redis-server") is None:
        pytest.fail("redis-server is required (apt-get install -y redis-server); .ci/run installs it")
    started = time.monotonic()
    session = _Session(tmp_path)
    session.seed_default_model()
    ran, skipped = [], []
    try:
        for block in blocks():
            if block.skip:
                skipped.append(f"{block.name}  ({block.skip})")
                continue
            for command in block.commands() or [block.body]:
                t = time.monotonic()
                if block.lang == "python":
                    session.python_block(block)
                else:
                    await session.run(rewritten(command, BENCH_DURATION))
                ran.append(f"{time.monotonic() - t:5.1f} s  {command.splitlines()[0][:100]}")
    finally:
        problems = session.stop()
    print(f"README: {len(ran)} commands in {time.monotonic() - started:.0f} s:", *ran, sep="\n  ")
    print("skipped (marked in the README):", *skipped, sep="\n  ")
    for note in session.notes:
        print("note:", note)
    assert problems == [], "\n".join(problems)
