#!/bin/bash
# (Run from the repo root on the lent 16-core host with .whl/ (the service wheels + pytest) and .r4dev/ (redis-server + libs) carried; see docs/benchmarks.md.)
# Device run 6: the relay after the mux sink fix (fast sim, 64/256/1024 streams, mesh only; and ~1 token per message), issue 11's d with 2 routers.
set -u
ROOT=$PWD
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PATH=$ROOT/.r4dev:$PATH LD_LIBRARY_PATH=$ROOT/.r4dev PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$ROOT
W=/tmp/o; mkdir -p $W; t0=$(date +%s)
PIN="--router-cpus 0 --redis-cpus 1 --tokenizer-cpus 2 --engine-cpus 3 --client-cpus 4-13 --clients 10"
timeout 80 python3 bench/bench_relay.py --streams 64 256 1024 --duration 6 --warmup 2 --targets mesh $PIN > $W/relay.txt 2>&1; echo "relay $(( $(date +%s) - t0 )) s"
timeout 30 python3 bench/bench_relay.py --streams 256 --step-ms 10 --duration 6 --warmup 2 --targets mesh $PIN --router-arg=--engine-wake-delay=0 > $W/relay1.txt 2>&1; echo "relay1 $(( $(date +%s) - t0 )) s"
timeout 45 python3 bench/bench_fairness.py --scenario d --routers 2 --clients 4 --cpu-list 0-15 --seconds 6 --json $W/d2.json 2>&1 | grep -v warning > $W/d2.txt; echo "d2 $(( $(date +%s) - t0 )) s"
tar czf $OUT/all.tgz -C $W .
grep -E "^\| [0-9]" $W/relay.txt $W/relay1.txt; grep -E "capacity alone|^\| (goodput /|rejection|router CPU)" $W/d2.txt
