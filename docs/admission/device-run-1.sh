#!/bin/bash
# Device run 1 (issue 11): admission cost at 1k and 5k req/s with 2 router-side clients; relay check with the queue in the path.
set -u
ROOT=$PWD
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PATH=$ROOT/.r4dev:$PATH LD_LIBRARY_PATH=$ROOT/.r4dev PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$ROOT
redis-server --version
nproc
echo "== admission cost"
timeout 200 python3 bench/bench_admission_cost.py --rates 1000,5000 --workers 2 --seconds 10 --cpu-list 0-2 \
  --json $OUT/adm_cost.json 2>&1 | tee $OUT/adm_cost.txt
echo "== admission cost, 4 workers"
timeout 120 python3 bench/bench_admission_cost.py --rates 5000 --workers 4 --seconds 8 --cpu-list 0-4 \
  --json $OUT/adm_cost4.json 2>&1 | tee $OUT/adm_cost4.txt
echo "== relay: 1 simulated H200, 3 routers, the queue in the path"
timeout 240 python3 bench/bench_relay.py --calibrated --duration 8 --warmup 2 --streams 256 1024 --routers 3 \
  --router-cpus 0-2 --redis-cpus 3 --tokenizer-cpus 4 --engine-cpus 5 --clients 10 --client-cpus 6-15 \
  --json-out $OUT/relay_r3.json 2>&1 | grep -v "^|" | tee $OUT/relay_r3.txt
