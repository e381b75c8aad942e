#!/bin/bash
# (Carried as device-run-1.sh: .whl/, .r4dev/, .sgw/.)
# Device run 5 of 2026-12-03: run 4's balance-bound runs (slack 0 and 1) repeated once, for their spread, with SGLang's
# cache_aware beside them.
set -u
ROOT=$PWD
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
python3 -m venv /opt/sgvenv && /opt/sgvenv/bin/pip install -q --no-index --find-links .sgw sglang-router==0.3.2 || exit 1
export TOKENRELAY_CACHE=/tmp/trcache; V=$TOKENRELAY_CACHE/sglang-router-0.3.2; mkdir -p $V/bin
printf '#!/bin/sh\nunset PYTHONPATH\nexec /opt/sgvenv/bin/python "$@"\n' > $V/bin/python; chmod +x $V/bin/python
export PATH=$ROOT/.r4dev:$PATH LD_LIBRARY_PATH=$ROOT/.r4dev PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$ROOT
W=/tmp/o; mkdir -p $W; t0=$(date +%s)
for sl in 0 1; do
  timeout 150 python3 bench/bench_routing.py --traces shared-hot,evict,chat-multiturn --configs prefix,round-robin,sglang-cache_aware \
    --router-flag=--prefix-balance-slack=$sl --json $W/slack$sl.json > $W/slack$sl.txt 2>&1
  echo "slack $sl $(( $(date +%s) - t0 )) s"
done
tar czf $OUT/all.tgz -C $W .
for f in slack0 slack1; do grep -E "^(shared-hot|evict|chat-multiturn) +(prefix|round|sglang)" $W/$f.txt | sed "s/^/$f /"; done
