#!/bin/bash
# Device run 5 of 2026-12-03c: scenario d, the tree at 537f9da (a full queue answered without waiting for
# the id claim) against be9c48d (the tree of device run 3), interleaved three times, in one call (the
# host's noise between calls is larger than the change). Carry .old/ = `git archive be9c48d` unpacked.
set -u
ROOT=$PWD
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PATH=$ROOT/.r4dev:$PATH LD_LIBRARY_PATH=$ROOT/.r4dev PYTHONUNBUFFERED=1
W=/tmp/o; mkdir -p $W; t0=$(date +%s)
for r in 1 2 3; do
  for tree in new old; do
    T=$ROOT; [ $tree = old ] && T=$ROOT/.old
    (cd $T && PYTHONPATH=/tmp/site:$T timeout 80 python3 bench/bench_fairness.py --scenario d --routers 2 --clients 4 \
      --cpu-list 0-15 --seconds 6 --json $W/d_${tree}$r.json 2>&1 | grep -v warning > $W/d_${tree}$r.txt)
    echo "== $tree$r $(( $(date +%s) - t0 )) s"
    grep -E "capacity alone|^\| RESOURCE|^\| (goodput /|rejection|router CPU|refusals decided)" $W/d_${tree}$r.txt
  done
done
tar czf $OUT/all.tgz -C $W .
