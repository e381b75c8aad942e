#!/bin/bash
# (Run from the repo root on the lent 16-core host with .whl/, .r4dev/ and .devcarry/ carried, as device-run-1.sh.)
# Device run 4: chat-multiturn TTFT with the router tokenizing short prompts and detokenizing itself
# (--tokenize-local-bytes 16384 --detokenize local) against the default, interleaved twice; the relay at 256
# streams with both on.
set -u
ROOT=$PWD
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PATH=$ROOT/.r4dev:$PATH LD_LIBRARY_PATH=$ROOT/.r4dev PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$ROOT
W=/tmp/o; mkdir -p $W; t0=$(date +%s)
LOCAL="--router-arg=--detokenize=local --router-arg=--tokenize-local-bytes=16384"
for r in 1 2; do
  OUT=$W TAG=remote$r DUR=20 timeout 140 bash bench/ttft_pinned.sh > $W/ttft_remote$r.log 2>&1; echo "ttft remote$r $(( $(date +%s) - t0 )) s"
  UP_ARGS="$LOCAL" OUT=$W TAG=local$r DUR=20 timeout 140 bash bench/ttft_pinned.sh > $W/ttft_local$r.log 2>&1; echo "ttft local$r $(( $(date +%s) - t0 )) s"
done
PIN="--router-cpus 0 --redis-cpus 1 --tokenizer-cpus 2 --engine-cpus 3 --client-cpus 4-13 --clients 10"
timeout 40 python3 bench/bench_relay.py --streams 256 --duration 6 --warmup 2 --targets mesh $PIN $LOCAL > $W/relay_both.txt 2>&1
echo "relay $(( $(date +%s) - t0 )) s"
tar czf $OUT/all.tgz -C $W .
echo "relay_both: $(grep -E '^  mesh' $W/relay_both.txt | sed 's/  */ /g')"
for t in remote1 local1 remote2 local2; do echo "== $t"; grep -E "^TTFT p(50|99)|^server TTFT p" $W/${t}_compare.txt; grep -E "^(arrive|tokenize|->route|->engine|->router|detok|router TTFT|mesh part)" $W/${t}_breakdown.txt; done
