#!/bin/bash
# Device calls of 2026-12-07 (twelfth session) on quiet cores, baselines in the same call.
# SECTIONS:
#   fr    chat-multiturn TTFT added by the mesh (as in env below), the routers' stream to the engine over gRPC
#         (G: --no-engine-frames) against the engine's frame port (F: this tree's default), interleaved, FROUNDS pairs
#   hop   the client hop to a bare grpc.aio server (docs/relay/2026-12-07c/cpu/hopenv.sh; server on CPU 0, client
#         on CPU 8), gRPC's defaults (X=1) against $EXP in both processes, interleaved, HROUNDS rounds
#   env   chat-multiturn TTFT added by the mesh (bench/ttft_pinned.sh: `tokenrelay up --engine sim` on cores 0-5,
#         the client on 8-11, the engine alone in the same run, routers with --idle-spin-ms 1000, the engine hop
#         marked), the mesh's processes with gRPC's defaults (D) against $EXP (E; the bench client as it is),
#         interleaved, EROUNDS pairs, DUR seconds a run
#   pin   PROUNDS pairs: the mesh's processes left to float over cores 0-5 (U) against each pinned to a core of
#         its own (P: docs/relay/2026-12-07b/pin_services.py), interleaved
# Outputs: $OUT/all.tgz.   e.g. SECTIONS="fr hop" FROUNDS=3, SECTIONS="hop env pin" EROUNDS=2 PROUNDS=1 DUR=20 bash docs/relay/2026-12-07c/device-run-1.sh
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
on hop && { SRV_PIN="taskset -c 0" CLI_PIN="taskset -c 8" PY=python3 OUT=/tmp/hop N=220 ROUNDS=${HROUNDS:-2} \
  bash docs/relay/2026-12-07c/cpu/hopenv.sh "X=1" "$EXP" 2>&1 | tee $W/hop.txt; el hop; }
on env && for r in $(seq ${EROUNDS:-2}); do one D$r; UP_ENV="$EXP" one E$r; done
on pin && for r in $(seq ${PROUNDS:-1}); do
  one U$r
  AFTER_UP="python3 docs/relay/2026-12-07b/pin_services.py" one P$r; cp /tmp/m1/after_up.log $W/ttft/P${r}_pin.txt
done
cd $W && tar czf $OUT/all.tgz . && cd - > /dev/null && rm -rf $W   # one file back (the call returns at most a few)
