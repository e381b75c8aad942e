#!/bin/bash
# (Run from the repo root on the lent 16-core host with .whl/ (service wheels), .r4dev/ (redis-server + libs)
# and .devcarry/ (py-spy) carried; see docs/benchmarks.md.)
# Device run 1 of 2026-12-02b: the current tree on quiet cores: relay (fast sim, 64/256/1024, mesh only),
# ~1 token per message with a py-spy profile of the router, chat-multiturn TTFT (ttft_pinned.sh),
# issue 11's scenario d with 2 routers.
set -u
ROOT=$PWD
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/spy .devcarry/py_spy*.whl || true
export PATH=$ROOT/.r4dev:/tmp/spy/bin:$PATH LD_LIBRARY_PATH=$ROOT/.r4dev PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$ROOT
redis-server --version || exit 1
W=/tmp/o; mkdir -p $W; t0=$(date +%s)
PIN="--router-cpus 0 --redis-cpus 1 --tokenizer-cpus 2 --engine-cpus 3 --client-cpus 4-13 --clients 10"
timeout 100 python3 bench/bench_relay.py --streams 64 256 1024 --duration 6 --warmup 2 --targets mesh $PIN > $W/relay.txt 2>&1; echo "relay $(( $(date +%s) - t0 )) s"
( for i in $(seq 1 60); do p=$(pgrep -f "router_svc" | head -1); [ -n "$p" ] && break; sleep 0.5; done
  sleep 5; py-spy record --pid $p -d 5 -r 250 --nonblocking -f raw -o $W/relay1.spy > $W/spy.log 2>&1 ) &
timeout 40 python3 bench/bench_relay.py --streams 256 --step-ms 10 --duration 8 --warmup 2 --targets mesh $PIN --router-arg=--engine-wake-delay=0 > $W/relay1.txt 2>&1; echo "relay1 $(( $(date +%s) - t0 )) s"
wait
OUT=$W TAG=now DUR=20 timeout 150 bash bench/ttft_pinned.sh > $W/ttft.log 2>&1; echo "ttft $(( $(date +%s) - t0 )) s"
timeout 60 python3 bench/bench_fairness.py --scenario d --routers 2 --clients 4 --cpu-list 0-15 --seconds 6 --json $W/d2.json 2>&1 | grep -v warning > $W/d2.txt; echo "d2 $(( $(date +%s) - t0 )) s"
tar czf $OUT/all.tgz -C $W .
grep -E "^\| [0-9]" $W/relay.txt $W/relay1.txt; tail -3 $W/spy.log; tail -40 $W/ttft.log; grep -E "capacity alone|^\| (goodput /|rejection|router CPU)" $W/d2.txt
