"""Start and stop a whole mesh with `tokenrelay up` as real processes (used by e2e tests and benches)."""

from __future__ import annotations

import json
import pathlib
import signal
import subprocess
import sys
import time
import urllib.request

from prometheus_client.parser import text_string_to_metric_families


class RunningMesh:
    def __init__(self, proc: subprocess.Popen[bytes], state: dict[str, object], log: pathlib.Path) -> None:
        self.proc = proc
        self.state = state
        self.log = log

    @property
    def address(self) -> str:
        return str(self.state["router"])

    @property
    def api_key(self) -> str:
        return str(self.state["api_key"])


def start_mesh(tmp: pathlib.Path, model: pathlib.Path, engine: str, *extra: str,
               timeout: float = 240) -> RunningMesh:
    state_file = tmp / "state.json"
    log = tmp / "up.log"
    argv = [sys.executable, "-m", "tokenrelay_tools.cli.main", "up", "--model", str(model), "--engine", engine,
            "--port", "0", "--state-file", str(state_file), "--run-dir", str(tmp / "run"), *extra]
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=open(log, "wb"))
    deadline = time.monotonic() + timeout
    while not state_file.exists():
        if proc.poll() is not None:
            raise RuntimeError(f"tokenrelay up exited {proc.returncode}:\n{log.read_text()}")
        if time.monotonic() > deadline:
            proc.kill()
            raise TimeoutError(f"mesh not ready in {timeout}s:\n{log.read_text()}")
        time.sleep(0.05)
    return RunningMesh(proc, json.loads(state_file.read_text()), log)


def stop_mesh(mesh: RunningMesh) -> int:
    mesh.proc.send_signal(signal.SIGINT)
    try:
        return mesh.proc.wait(60)
    except subprocess.TimeoutExpired:
        mesh.proc.kill()
        raise


def scrape(url: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    """Samples of a /metrics page keyed by (name, labels)."""
    text = urllib.request.urlopen(url, timeout=5).read().decode()
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def metric_sum(url: str, name: str, **labels: str) -> float:
    """The sum of a /metrics page's samples named `name` whose labels include `labels`."""
    want = frozenset(labels.items())
    return sum(v for (n, lab), v in scrape(url).items() if n == name and want <= lab)
