#!/usr/bin/env bash
# Install everything tokenrelay needs on a fresh Debian/Ubuntu machine (idempotent).
# Steps, all by default (`--only STEP[,STEP...]` runs some of them):
#   redis    redis-server from the distribution when missing (the mesh's admission store); as root
#            directly, otherwise through sudo (no sudo: a message saying what to run instead)
#   torch    torch 2.13.0, only when none is installed (on CPU-only hosts here pip takes the CPU
#            build; on a GPU host install the torch build you want first and this step is skipped)
#   project  the project itself (editable) with the hf engine, the default model builder, bench and dev tools
# Python: $PYTHON, else the active virtualenv's, else python3. A system Python that pip refuses to
# install into (PEP 668, "externally managed") is reported before anything is installed.
set -euo pipefail
cd "$(dirname "$0")/.."
say() { echo "[install] $*" >&2; }
die() { echo "[install] error: $*" >&2; exit 1; }

STEPS="redis,torch,project"
while [ $# -gt 0 ]; do
  case "$1" in
    --only) [ $# -ge 2 ] || die "--only needs steps (redis,torch,project)"; STEPS="$2"; shift 2 ;;
    --only=*) STEPS="${1#--only=}"; shift ;;
    -h|--help) sed -n '2,10p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) die "unknown argument '$1' (usage: scripts/install.sh [--only redis,torch,project])" ;;
  esac
done
for step in ${STEPS//,/ }; do
  case "$step" in redis|torch|project) ;; *) die "unknown step '$step' (steps: redis, torch, project)" ;; esac
done
want() { [[ ",$STEPS," == *",$1,"* ]]; }

install_redis() {
  command -v redis-server >/dev/null 2>&1 && return 0
  local why="redis-server is missing"
  command -v apt-get >/dev/null 2>&1 \
    || die "$why and there is no apt-get here: install redis-server yourself, or give \`tokenrelay up\` --redis-url"
  local sudo=""
  if [ "$(id -u)" -ne 0 ]; then
    command -v sudo >/dev/null 2>&1 \
      || die "$why and installing it needs root, but sudo is not installed: run this script as root, or run (as root) 'apt-get install -y redis-server', or give \`tokenrelay up\` --redis-url"
    sudo="sudo"
  fi
  say "redis-server not found: installing it with ${sudo:+sudo }apt-get"
  # `env` carries the variable through sudo, and is a real command when sudo is empty (root)
  $sudo env DEBIAN_FRONTEND=noninteractive apt-get update -qq
  $sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server >/dev/null
  hash -r
  command -v redis-server >/dev/null 2>&1 \
    || say "note: redis-server is installed but not on this PATH ($PATH); \`tokenrelay up\` looks for it there"
}

pick_python() {
  if [ -n "${PYTHON:-}" ]; then PY="$PYTHON"
  elif [ -n "${VIRTUAL_ENV:-}" ] && [ -x "$VIRTUAL_ENV/bin/python" ]; then PY="$VIRTUAL_ENV/bin/python"
  else PY="python3"; fi
  command -v "$PY" >/dev/null 2>&1 || die "no Python at '$PY' (set PYTHON=/path/to/python3.10+)"
  "$PY" -c 'import sys; sys.exit(sys.version_info < (3, 10))' || die "$PY is older than Python 3.10"
  "$PY" -m pip --version >/dev/null 2>&1 || die "$PY has no pip (Debian/Ubuntu: apt-get install python3-pip python3-venv)"
  # Outside a virtualenv, pip refuses a PEP 668 system Python: say so once, before installing anything.
  if [ -z "${PIP_BREAK_SYSTEM_PACKAGES:-}" ] && "$PY" -c '
import os, sys, sysconfig
sys.exit(0 if sys.prefix == sys.base_prefix
         and os.path.exists(os.path.join(sysconfig.get_path("stdlib"), "EXTERNALLY-MANAGED")) else 1)'; then
    die "$PY is the system's externally managed Python (PEP 668), which pip will not install into: make a virtualenv first (python3 -m venv ~/.venvs/tokenrelay && . ~/.venvs/tokenrelay/bin/activate), then rerun"
  fi
  say "python: $("$PY" -c 'import sys; print(sys.executable)')"
}

want redis && install_redis
if want torch || want project; then pick_python; fi
if want torch && ! "$PY" -c "import torch" >/dev/null 2>&1; then
  "$PY" -m pip install -q --disable-pip-version-check "torch==2.13.0"
fi
if want project; then
  "$PY" -m pip install -q --disable-pip-version-check -e ".[hf,default-model,bench,dev,trtllm-grpc,triton]"
  # pyenv only exposes new console scripts (`tokenrelay`) after a rehash.
  if command -v pyenv >/dev/null 2>&1; then pyenv rehash || true; fi
  if ! command -v tokenrelay >/dev/null 2>&1; then
    say "note: 'tokenrelay' is not on PATH; use '$PY -m tokenrelay_tools.cli.main' or add $("$PY" -c 'import sysconfig; print(sysconfig.get_path("scripts"))') to PATH"
  fi
fi
