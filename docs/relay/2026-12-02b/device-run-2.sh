#!/bin/bash
# (Run from the repo root on the lent 16-core host with .whl/, .r4dev/ and .devcarry/ carried, as device-run-1.sh.)
# Device run 2: --detokenize local against the default (the tokenizer's Detokenize stream), interleaved:
# chat-multiturn TTFT (ttft_pinned.sh, twice each), the relay at 256 streams (fast sim) and at ~1 token per
# message, with a py-spy profile of the local router in the latter.
set -u
ROOT=$PWD
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/spy .devcarry/py_spy*.whl || true
export PATH=$ROOT/.r4dev:/tmp/spy/bin:$PATH LD_LIBRARY_PATH=$ROOT/.r4dev PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$ROOT
W=/tmp/o; mkdir -p $W; t0=$(date +%s)
LOCAL="--router-arg=--detokenize=local"
for r in 1 2; do
  OUT=$W TAG=remote$r DUR=20 timeout 140 bash bench/ttft_pinned.sh > $W/ttft_remote$r.log 2>&1; echo "ttft remote$r $(( $(date +%s) - t0 )) s"
  UP_ARGS="$LOCAL" OUT=$W TAG=local$r DUR=20 timeout 140 bash bench/ttft_pinned.sh > $W/ttft_local$r.log 2>&1; echo "ttft local$r $(( $(date +%s) - t0 )) s"
done
PIN="--router-cpus 0 --redis-cpus 1 --tokenizer-cpus 2 --engine-cpus 3 --client-cpus 4-13 --clients 10"
for r in 1 2; do
  timeout 40 python3 bench/bench_relay.py --streams 256 --duration 6 --warmup 2 --targets mesh $PIN > $W/relay_remote$r.txt 2>&1
  timeout 40 python3 bench/bench_relay.py --streams 256 --duration 6 --warmup 2 --targets mesh $PIN $LOCAL > $W/relay_local$r.txt 2>&1
  echo "relay $r $(( $(date +%s) - t0 )) s"
done
timeout 40 python3 bench/bench_relay.py --streams 256 --step-ms 10 --duration 6 --warmup 2 --targets mesh $PIN --router-arg=--engine-wake-delay=0 > $W/relay1_remote.txt 2>&1
( for i in $(seq 1 60); do p=$(pgrep -f "router_svc" | head -1); [ -n "$p" ] && break; sleep 0.5; done
  sleep 5; py-spy record --pid $p -d 4 -r 250 --nonblocking -f raw -o $W/relay1_local.spy > $W/spy.log 2>&1 ) &
timeout 40 python3 bench/bench_relay.py --streams 256 --step-ms 10 --duration 6 --warmup 2 --targets mesh $PIN --router-arg=--engine-wake-delay=0 $LOCAL > $W/relay1_local.txt 2>&1
wait; echo "relay1 $(( $(date +%s) - t0 )) s"
tar czf $OUT/all.tgz -C $W .
for f in $W/relay_*.txt $W/relay1_*.txt; do echo "$(basename $f): $(grep -E '^  mesh' $f | sed 's/  */ /g')"; done
for t in remote1 local1 remote2 local2; do echo "== $t"; grep -E "^TTFT p(50|99)|^server TTFT" $W/${t}_compare.txt; grep -E "^(tokenize|detok|router TTFT|mesh part)" $W/${t}_breakdown.txt; done
