#!/usr/bin/env bash
# The project's test command: stubs up to date, lint, then the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
"$PY" scripts/gen_protos.py --check
"$PY" -m ruff check .
"$PY" -m mypy services router_svc tokenizer_svc engine_svc tokenrelay_tools
"$PY" -m pytest -q -p no:cacheprovider "$@"
