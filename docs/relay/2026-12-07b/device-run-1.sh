#!/bin/bash
# Device calls of 2026-12-07 (eleventh session) on quiet cores, every process pinned, baselines in the same call.
# SECTIONS:
#   ab        chat-multiturn TTFT added by the mesh (bench/ttft_pinned.sh: `tokenrelay up --engine sim` on cores 0-5,
#             the client on 8-11, the engine alone in the same run, routers with --idle-spin-ms 1000), the tree before
#             this session (e840139, extracted into .treeA/ and carried) against this tree, interleaved, ROUNDS pairs,
#             DUR seconds a run (30); the engine hop marked on both ends (docs/relay/2026-12-07b/cpu/enginehop/)
#   chat      ROUNDS pairs of this tree: the bench's chats as Generate calls (G, the documented client) and through
#             the Chat API (C: one open call per conversation), interleaved
#   onetoken  one token per client message, 256 streams (as docs/relay/2026-12-06i/device-run-1.sh); ROUNDS
#   g4        four simulated H200s, 8 routers, 1,024 and 4,096 streams (as there); G4ROUNDS
# Outputs in $OUT/o/.   e.g. SECTIONS="ab" ROUNDS=3 DUR=30 bash docs/relay/2026-12-07b/device-run-1.sh
set -u
SECTIONS=${SECTIONS:-ab}
on() { [[ " $SECTIONS " == *" $1 "* ]]; }
. bench/device_env.sh
W=$OUT/o   # written where the call's outputs come back from, so that a run cut off keeps what it made
mkdir -p $W/ttft
el() { echo "$1 $(( $(date +%s) - t0 )) s"; }
row() { grep -E '^  (mesh|bare|engine)' "$1" | sed 's/  */ /g' | cut -c1-330; }
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
on chat && for r in $(seq ${ROUNDS:-2}); do one G$r .; BENCH_ARGS="--chat-api chat" one C$r .; done
PIN="--router-cpus 0 --redis-cpus 1 --tokenizer-cpus 2 --engine-cpus 3 --client-cpus 4-14 --clients 11 --probe-cpu 15"
LOCAL="--router-arg=--detokenize=local --router-arg=--tokenize-local-bytes=16384"
on onetoken && for r in $(seq ${ROUNDS:-2}); do
  timeout 80 python3 bench/bench_relay.py --streams 256 --step-ms 10 --duration 6 --warmup 2 --targets mesh bare \
    --router-arg=--engine-wake-delay=0 $LOCAL $PIN --json-out $W/onetoken_$r.json > $W/onetoken_$r.txt 2>&1
  el "onetoken $r"; row $W/onetoken_$r.txt; grep -iE "probe" $W/onetoken_$r.txt | head -3
done
G4="--calibrated --engines 4 --streams 1024 4096 --duration 8 --warmup 2 --routers 8 --router-cpus 0-7 --redis-cpus 8 \
 --tokenizer-cpus 8 --engine-cpus 9-12 --clients 3 --client-cpus 13-15"
on g4 && for r in $(seq ${G4ROUNDS:-1}); do
  timeout 170 python3 bench/bench_relay.py $G4 $LOCAL --json-out $W/g4_$r.json > $W/g4_$r.txt 2>&1
  el "g4 $r"; row $W/g4_$r.txt; grep -E '^\| (1024|4096)' $W/g4_$r.txt
done
