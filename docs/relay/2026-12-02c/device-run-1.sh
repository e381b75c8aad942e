#!/bin/bash
# (Run from the repo root on the lent 16-core host with .whl/ (service wheels), .r4dev/ (redis-server + libs)
# carried; see docs/benchmarks.md.)
# Device run 1 of 2026-12-02c: what stop 23 changed but never measured on quiet cores (the early ENQUEUE before
# an inline encode, the session's replica asked for at arrival): chat-multiturn TTFT, the default against the
# router tokenizing and detokenizing itself, interleaved twice; the relay at 256 streams and at one token per
# message, both ways; issue 11's scenario d with 2 routers.
set -u
ROOT=$PWD
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PATH=$ROOT/.r4dev:$PATH LD_LIBRARY_PATH=$ROOT/.r4dev PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$ROOT
redis-server --version || exit 1
W=/tmp/o; mkdir -p $W; t0=$(date +%s)
LOCAL="--router-arg=--detokenize=local --router-arg=--tokenize-local-bytes=16384"
for r in 1 2; do
  OUT=$W TAG=remote$r DUR=20 timeout 130 bash bench/ttft_pinned.sh > $W/ttft_remote$r.log 2>&1; echo "ttft remote$r $(( $(date +%s) - t0 )) s"
  UP_ARGS="$LOCAL" OUT=$W TAG=local$r DUR=20 timeout 130 bash bench/ttft_pinned.sh > $W/ttft_local$r.log 2>&1; echo "ttft local$r $(( $(date +%s) - t0 )) s"
done
PIN="--router-cpus 0 --redis-cpus 1 --tokenizer-cpus 2 --engine-cpus 3 --client-cpus 4-13 --clients 10"
timeout 40 python3 bench/bench_relay.py --streams 256 --duration 6 --warmup 2 --targets mesh $PIN > $W/relay_remote.txt 2>&1
timeout 40 python3 bench/bench_relay.py --streams 256 --duration 6 --warmup 2 --targets mesh $PIN $LOCAL > $W/relay_local.txt 2>&1
timeout 40 python3 bench/bench_relay.py --streams 256 --step-ms 10 --duration 6 --warmup 2 --targets mesh $PIN --router-arg=--engine-wake-delay=0 > $W/relay1_remote.txt 2>&1
timeout 40 python3 bench/bench_relay.py --streams 256 --step-ms 10 --duration 6 --warmup 2 --targets mesh $PIN --router-arg=--engine-wake-delay=0 $LOCAL > $W/relay1_local.txt 2>&1
echo "relay $(( $(date +%s) - t0 )) s"
timeout 60 python3 bench/bench_fairness.py --scenario d --routers 2 --clients 4 --cpu-list 0-15 --seconds 6 --json $W/d2.json 2>&1 | grep -v warning > $W/d2.txt; echo "d2 $(( $(date +%s) - t0 )) s"
tar czf $OUT/all.tgz -C $W .
for f in $W/relay_*.txt $W/relay1_*.txt; do echo "$(basename $f): $(grep -E '^  mesh' $f | sed 's/  */ /g')"; done
for t in remote1 local1 remote2 local2; do echo "== $t"; grep -E "^TTFT p(50|99)|^server TTFT" $W/${t}_compare.txt; grep -E "^(arrive|tokenize|->|detok|router TTFT|mesh part)" $W/${t}_breakdown.txt; done
grep -E "capacity alone|^\| (goodput /|rejection|router CPU)" $W/d2.txt
