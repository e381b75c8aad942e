#!/bin/bash
# Device run 2 of 2026-12-06 (~110 s; ONETOKEN=1 adds ~50 s): the relay at 256 streams (fast sim, router pinned to one core) with the uvloop
# busy-share fix (282d46b, services/mux.py) against the tree before it (282d46b~1, extracted into the ignored .before/
# and carried), interleaved, two rounds; then one token per message beside the bare server on each loop (after).
set -u
. bench/device_env.sh
PIN="--router-cpus 0 --redis-cpus 1 --tokenizer-cpus 2 --engine-cpus 3 --client-cpus 4-14 --clients 11"
row() { grep -E '^  (mesh|bare)' "$1" | sed 's/  */ /g' | cut -c1-300; }
for r in 1 2; do
  for v in before:uvloop after:uvloop after:asyncio; do
    tree=${v%%:*}; L=${v##*:}; D=$ROOT; [ $tree = before ] && D=$ROOT/.before
    (cd $D && PYTHONPATH=/tmp/site:$D timeout 45 python3 bench/bench_relay.py --streams 256 --duration 6 --warmup 2 \
      --targets mesh $PIN --router-arg=--event-loop=$L) > $W/relay_${tree}_${L}_$r.txt 2>&1
    echo "relay $tree $L $r $(( $(date +%s) - t0 )) s"; row $W/relay_${tree}_${L}_$r.txt
  done
done
[ "${ONETOKEN:-0}" = 1 ] && for L in uvloop asyncio; do
  timeout 75 python3 bench/bench_relay.py --streams 256 --step-ms 10 --duration 6 --warmup 2 --targets mesh bare \
    --router-arg=--engine-wake-delay=0 --router-arg=--event-loop=$L --bare-event-loop $L $PIN > $W/onetoken_$L.txt 2>&1
  echo "onetoken $L $(( $(date +%s) - t0 )) s"; row $W/onetoken_$L.txt
done
tar czf $OUT/run2.tgz -C $W .
