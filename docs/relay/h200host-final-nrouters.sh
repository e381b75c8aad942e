#!/bin/bash
# Lead's final device run: N routers against one (and two) simulated H200s, mesh vs engine alone.
set -u
ROOT=$PWD
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PATH=$ROOT/.r4dev:$PATH LD_LIBRARY_PATH=$ROOT/.r4dev PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$ROOT
B="python3 bench/bench_relay.py --calibrated --duration 8 --warmup 2"
echo "== 1 GPU, 2 routers"
$B --streams 256 1024 --routers 2 --router-cpus 0-1 --redis-cpus 2 --tokenizer-cpus 3 --engine-cpus 4 \
   --clients 11 --client-cpus 5-15 --json-out $OUT/gpu1_r2.json 2>&1 | grep -v "^|" | tee $OUT/gpu1_r2.txt
echo "== 1 GPU, 3 routers"
$B --streams 256 1024 --routers 3 --router-cpus 0-2 --redis-cpus 3 --tokenizer-cpus 4 --engine-cpus 5 \
   --clients 10 --client-cpus 6-15 --json-out $OUT/gpu1_r3.json 2>&1 | grep -v "^|" | tee $OUT/gpu1_r3.txt
if [ "${TWO_GPU:-1}" = 1 ]; then
echo "== 2 GPUs, 4 routers, 2 tokenizers"
$B --streams 512 2048 --routers 4 --router-cpus 0-3 --redis-cpus 4 --tokenizers 2 --tokenizer-cpus 5-6 \
   --engines 2 --engine-cpus 7-8 --clients 7 --client-cpus 9-15 --json-out $OUT/gpu2_r4.json 2>&1 | grep -v "^|" | tee $OUT/gpu2_r4.txt
fi
