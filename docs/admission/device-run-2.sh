#!/bin/bash
# Device run 2 (issue 11): admission cost with batched calls; fairness/priority/overload through a real mesh.
set -u
ROOT=$PWD
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PATH=$ROOT/.r4dev:$PATH LD_LIBRARY_PATH=$ROOT/.r4dev PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$ROOT
echo "== admission cost (batched, no settle task)"
timeout 150 python3 bench/bench_admission_cost.py --rates 1000,5000 --workers 2 --seconds 10 --cpu-list 0-2 \
  --json $OUT/adm_cost.json 2>&1 | grep -v warning | tee $OUT/adm_cost.txt
echo "== fairness, headroom off (default)"
timeout 200 python3 bench/bench_fairness.py --routers 2 --clients 4 --cpu-list 0-15 --json $OUT/fair.json 2>&1 | grep -v warning | tee $OUT/fair.txt
echo "== fairness a, headroom 0.1"
timeout 120 python3 bench/bench_fairness.py --scenario a --routers 2 --clients 4 --cpu-list 0-15 \
  --router-arg=--fair-headroom=0.1 --json $OUT/fair_h.json 2>&1 | grep -v warning | tee $OUT/fair_h.txt
