#!/bin/bash
# Back-to-back one-token requests through one router against the bare Generate server on the same core
# (bench_relay --streams 1 --max-tokens 1 --targets mesh bare), this tree against .before/, interleaved;
# `tokenrelay up`'s local options. Outputs: $OUT/seq_{new,old}_R.txt.  OUT=dir [ROUNDS="1 2 3"] bash ...
set -u
ROOT=$(cd "$(dirname "$0")/../../../.." && pwd); OUT=${OUT:?}
P="--router-cpus 0 --redis-cpus 1 --tokenizer-cpus 1 --engine-cpus 1 --client-cpus 1 --clients 1"
L="--router-arg=--detokenize=local --router-arg=--tokenize-local-bytes=16384"
for r in ${ROUNDS:-1 2 3}; do for v in new old; do
  D=$ROOT; [ $v = old ] && D=$ROOT/.before
  (cd $D && PYTHONPATH=$D timeout 200 python bench/bench_relay.py --streams 1 --max-tokens 1 --duration 6 --warmup 2 \
     --targets mesh bare $P $L) > $OUT/seq_${v}_$r.txt 2>&1
  echo "$v $r: $(grep -E '^\| 1 \| (mesh|bare)' $OUT/seq_${v}_$r.txt | tr '\n' ' ')"
done; done
