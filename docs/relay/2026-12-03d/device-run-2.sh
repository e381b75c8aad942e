#!/bin/bash
# Device run 2 of 2026-12-03d (run 1 again after two bench fixes: the bare server spun on the router's CPU while idle, and with fewer load processes than routers only 3 of 9 routers got traffic) (the 16-core host, GPU unused, every process pinned).
# A: one token per message, the router against a bare grpc.aio Generate server on the same core in the
#    same run (bench/bare_inference.py), default router and "local both", interleaved.
# C: four simulated H200s (--calibrated --engines 4), 8 router processes, default deltas and deltas of
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
G4="--calibrated --engines 4 --streams 1024 4096 --duration 8 --warmup 2 --routers 8 --router-cpus 0-7 --redis-cpus 8 --tokenizer-cpus 9 --engine-cpus 10-11 --clients 4 --client-cpus 12-15"
for md in 0 16; do
  timeout 200 python3 bench/bench_relay.py $G4 --min-delta-tokens $md > $W/gpu4_md$md.txt 2>&1
  echo "C md$md $(( $(date +%s) - t0 )) s:"; grep -E '^\| (1024|4096)' $W/gpu4_md$md.txt
done
tar czf $OUT/all.tgz -C $W .
