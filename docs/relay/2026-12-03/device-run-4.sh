#!/bin/bash
# (Carried as device-run-1.sh: .whl/, .r4dev/, .sgw/.)
# Device run 4 of 2026-12-03: the prefix policy's balance bound taken the other way on quiet cores
# (--prefix-balance-slack 0 and 1, the three traces, beside round-robin), then the default once more with
# two routers. Measured first on the 2-core machine while CI shared it (docs/routing.md).
set -u
ROOT=$PWD
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PATH=$ROOT/.r4dev:$PATH LD_LIBRARY_PATH=$ROOT/.r4dev PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$ROOT
W=/tmp/o; mkdir -p $W; t0=$(date +%s)
for sl in 0 1; do
  timeout 150 python3 bench/bench_routing.py --traces shared-hot,evict,chat-multiturn --configs prefix,round-robin \
    --router-flag=--prefix-balance-slack=$sl --json $W/slack$sl.json > $W/slack$sl.txt 2>&1
  echo "slack $sl $(( $(date +%s) - t0 )) s"
done
timeout 150 python3 bench/bench_routing.py --traces shared-hot,evict,chat-multiturn --configs prefix,prefix-2routers \
  --json $W/two.json > $W/two.txt 2>&1; echo "two $(( $(date +%s) - t0 )) s"
tar czf $OUT/all.tgz -C $W .
for f in slack0 slack1 two; do grep -E "^(shared-hot|evict|chat-multiturn) +(prefix|round)" $W/$f.txt | sed "s/^/$f /"; done
