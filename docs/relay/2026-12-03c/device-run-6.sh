#!/bin/bash
# Device run 6 of 2026-12-03c: does the relay's spread between identical runs follow the host's core speed?
# Five runs of the relay at 256 streams with a probe (a fixed pure-Python loop, its work per CPU-second) on
# a CPU of its own during each measured window.
set -u
ROOT=$PWD
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PATH=$ROOT/.r4dev:$PATH LD_LIBRARY_PATH=$ROOT/.r4dev PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$ROOT
W=/tmp/o; mkdir -p $W; t0=$(date +%s)
PIN="--router-cpus 0 --redis-cpus 1 --tokenizer-cpus 2 --engine-cpus 3 --client-cpus 4-14 --clients 11 --probe-cpu 15"
for r in 1 2 3 4 5; do
  timeout 45 python3 bench/bench_relay.py --streams 256 --duration 6 --warmup 2 --targets mesh $PIN > $W/relay_probe$r.txt 2>&1
  echo "$r $(( $(date +%s) - t0 )) s: $(grep -E '^  mesh' $W/relay_probe$r.txt | sed 's/  */ /g')"
done
tar czf $OUT/all.tgz -C $W .
