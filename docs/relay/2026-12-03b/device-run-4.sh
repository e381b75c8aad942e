#!/bin/bash
# Device run 4 of 2026-12-03 (afternoon): the routing decision time with holds on (the default) and off
# (--prefix-hold-seconds 0), interleaved, twice each, 10 s at 1000 offered. Carried: .whl/, .r4dev/.
set -u
ROOT=$PWD
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PATH=$ROOT/.r4dev:$PATH LD_LIBRARY_PATH=$ROOT/.r4dev PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$ROOT
W=/tmp/o4; mkdir -p $W
for i in 1 2; do for h in 0.5 0; do
  timeout 60 python3 bench/bench_routing.py --decision-time --rate 1000 --seconds 10 \
    --router-flag=--prefix-hold-seconds=$h > $W/decision-hold$h-$i.txt 2>&1
  echo "hold $h run $i: $(grep -E "achieved|route_seconds|errors\"" $W/decision-hold$h-$i.txt | tr -d '\n ')"
done; done
tar czf $OUT/all.tgz -C $W .
