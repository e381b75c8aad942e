#!/usr/bin/env bash
# The tokenizer bench (bench_tokenizer.py) on a host with many cores: for each K in $CORES, the
# service and the raw encoder get the top K cores and the bench client the rest, so the ratio
# compares the service with the bare library on the same K cores with nothing else on them.
#   CORES="1 4 8" CLIENTS="16 64" bash bench/run_tokenizer_cores.sh    # JSON + tables in $OUT
set -euo pipefail
OUT=${OUT:-/tmp/tokbench}; mkdir -p "$OUT"
N=$(nproc)
for K in ${CORES:-1 4 8}; do
  for C in ${CLIENTS:-16 64}; do
    echo "== service on $K of $N cores, $C clients"
    python3 bench/bench_tokenizer.py --service-cpus $((N - K))-$((N - 1)) --client-cpus 0-$((N - K - 1)) \
      --clients "$C" --detok-requests 64 --detok-tokens 256 --repeats 2 --json-out "$OUT/tok_${K}c_${C}.json" \
      ${BENCH_ARGS:-} | tee "$OUT/tok_${K}c_${C}.txt"
  done
done
