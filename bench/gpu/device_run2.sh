#!/bin/bash
# Lead's second device run: routing decision time at 1k req/s on quiet cores, then the whole mesh with hf
# on the GPU vs the engine in process, 4 waves of 32 tokens per stream.
set -u
ROOT=$PWD
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site-hf .whl-hf/*.whl || exit 1
echo "== decision time"
( export PYTHONPATH=/tmp/site-hf:/tmp/site:$ROOT PATH=$ROOT/.r4dev:$PATH LD_LIBRARY_PATH=$ROOT/.r4dev
  for R in 1000 500; do
    timeout 80 python3 bench/bench_routing.py --decision-time --rate $R --seconds 10 --json $OUT/decision_$R.json \
      > $OUT/decision_$R.txt 2>&1; tail -12 $OUT/decision_$R.txt
  done )
echo "== mesh vs in process"
INSTALL=0 PYTHONPATH=/tmp/site-hf:/tmp/site:$ROOT STREAMS="1 16 64 256" PER_STREAM=4 OUTPUT=32 PHASE_LIMIT=60 \
  BUDGET=420 bash bench/gpu/run_mesh_gpu.sh
