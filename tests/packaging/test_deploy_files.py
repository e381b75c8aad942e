"""compose/: the Docker Compose file and the Kubernetes manifests have never run here (no Docker engine,
no cluster; README "Deploy" says so). What can be checked without them is: both parse, and the command
line each one gives a tokenrelay service is accepted by that service's own settings parser, so a
renamed or removed flag fails here instead of in a crash-looping container."""

from __future__ import annotations

import re
import shutil

import pytest
import yaml

from engine_svc.config import EngineSettings
from router_svc.config import RouterSettings
from services.config import load_settings
from tests.packaging.pkgkit import REPO
from tokenizer_svc.config import TokenizerSettings

COMPOSE = REPO / "compose" / "docker-compose.yml"
K8S = REPO / "compose" / "k8s" / "tokenrelay.yaml"
SETTINGS = {"router_svc": RouterSettings, "tokenizer_svc": TokenizerSettings, "engine_svc": EngineSettings}


def _expand(arg: str) -> str:
    """Compose's ${VAR:-default} with the variables unset, as `docker compose up` reads it."""
    return re.sub(r"\$\{\w+:-([^}]*)\}", r"\1", arg)


def _compose_commands() -> list[tuple[str, list[str]]]:
    services = yaml.safe_load(COMPOSE.read_text())["services"]
    return [(name, [_expand(a) for a in spec["command"]]) for name, spec in services.items()
            if spec.get("command") and spec["command"][0] in SETTINGS]


def _k8s_commands() -> list[tuple[str, list[str]]]:
    found = []
    for doc in yaml.safe_load_all(K8S.read_text()):
        pod = (doc or {}).get("spec", {}).get("template", {}).get("spec", {})
        for container in pod.get("containers", []):
            args = container.get("args") or []
            if args and args[0] in SETTINGS:
                found.append((f"{doc['metadata']['name']}/{container['name']}", [str(a) for a in args]))
    return found


def test_both_files_name_every_service() -> None:
    for commands in (_compose_commands(), _k8s_commands()):
        assert {argv[0] for _, argv in commands} == set(SETTINGS), commands


@pytest.mark.parametrize("where, argv", [*_compose_commands(), *_k8s_commands()], ids=lambda v: str(v)[:40])
def test_each_service_accepts_its_command_line(where: str, argv: list[str]) -> None:
    settings = load_settings(SETTINGS[argv[0]], argv[1:], environ={})
    assert settings.server.port in (50051, 50052, 50053), where


@pytest.mark.slow
def test_the_images_copy_set_builds_every_service(tmp_path) -> None:
    """The Dockerfile's COPY lines are the image's whole source: what they copy builds a wheel that
    holds every service and the generated stubs (a file the image forgets fails here, not at deploy)."""
    import subprocess
    import sys
    import zipfile

    context = tmp_path / "context"
    context.mkdir()
    for line in (REPO / "compose" / "Dockerfile").read_text().splitlines():
        if line.startswith("COPY "):
            *sources, _dest = line.split()[1:]
            for source in sources:
                src = REPO / source
                dst = context / source
                if src.is_dir():
                    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("__pycache__"))
                else:
                    shutil.copy2(src, dst)
    out = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                          "--disable-pip-version-check", "-w", str(tmp_path / "wheel"), str(context)],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    (wheel,) = (tmp_path / "wheel").glob("*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for module in ("router_svc/__main__.py", "tokenizer_svc/__main__.py", "engine_svc/__main__.py",
                   "services/proto/tokenrelay/v1/inference_pb2.py"):
        assert module in names, module
