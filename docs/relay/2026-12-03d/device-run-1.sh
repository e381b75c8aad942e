#!/bin/bash
# Device run 1 of 2026-12-03d (the 16-core host, GPU unused, every process pinned).
# A: one token per message, the router against a bare grpc.aio Generate server on the same core in the
#    same run (bench/bare_inference.py), default router and "local both", interleaved.
# C: four simulated H200s (--calibrated --engines 4), 9 router processes, default deltas and deltas of
#    at least 16 tokens (a service-to-service caller's GenerateRequest.min_delta_tokens).
set -u
. bench/device_env.sh
PIN="--router-cpus 0 --redis-cpus 1 --tokenizer-cpus 2 --engine-cpus 3 --client-cpus 4-14 --clients 11"
LOCAL="--router-arg=--detokenize=local --router-arg=--tokenize-local-bytes=16384"
ONE="--streams 256 --step-ms 10 --duration 6 --warmup 2 --targets mesh bare --router-arg=--engine-wake-delay=0"
i=0
for mode in default local default local; do
  i=$((i+1)); extra=""; [ $mode = local ] && extra=$LOCAL
  timeout 60 python3 bench/bench_relay.py $ONE $PIN $extra > $W/one_${i}_$mode.txt 2>&1
  echo "A$i $mode $(( $(date +%s) - t0 )) s:"; grep -E '^\| 256' $W/one_${i}_$mode.txt
done
# Run 2 calls this script with its own layout in G4.
G4=${G4:-"--calibrated --engines 4 --streams 1024 4096 --duration 8 --warmup 2 --routers 9 --router-cpus 0-8 --redis-cpus 9 --tokenizer-cpus 10 --engine-cpus 11-12 --clients 3 --client-cpus 13-15"}
for md in 0 16; do
  timeout 200 python3 bench/bench_relay.py $G4 --min-delta-tokens $md > $W/gpu4_md$md.txt 2>&1
  echo "C md$md $(( $(date +%s) - t0 )) s:"; grep -E '^\| (1024|4096)' $W/gpu4_md$md.txt
done
tar czf $OUT/all.tgz -C $W .
