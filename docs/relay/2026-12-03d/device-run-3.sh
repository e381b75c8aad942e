#!/bin/bash
# Device run 3 of 2026-12-03d: why four simulated H200s behind 8 routers reached only 0.36 of the engines
# alone in run 2 (routers busy, yet 12k tokens per router CPU-second). Same layout, 1,024 streams, the
# CPU of Redis, the tokenizer and the engines beside the routers', the streams each engine finished:
# the default policy (prefix), least-loaded (no KV-event index), and prefix without placement sharing.
set -u
. bench/device_env.sh
G4="--calibrated --engines 4 --streams 1024 --duration 8 --warmup 2 --routers 8 --router-cpus 0-7 --redis-cpus 8 --tokenizer-cpus 9 --engine-cpus 10-11 --clients 4 --client-cpus 12-15"
i=0
for cfg in "prefix:--targets mesh engine" "least:--targets mesh --router-arg=--routing-policy=least-loaded" "noshare:--targets mesh --router-arg=--no-share-placements"; do
  name=${cfg%%:*}; flags=${cfg#*:}
  timeout 150 python3 bench/bench_relay.py $G4 $flags --json-out $W/g4_$name.json > $W/g4_$name.txt 2>&1
  echo "$name $(( $(date +%s) - t0 )) s:"; grep -E '^  (mesh|engine)' $W/g4_$name.txt | cut -c1-420
  python3 -c "import json; r=json.load(open('$W/g4_$name.json'))['rows'][0]; print('  finished by engine', r['engine_finished_by_engine'])"
done
tar czf $OUT/all.tgz -C $W .
