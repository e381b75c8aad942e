#!/bin/bash
# NOT RUN YET: written 2026-12-04, when no device machine was lent; kept for the next session that has one.
# Device run 1 of 2026-12-04: the tree after three sessions without device time (the claim path's
# ordering and cancel-window fixes, the probe's logging) on quiet cores, as a regression check against
# the figures of 2026-12-02/03: the relay at 256 streams (fast sim, one router core), one token per
# message beside the bare grpc.aio server, chat-multiturn TTFT added (default and with the router
# tokenizing and detokenizing itself), scenario d (refusals), and 3 routers against one simulated H200.
set -u
. bench/device_env.sh
PIN="--router-cpus 0 --redis-cpus 1 --tokenizer-cpus 2 --engine-cpus 3 --client-cpus 4-14 --clients 11"
LOCAL="--router-arg=--detokenize=local --router-arg=--tokenize-local-bytes=16384"
for r in 1 2; do
  timeout 45 python3 bench/bench_relay.py --streams 256 --duration 6 --warmup 2 --targets mesh $PIN > $W/relay$r.txt 2>&1
  echo "relay$r $(( $(date +%s) - t0 )) s: $(grep -E '^  mesh' $W/relay$r.txt | sed 's/  */ /g' | cut -c1-300)"
done
timeout 60 python3 bench/bench_relay.py --streams 256 --step-ms 10 --duration 6 --warmup 2 --targets mesh bare \
  --router-arg=--engine-wake-delay=0 $PIN > $W/onetoken.txt 2>&1
echo "onetoken $(( $(date +%s) - t0 )) s"; grep -E '^  (mesh|bare)' $W/onetoken.txt | sed 's/  */ /g' | cut -c1-300
OUT=$W TAG=default DUR=20 timeout 140 bash bench/ttft_pinned.sh > $W/ttft_default.log 2>&1; echo "ttft default $(( $(date +%s) - t0 )) s"
UP_ARGS="$LOCAL" OUT=$W TAG=local DUR=20 timeout 140 bash bench/ttft_pinned.sh > $W/ttft_local.log 2>&1; echo "ttft local $(( $(date +%s) - t0 )) s"
for t in default local; do echo "== $t"; grep -E "^TTFT p(50|99)|^server TTFT p" $W/${t}_compare.txt; grep -E "^(arrive|tokenize|->|detok|router TTFT|mesh part)" $W/${t}_breakdown.txt; done
timeout 80 python3 bench/bench_fairness.py --scenario d --routers 2 --clients 4 --cpu-list 0-15 --seconds 6 --json $W/d.json 2>&1 | grep -v warning > $W/d.txt
echo "scenario d $(( $(date +%s) - t0 )) s"; grep -E "capacity alone|^\| RESOURCE|^\| (goodput /|rejection|router CPU|refusals decided)" $W/d.txt
timeout 90 python3 bench/bench_relay.py --calibrated --duration 8 --warmup 2 --streams 256 1024 --routers 3 --router-cpus 0-2 \
  --redis-cpus 3 --tokenizer-cpus 4 --engine-cpus 5 --clients 10 --client-cpus 6-15 > $W/h200x3.txt 2>&1
echo "h200 x3 routers $(( $(date +%s) - t0 )) s"; grep -E '^\| (256|1024)' $W/h200x3.txt; grep -E '^  (mesh|engine)' $W/h200x3.txt | sed 's/  */ /g' | cut -c1-300
tar czf $OUT/all.tgz -C $W .
