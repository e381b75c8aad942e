#!/usr/bin/env bash
# Install everything tokenrelay needs on a fresh Debian/Ubuntu machine (idempotent).
# - redis-server from the distribution when missing (the mesh's admission store)
# - torch, only when none is installed: 2.13.0 (on CPU-only hosts here pip takes the CPU build;
#   on a GPU host install the torch build you want first and this step is skipped)
# - the project itself with the hf engine, the default model builder and the dev tools
set -euo pipefail
cd "$(dirname "$0")/.."
SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
if ! command -v redis-server >/dev/null 2>&1; then
  # `env` carries the variable through sudo, and is a real command when SUDO is empty (root)
  $SUDO env DEBIAN_FRONTEND=noninteractive apt-get update -qq
  $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server >/dev/null
fi
PY="${PYTHON:-python3}"
if ! "$PY" -c "import torch" >/dev/null 2>&1; then
  "$PY" -m pip install -q --disable-pip-version-check "torch==2.13.0"
fi
"$PY" -m pip install -q --disable-pip-version-check -e ".[hf,default-model,bench,dev]"
# pyenv only exposes new console scripts (`tokenrelay`) after a rehash.
if command -v pyenv >/dev/null 2>&1; then pyenv rehash || true; fi
if ! command -v tokenrelay >/dev/null 2>&1; then
  echo "note: 'tokenrelay' is not on PATH; use '$PY -m tokenrelay_tools.cli.main' or add $("$PY" -c 'import sysconfig; print(sysconfig.get_path("scripts"))') to PATH" >&2
fi
