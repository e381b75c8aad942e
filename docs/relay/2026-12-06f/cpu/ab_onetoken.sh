#!/bin/bash
# One token per message (256 streams, 10 ms sim steps, engine wake-up delay 0, `up`'s local options): this tree
# against the tree extracted into .before/, interleaved, router pinned to core 0 and the rest on core 1.
# Outputs: $OUT/onetoken_{new,old}_R.txt.   OUT=dir [ROUNDS="1 2 3"] bash docs/relay/2026-12-06f/cpu/ab_onetoken.sh
set -u
ROOT=$(cd "$(dirname "$0")/../../../.." && pwd); OUT=${OUT:?}
for r in ${ROUNDS:-1 2 3}; do for v in new old; do
  D=$ROOT; [ $v = old ] && D=$ROOT/.before
  (cd $D && PYTHONPATH=$D timeout 100 python bench/bench_relay.py --streams 256 --step-ms 10 --duration 10 --warmup 3 \
    --targets mesh --router-arg=--engine-wake-delay=0 --router-arg=--detokenize=local \
    --router-arg=--tokenize-local-bytes=16384 --router-cpus 0 --redis-cpus 1 --tokenizer-cpus 1 --engine-cpus 1 \
    --client-cpus 1 --clients 2) > $OUT/onetoken_${v}_$r.txt 2>&1
  echo "$v $r: $(grep -E '^  mesh' $OUT/onetoken_${v}_$r.txt | sed 's/  */ /g' | cut -c1-260)"
done; done
