#!/bin/bash
# Device run 4 (issue 11): the defaults after the slot hold (50 ms, priority holds too).
set -u
ROOT=$PWD
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PATH=$ROOT/.r4dev:$PATH LD_LIBRARY_PATH=$ROOT/.r4dev PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$ROOT
timeout 240 python3 bench/bench_fairness.py --routers 2 --clients 4 --cpu-list 0-15 --json $OUT/fair.json 2>&1 | grep -v warning | tee $OUT/fair.txt
