#!/bin/bash
# Device calls of 2026-12-07 (twelfth session) on quiet cores, baselines in the same call.
# SECTIONS:
#   fr    chat-multiturn TTFT added by the mesh (as in env below), the routers' stream to the engine over gRPC
#         (G: --no-engine-frames) against the engine's frame port (F: this tree's default), interleaved, FROUNDS pairs
#   rel   the relay at 256 streams (bench/bench_relay.py: fast sim, 1 ms steps, up's local options, every process
#         pinned as in docs/relay/2026-12-06i/device-run-1.sh): the engine's stream over gRPC (G) against its frame
#         port (F: --engine-arg=--frame-port=0), interleaved, RROUNDS pairs
#   one   one token per client message (as 2026-12-06i's onetoken: 10 ms steps, wake delay 0, the bare grpc.aio
#         server on the router's core in the same run), G against F, OROUNDS pairs
#   hop   the client hop to a bare grpc.aio server (docs/relay/2026-12-07c/cpu/hopenv.sh; server on CPU 0, client
#         on CPU 8), gRPC's defaults (X=1) against $EXP in both processes, interleaved, HROUNDS rounds
#   env   chat-multiturn TTFT added by the mesh (bench/ttft_pinned.sh: `tokenrelay up --engine sim` on cores 0-5,
#         the client on 8-11, the engine alone in the same run, routers with --idle-spin-ms 1000, the engine hop
#         marked), the mesh's processes with gRPC's defaults (D) against $EXP (E; the bench client as it is),
#         interleaved, EROUNDS pairs, DUR seconds a run
#   pin   PROUNDS pairs: the mesh's processes left to float over cores 0-5 (U) against each pinned to a core of
#         its own (P: docs/relay/2026-12-07b/pin_services.py), interleaved
# Outputs: $OUT/all.tgz.   e.g. SECTIONS="fr rel one" FROUNDS=2 RROUNDS=2, SECTIONS="hop env pin" EROUNDS=2 PROUNDS=1 DUR=20 bash docs/relay/2026-12-07c/device-run-1.sh
set -u
SECTIONS=${SECTIONS:-env}
EXP=${EXP:-GRPC_EXPERIMENTS=-event_engine_client,-event_engine_listener}
on() { [[ " $SECTIONS " == *" $1 "* ]]; }
. bench/device_env.sh
W=$OUT/o
mkdir -p $W/ttft
el() { echo "$1 $(( $(date +%s) - t0 )) s"; }
nproc; grep -m1 "model name" /proc/cpuinfo; python3 -V
res() { grep -E '^(TTFT p(50|99)|server TTFT p50)' $W/ttft/$1_compare.txt | sed 's/  */ /g' | tr '\n' ';'; echo; }
EH=docs/relay/2026-12-07b/cpu/enginehop
one() {  # $1 tag (UP_ENV, AFTER_UP pass through to bench/ttft_pinned.sh; XUP: more `up` options); the engine hop marked
  rm -f /tmp/eh.*; cp $EH/sitecustomize.py /tmp/site/
  TR_EH=/tmp/eh UP_ARGS="--router-arg=--idle-spin-ms=1000 ${XUP:-}" OUT=$W/ttft TAG=$1 DUR=${DUR:-20} COMPARE=1 \
    TRACED=0 timeout 150 bash bench/ttft_pinned.sh > /dev/null 2>&1
  rm -f /tmp/site/sitecustomize.py; cat /tmp/eh.* > $W/ttft/$1_eh.txt
  el "$1"; res $1; python3 $EH/summ.py $W/ttft/$1_eh.txt | tr -s ' ' | tr '\n' ';'; echo
}
on fr && for r in $(seq ${FROUNDS:-2}); do XUP="--router-arg=--no-engine-frames" one G$r; one F$r; done
PIN="--router-cpus 0 --redis-cpus 1 --tokenizer-cpus 2 --engine-cpus 3 --client-cpus 4-14 --clients 11 --probe-cpu 15"
LOCAL="--router-arg=--detokenize=local --router-arg=--tokenize-local-bytes=16384"
fx() { [ $1 = F ] && echo "--engine-arg=--frame-port=0"; }
on rel && for r in $(seq ${RROUNDS:-2}); do for v in G F; do
  timeout 70 python3 bench/bench_relay.py --streams 256 --duration 6 --warmup 2 --targets mesh $PIN $LOCAL $(fx $v) \
    --json-out $W/rel_$v$r.json > $W/rel_$v$r.txt 2>&1
  el "rel $v$r"; grep -E '^\| 256' $W/rel_$v$r.txt; grep -iE "probe" $W/rel_$v$r.txt | head -2
done; done
on one && for r in $(seq ${OROUNDS:-1}); do for v in G F; do
  timeout 80 python3 bench/bench_relay.py --streams 256 --step-ms 10 --duration 6 --warmup 2 --targets mesh bare \
    --router-arg=--engine-wake-delay=0 $LOCAL $PIN $(fx $v) --json-out $W/one_$v$r.json > $W/one_$v$r.txt 2>&1
  el "one $v$r"; grep -E '^\| 256' $W/one_$v$r.txt; grep -iE "probe" $W/one_$v$r.txt | head -2
done; done
on hop && { SRV_PIN="taskset -c 0" CLI_PIN="taskset -c 8" PY=python3 OUT=/tmp/hop N=220 ROUNDS=${HROUNDS:-2} \
  bash docs/relay/2026-12-07c/cpu/hopenv.sh "X=1" "$EXP" 2>&1 | tee $W/hop.txt; el hop; }
on env && for r in $(seq ${EROUNDS:-2}); do one D$r; UP_ENV="$EXP" one E$r; done
on pin && for r in $(seq ${PROUNDS:-1}); do
  one U$r
  AFTER_UP="python3 docs/relay/2026-12-07b/pin_services.py" one P$r; cp /tmp/m1/after_up.log $W/ttft/P${r}_pin.txt
done
cd $W && tar czf $OUT/all.tgz . && cd - > /dev/null && rm -rf $W   # one file back (the call returns at most a few)
