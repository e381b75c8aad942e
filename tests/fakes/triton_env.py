"""Start the PyTriton fake (`triton_trtllm_server.py`) for the triton tests, in a Python that can run it.

NVIDIA PyTriton 0.7.0 needs numpy < 2 (its Triton Python stub returns empty tensors with numpy 2)
and tritonclient[grpc] pins protobuf < 7; the project runs numpy 2 and protobuf 7. So the server runs
in a virtual environment of its own, built once with pip from the package registry (about a minute)
and cached beside the other test artefacts: ``~/.cache/tokenrelay/test-artefacts/pytriton-venv``.
``TOKENRELAY_PYTRITON_PYTHON`` names an interpreter to use instead. The test process itself needs
only the `triton` extra (tritonclient).
"""

from __future__ import annotations

import os
import pathlib
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

PYTRITON = "nvidia-pytriton==0.7.0"
SERVER = pathlib.Path(__file__).with_name("triton_trtllm_server.py")
CACHE = pathlib.Path.home() / ".cache" / "tokenrelay" / "test-artefacts" / "pytriton-venv"


def _works(python: str) -> bool:
    probe = "import numpy, pytriton.triton; assert int(numpy.__version__.split('.')[0]) < 2"
    return subprocess.run([python, "-c", probe], capture_output=True, timeout=120).returncode == 0


def pytriton_python() -> tuple[str | None, str]:
    """An interpreter that runs PyTriton, building the cached venv if needed; else (None, why not)."""
    override = os.environ.get("TOKENRELAY_PYTRITON_PYTHON")
    if override:
        return (override, "") if _works(override) else (None, f"TOKENRELAY_PYTRITON_PYTHON={override} "
                                                               "cannot import pytriton with numpy < 2")
    cached = CACHE / "bin" / "python"
    if cached.exists() and _works(str(cached)):
        return str(cached), ""
    CACHE.parent.mkdir(parents=True, exist_ok=True)
    build = pathlib.Path(tempfile.mkdtemp(prefix="pytriton-venv-", dir=CACHE.parent))
    try:
        subprocess.run([sys.executable, "-m", "venv", str(build)], check=True, capture_output=True, timeout=120)
        pip = subprocess.run([str(build / "bin" / "pip"), "install", "-q", PYTRITON], capture_output=True,
                             text=True, timeout=900)
        if pip.returncode != 0:
            return None, f"pip install {PYTRITON} failed: {pip.stderr.strip().splitlines()[-1:]}"
        shutil.rmtree(CACHE, ignore_errors=True)
        build.rename(CACHE)   # venvs are not relocatable in general, but bin/python is a symlink: fine
    except (OSError, subprocess.SubprocessError) as e:
        return None, f"cannot build a PyTriton venv: {e}"
    finally:
        shutil.rmtree(build, ignore_errors=True)
    return (str(cached), "") if _works(str(cached)) else (None, "the PyTriton venv does not import pytriton")


@dataclass
class TritonProcess:
    process: subprocess.Popen[bytes]
    url: str
    log: pathlib.Path

    def kill(self) -> None:
        """SIGKILL the whole group at once: the server vanishes mid-stream, as in a crash or a lost host."""
        self.stop()

    def stop(self) -> None:
        """SIGKILL the group, tritonserver and its Python stubs too. Not SIGTERM: tritonserver exits on
        it and leaves PyTriton's proxies waiting (20 s and more, measured), and a graceful PyTriton
        stop (SIGTERM to the fake alone) took over 30 s; no test here needs the server's own shutdown."""
        try:
            os.killpg(self.process.pid, signal.SIGKILL)   # also children a crash left behind
        except ProcessLookupError:
            pass
        self.process.wait(timeout=10)


def start_server(python: str, workdir: pathlib.Path, timeout: float = 120.0, port: int = 0) -> TritonProcess:
    """Start the fake Triton server (on gRPC `port`, default a free one); returns once its models are
    loaded (raises with its log otherwise)."""
    libdir = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_config_var('LIBDIR'))"],
                            capture_output=True, text=True, check=True).stdout.strip()
    env = dict(os.environ)
    # The bundled Python stub links the system libpython; point it at this interpreter's own.
    env["LD_LIBRARY_PATH"] = os.pathsep.join(p for p in (libdir, env.get("LD_LIBRARY_PATH", "")) if p)
    port_file, log = workdir / "triton.port", workdir / "triton.log"
    port_file.unlink(missing_ok=True)
    with log.open("wb") as out:
        process = subprocess.Popen([python, str(SERVER), "--port-file", str(port_file), "--grpc-port", str(port),
                                    "--workspace", str(workdir / "workspace")], stdout=out,
                                   stderr=subprocess.STDOUT, env=env, start_new_session=True)
    deadline = time.monotonic() + timeout
    while not port_file.exists():
        if process.poll() is not None or time.monotonic() > deadline:
            TritonProcess(process, "", log).stop()
            tail = log.read_text(errors="replace")[-3000:]
            raise RuntimeError(f"the PyTriton fake did not start (exit {process.returncode}):\n{tail}")
        time.sleep(0.05)   # polling the port file the server writes when ready, with a deadline
    return TritonProcess(process, f"127.0.0.1:{port_file.read_text().strip()}", log)
