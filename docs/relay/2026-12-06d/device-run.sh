#!/bin/bash
# Device run of 2026-12-06 (fourth session): the per-request floors of the first-token path on quiet cores.
#   hops  bench/bench_hops.py: every hop one call at a time beside a bare echo, the engine-stream hop
#         (bare bidi echo, engine_svc on a raw stub, the router's replica client) among them; servers on
#         cores 1-4 (one each), the caller on core 0; twice, interleaved
#   lua   bench/bench_lua_cost.py: the admission scripts' Redis time beside a trivial script (redis on core 5)
#   seq   bench/bench_relay.py --streams 1 --max-tokens 1: back-to-back one-token requests through one router
#         (core 0) against the bare grpc.aio Generate server on the same core: router CPU per request and
#         TTFT at idle; with the router's defaults and with `tokenrelay up`'s local options; ROUNDS (2)
set -u
SECTIONS=${SECTIONS:-hops lua seq}
on() { [[ " $SECTIONS " == *" $1 "* ]]; }
. bench/device_env.sh
el() { echo "$1 $(( $(date +%s) - t0 )) s"; }
nproc; grep -m1 "model name" /proc/cpuinfo
on hops && { python3 bench/bench_hops.py --calls 400 --repeats 2 --server-cpus 1-4 --client-cpu 0 --json $W/hops.json > $W/hops.txt 2>&1; el hops; cat $W/hops.txt; }
on lua && for r in 1 2; do python3 bench/bench_lua_cost.py --calls 3000 --cpu 5 --json $W/lua_$r.json > $W/lua_$r.txt 2>&1; el lua; cat $W/lua_$r.txt; done
P="--router-cpus 0 --redis-cpus 1 --tokenizer-cpus 2 --engine-cpus 3 --client-cpus 4 --clients 1"
LOCAL="--router-arg=--detokenize=local --router-arg=--tokenize-local-bytes=16384"
on seq && for r in $(seq ${ROUNDS:-2}); do
  for mode in local default; do
    extra=""; [ $mode = local ] && extra=$LOCAL
    timeout 120 python3 bench/bench_relay.py --streams 1 --max-tokens 1 --duration 6 --warmup 2 --targets mesh bare $P $extra \
      --json-out $W/seq_${mode}_$r.json > $W/seq_${mode}_$r.txt 2>&1
    el seq_${mode}_$r; grep -E "^\| 1 \|" $W/seq_${mode}_$r.txt
  done
done
tar czf $OUT/run-$(echo $SECTIONS | tr ' ' '-').tgz -C $W .
