#!/bin/bash
# Device run 2 of 2026-12-03c: issue 11's scenario d (3x overload, 2 routers) with the token-budget memo
# (the default, --budget-memo-ms 500) against it off (0), and the memo with the router tokenizing (and
# detokenizing) itself, interleaved, twice each.
set -u
ROOT=$PWD
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PATH=$ROOT/.r4dev:$PATH LD_LIBRARY_PATH=$ROOT/.r4dev PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$ROOT
W=/tmp/o; mkdir -p $W; t0=$(date +%s)
for r in 1 2; do
  for mode in ${MODES:-memo off local}; do
    X=""; [ $mode = off ] && X="--router-arg=--budget-memo-ms=0"
    [ $mode = local ] && X="--router-arg=--detokenize=local --router-arg=--tokenize-local-bytes=16384"
    timeout 80 python3 bench/bench_fairness.py --scenario d --routers 2 --clients 4 --cpu-list 0-15 --seconds 6 $X \
      --json $W/d_${mode}$r.json 2>&1 | grep -v warning > $W/d_${mode}$r.txt
    echo "== $mode$r $(( $(date +%s) - t0 )) s"
    grep -E "capacity alone|^\| RESOURCE|^\| (goodput /|rejection|router CPU|refusals decided|tokenizer /)" $W/d_${mode}$r.txt
  done
done
tar czf $OUT/all.tgz -C $W .
