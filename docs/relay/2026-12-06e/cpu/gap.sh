#!/bin/bash
# One-token requests, one stream, back to back (gap 0) and 50 ms apart, the router beside a bare
# grpc.aio Generate server on the same core, interleaved. Outputs: $OUT/gap{0,50}_R.txt.
#   OUT=dir [ROUNDS="1 2 3"] bash docs/relay/2026-12-06e/cpu/gap.sh
set -u
OUT=${OUT:?}
for r in ${ROUNDS:-1 2 3}; do for g in 0 50; do
  python bench/bench_relay.py --streams 1 --max-tokens 1 --duration 10 --warmup 2 --targets mesh bare \
    --router-cpus 0 --redis-cpus 1 --tokenizer-cpus 1 --engine-cpus 1 --client-cpus 1 --clients 1 \
    --router-arg=--detokenize=local --router-arg=--tokenize-local-bytes=16384 --gap-ms $g > $OUT/gap${g}_$r.txt 2>&1
  echo "gap $g round $r: $(grep -E '^\| 1 \|' $OUT/gap${g}_$r.txt | tr '\n' ' ')"
done; done
