#!/bin/bash
# Device run 3 (issue 11): fairness and priority with the slot hold (default 20 ms) and without.
set -u
ROOT=$PWD
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PATH=$ROOT/.r4dev:$PATH LD_LIBRARY_PATH=$ROOT/.r4dev PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$ROOT
echo "== fairness, defaults (slot hold 20 ms)"
timeout 220 python3 bench/bench_fairness.py --routers 2 --clients 4 --cpu-list 0-15 --json $OUT/fair.json 2>&1 | grep -v warning | tee $OUT/fair.txt
echo "== a and c, slot hold 50 ms"
timeout 160 python3 bench/bench_fairness.py --scenario a,c --routers 2 --clients 4 --cpu-list 0-15 \
  --router-arg=--slot-hold-ms=50 --json $OUT/fair_h50.json 2>&1 | grep -v warning | tee $OUT/fair_h50.txt
echo "== admission cost, 1k/s"
timeout 80 python3 bench/bench_admission_cost.py --rates 1000 --workers 2 --seconds 10 --cpu-list 0-2 2>&1 | grep -v warning | tee $OUT/adm_cost.txt
