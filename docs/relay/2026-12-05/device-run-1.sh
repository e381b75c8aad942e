#!/bin/bash
# NOT RUN: written 2026-12-05; every call that session was refused ("no device machine could be started right now"), until
# its device time was spent on the refusals. Kept for the next session that has a machine.
# Device run 1 of 2026-12-05: the services' event loop, asyncio against uvloop (services/eventloop.py), on
# quiet cores, interleaved in one call: the relay at 256 streams (fast sim, one router core), one token per
# message beside the bare grpc.aio server on the same loop, 3 routers against one simulated H200, and scenario
# d's refusals (2 routers). (chat-multiturn TTFT was left out: on the 2-core machine the two loops added the same,
# +8.1 / +7.9 ms p50.)
set -u
# SECTIONS (default: all) picks parts: relay onetoken h200 d; ROUNDS (default 2): relay pairs.
SECTIONS=${SECTIONS:-relay onetoken h200 d}
on() { [[ " $SECTIONS " == *" $1 "* ]]; }
. bench/device_env.sh
PIN="--router-cpus 0 --redis-cpus 1 --tokenizer-cpus 2 --engine-cpus 3 --client-cpus 4-14 --clients 11"
el() { echo "$1 $(( $(date +%s) - t0 )) s"; }
row() { grep -E '^  (mesh|bare|engine)' "$1" | sed 's/  */ /g' | cut -c1-330; }
on relay && for r in $(seq ${ROUNDS:-2}); do for L in asyncio uvloop; do
  timeout 45 python3 bench/bench_relay.py --streams 256 --duration 6 --warmup 2 --targets mesh $PIN \
    --router-arg=--event-loop=$L > $W/relay_${L}_$r.txt 2>&1
  el "relay $L $r"; row $W/relay_${L}_$r.txt
done; done
on onetoken && for L in asyncio uvloop; do
  timeout 75 python3 bench/bench_relay.py --streams 256 --step-ms 10 --duration 6 --warmup 2 --targets mesh bare \
    --router-arg=--engine-wake-delay=0 --router-arg=--event-loop=$L --bare-event-loop $L $PIN > $W/onetoken_$L.txt 2>&1
  el "onetoken $L"; row $W/onetoken_$L.txt
done
on h200 && for L in asyncio uvloop; do
  timeout 100 python3 bench/bench_relay.py --calibrated --duration 6 --warmup 2 --streams 256 1024 --routers 3 \
    --router-cpus 0-2 --redis-cpus 3 --tokenizer-cpus 4 --engine-cpus 5 --clients 10 --client-cpus 6-15 \
    --router-arg=--event-loop=$L > $W/h200x3_$L.txt 2>&1
  el "h200x3 $L"; grep -E '^\| (256|1024)' $W/h200x3_$L.txt
done
on d && for L in asyncio uvloop; do
  timeout 80 python3 bench/bench_fairness.py --scenario d --routers 2 --clients 4 --cpu-list 0-15 --seconds 6 \
    --router-arg=--event-loop=$L --json $W/d_$L.json 2>&1 | grep -v warning > $W/d_$L.txt
  el "scenario d $L"; grep -E "capacity alone|^\| RESOURCE|^\| (goodput /|rejection|router CPU|refusals decided)" $W/d_$L.txt
done
tar czf $OUT/all.tgz -C $W .
