#!/bin/bash
# Device call 1 of 2026-12-06 (sixth session) on quiet cores; .before/ holds b4add48 (the session's start). SECTIONS:
#   onetoken  one token per message: the router (up's local options, engine wake-up delay 0) against the bare
#             grpc.aio Generate server on the same core, 256 streams, 10 ms sim steps; a probe on core 15; this
#             tree and .before/ interleaved, ROUNDS
#   ttft      chat-multiturn TTFT added by `tokenrelay up --engine sim` (bench/ttft_pinned.sh, --compare), this tree
#             with the routers' --idle-spin-ms 1000 and without, interleaved, ROUNDS
#   local     the relay at 256 streams (fast sim, 1 ms steps, 256-token replies) with up's local options; ROUNDS
#   g4        four simulated H200s (Llama 3.1 8B FP8 calibration), 8 routers on cores 0-7 with the local options,
#             a core per engine, mesh and engines alone at 1,024 and 4,096 streams; G4ROUNDS
set -u
SECTIONS=${SECTIONS:-onetoken local g4}
on() { [[ " $SECTIONS " == *" $1 "* ]]; }
. bench/device_env.sh
el() { echo "$1 $(( $(date +%s) - t0 )) s"; }
row() { grep -E '^  (mesh|bare|engine)' "$1" | sed 's/  */ /g' | cut -c1-330; }
nproc; grep -m1 "model name" /proc/cpuinfo
PIN="--router-cpus 0 --redis-cpus 1 --tokenizer-cpus 2 --engine-cpus 3 --client-cpus 4-14 --clients 11 --probe-cpu 15"
LOCAL="--router-arg=--detokenize=local --router-arg=--tokenize-local-bytes=16384"
on onetoken && for r in $(seq ${ROUNDS:-2}); do for v in new old; do
  D=$ROOT; [ $v = old ] && D=$ROOT/.before
  (cd $D && PYTHONPATH=/tmp/site:$D timeout 80 python3 bench/bench_relay.py --streams 256 --step-ms 10 --duration 6 \
    --warmup 2 --targets mesh bare --router-arg=--engine-wake-delay=0 $LOCAL $PIN --json-out $W/onetoken_${v}_$r.json) \
    > $W/onetoken_${v}_$r.txt 2>&1
  el "onetoken $v $r"; row $W/onetoken_${v}_$r.txt; grep -iE "probe" $W/onetoken_${v}_$r.txt | head -3
done; done
mkdir -p $W/ttft
on ttft && for r in $(seq ${ROUNDS:-2}); do for v in spin plain; do
  A=""; [ $v = spin ] && A="--router-arg=--idle-spin-ms=1000"
  UP_ARGS="$A" OUT=$W/ttft TAG=${v}$r DUR=20 COMPARE=1 TRACED=0 timeout 80 bash bench/ttft_pinned.sh > /dev/null 2>&1
  el "ttft $v $r"; grep -E '^(TTFT p(50|99)|server TTFT p50)' $W/ttft/${v}${r}_compare.txt | sed 's/  */ /g' | tr '\n' ';'; echo
done; done
on local && for r in $(seq ${ROUNDS:-2}); do
  timeout 50 python3 bench/bench_relay.py --streams 256 --duration 6 --warmup 2 --targets mesh $PIN $LOCAL \
    --json-out $W/local_$r.json > $W/local_$r.txt 2>&1
  el "local $r"; row $W/local_$r.txt; grep -iE "probe" $W/local_$r.txt | head -3
done
G4="--calibrated --engines 4 --streams 1024 4096 --duration 8 --warmup 2 --routers 8 --router-cpus 0-7 --redis-cpus 8 \
 --tokenizer-cpus 8 --engine-cpus 9-12 --clients 3 --client-cpus 13-15"
on g4 && for r in $(seq ${G4ROUNDS:-2}); do
  timeout 170 python3 bench/bench_relay.py $G4 $LOCAL --json-out $W/g4_$r.json > $W/g4_$r.txt 2>&1
  el "g4 $r"; row $W/g4_$r.txt; grep -E '^\| (1024|4096)' $W/g4_$r.txt
done
tar czf $OUT/run1-$(echo $SECTIONS | tr ' ' '-').tgz -C $W .
