#!/bin/bash
# Device run 4 of 2026-12-03d: run 3 showed the one tokenizer process saturated (7.9 CPU-s in 8 s): it
# detokenizes every token of the four simulated GPUs. The same layout with the routers detokenizing
# themselves (--detokenize local), 1,024 and 4,096 streams, the engines alone in the same run.
set -u
. bench/device_env.sh
G4="--calibrated --engines 4 --streams 1024 4096 --duration 8 --warmup 2 --routers 8 --router-cpus 0-7 --redis-cpus 8 --tokenizer-cpus 9 --engine-cpus 10-11 --clients 4 --client-cpus 12-15"
timeout 250 python3 bench/bench_relay.py $G4 --router-arg=--detokenize=local --json-out $W/g4_local.json > $W/g4_local.txt 2>&1
grep -E '^  (mesh|engine)' $W/g4_local.txt | cut -c1-420; grep -E '^\| (1024|4096)' $W/g4_local.txt
tar czf $OUT/all.tgz -C $W .
