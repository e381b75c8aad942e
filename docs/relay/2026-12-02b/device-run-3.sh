#!/bin/bash
# (Run from the repo root on the lent 16-core host with .whl/, .r4dev/ and .devcarry/ carried, as device-run-1.sh.)
# Device run 3: N routers against one simulated H200 (--calibrated), mesh and engine alone in the same run,
# the current tree: 3 routers (the configuration that met 0.95 before), 2 routers, 2 routers with --detokenize local.
set -u
ROOT=$PWD
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PATH=$ROOT/.r4dev:$PATH LD_LIBRARY_PATH=$ROOT/.r4dev PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$ROOT
W=/tmp/o; mkdir -p $W; t0=$(date +%s)
B="python3 bench/bench_relay.py --calibrated --duration 8 --warmup 2 --streams 256 1024"
timeout 150 $B --routers 3 --router-cpus 0-2 --redis-cpus 3 --tokenizer-cpus 4 --engine-cpus 5 --clients 10 --client-cpus 6-15 > $W/r3.txt 2>&1; echo "r3 $(( $(date +%s) - t0 )) s"
timeout 150 $B --routers 2 --router-cpus 0-1 --redis-cpus 2 --tokenizer-cpus 3 --engine-cpus 4 --clients 11 --client-cpus 5-15 > $W/r2.txt 2>&1; echo "r2 $(( $(date +%s) - t0 )) s"
timeout 150 $B --routers 2 --router-cpus 0-1 --redis-cpus 2 --tokenizer-cpus 3 --engine-cpus 4 --clients 11 --client-cpus 5-15 --router-arg=--detokenize=local > $W/r2l.txt 2>&1; echo "r2l $(( $(date +%s) - t0 )) s"
tar czf $OUT/all.tgz -C $W .
for f in r3 r2 r2l; do echo "== $f"; grep -E "^\| [0-9]" $W/$f.txt; done
