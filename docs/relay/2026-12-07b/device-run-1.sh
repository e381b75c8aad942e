#!/bin/bash
# Device calls of 2026-12-07 (eleventh session) on quiet cores, every process pinned, baselines in the same call.
# SECTIONS:
#   ab        chat-multiturn TTFT added by the mesh (bench/ttft_pinned.sh: `tokenrelay up --engine sim` on cores 0-5,
#             the client on 8-11, the engine alone in the same run, routers with --idle-spin-ms 1000), the tree before
#             this session (e840139, extracted into .treeA/ and carried) against this tree, interleaved, ROUNDS pairs,
#             DUR seconds a run (30); the engine hop marked on both ends (docs/relay/2026-12-07b/cpu/enginehop/)
#   chat      CROUNDS pairs of this tree: the bench's chats as Generate calls (G, the documented client) and through
#             the Chat API (C: one open call per conversation), interleaved
#   pin       PROUNDS pairs of this tree: the mesh's processes left to float over cores 0-5 (U) against each pinned
#             to a core of its own (P: docs/relay/2026-12-07b/pin_services.py, router 0, engine 1, Redis 2,
#             tokenizer 3), interleaved
# Outputs in $OUT/o/.   e.g. SECTIONS="ab" ROUNDS=3 DUR=30 bash docs/relay/2026-12-07b/device-run-1.sh
# (issue 10's other shows on this tree: SECTIONS="onetoken g4" bash docs/relay/2026-12-06i/device-run-1.sh)
set -u
SECTIONS=${SECTIONS:-ab}
on() { [[ " $SECTIONS " == *" $1 "* ]]; }
. bench/device_env.sh
W=$OUT/o   # written where the call's outputs come back from, so that a run cut off keeps what it made
mkdir -p $W/ttft
el() { echo "$1 $(( $(date +%s) - t0 )) s"; }
nproc; grep -m1 "model name" /proc/cpuinfo; python3 -V
res() { grep -E '^(TTFT p(50|99)|server TTFT p50)' $W/ttft/$1_compare.txt | sed 's/  */ /g' | tr '\n' ';'; echo; }
EH=docs/relay/2026-12-07b/cpu/enginehop
one() {  # $1 tag, $2 tree (BENCH_ARGS passes through to bench/ttft_pinned.sh); the engine hop marked
  rm -f /tmp/eh.*; cp $EH/sitecustomize.py /tmp/site/
  TR_EH=/tmp/eh UP_ARGS="--router-arg=--idle-spin-ms=1000" OUT=$W/ttft TAG=$1 TREE=$2 DUR=${DUR:-30} COMPARE=1 \
    TRACED=0 timeout 150 bash bench/ttft_pinned.sh > /dev/null 2>&1
  rm -f /tmp/site/sitecustomize.py; cat /tmp/eh.* > $W/ttft/$1_eh.txt
  el "$1"; res $1; python3 $EH/summ.py $W/ttft/$1_eh.txt | tr -s ' ' | tr '\n' ';'; echo
}
on ab && for r in $(seq ${ROUNDS:-3}); do one A$r .treeA; one B$r .; done
on chat && for r in $(seq ${CROUNDS:-2}); do one G$r .; BENCH_ARGS="--chat-api chat" one C$r .; done
on pin && for r in $(seq ${PROUNDS:-2}); do
  one U$r .
  AFTER_UP="python3 docs/relay/2026-12-07b/pin_services.py" one P$r .; cp /tmp/m1/after_up.log $W/ttft/P${r}_pin.txt
done
cd $W && tar czf $OUT/all.tgz . && cd - > /dev/null && rm -rf $W   # one file back (the call returns at most a few)
