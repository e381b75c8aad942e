#!/bin/bash
# Device calls of 2026-12-07 (thirteenth session) on quiet cores, baselines in the same call.
# SECTIONS:
#   st    chat-multiturn TTFT added by the mesh (bench/ttft_pinned.sh: `tokenrelay up --engine sim` on cores 0-5,
#         the client on 8-11, the engine alone in the same run, routers with --idle-spin-ms 1000, the engine hop
#         marked): the chats as one Generate call each (C) against the same requests on one open Stream call
#         (S: `tokenrelay bench --mesh-calls stream`), interleaved, SROUNDS pairs, DUR seconds a run
#   rel   the relay at 256 streams (bench/bench_relay.py: fast sim, 1 ms steps, up's local options and frame port,
#         every process pinned as in docs/relay/2026-12-06i/device-run-1.sh): Generate calls (C) against the
#         Stream API (S: --mesh-calls stream), interleaved, RROUNDS pairs
#   one   one token per client message (docs/relay/2026-12-06i's onetoken: 10 ms steps, engine wake-up delay 0,
#         the bare grpc.aio server on the router's core in the same run), OROUNDS runs
#   oneab the same, the engine's stream over its frame port (F) against gRPC (G), interleaved, OROUNDS pairs
#   g4    four simulated H200s, 8 routers (docs/relay/2026-12-06i's g4), G4ROUNDS runs; G4X: more bench_relay options
#   over  3x overload through 4 routers (docs/relay/2026-12-06i's over), VROUNDS runs
# Outputs: $OUT/all.tgz.   e.g. SECTIONS="st rel" SROUNDS=2 RROUNDS=1 DUR=30 bash docs/relay/2026-12-07d/device-run-1.sh
set -u
SECTIONS=${SECTIONS:-st}
on() { [[ " $SECTIONS " == *" $1 "* ]]; }
. bench/device_env.sh
W=$OUT/o
mkdir -p $W/ttft
el() { echo "$1 $(( $(date +%s) - t0 )) s"; }
nproc; grep -m1 "model name" /proc/cpuinfo; python3 -V
res() { grep -E '^(TTFT p(50|99)|server TTFT p50)' $W/ttft/$1_compare.txt | sed 's/  */ /g' | tr '\n' ';'; echo; }
row() { grep -E '^\| [0-9]' "$1" | sed 's/  */ /g'; grep -iE "probe" "$1" | head -2; }
EH=docs/relay/2026-12-07b/cpu/enginehop
one() {  # $1 tag (BENCH_ARGS passes through to bench/ttft_pinned.sh); the engine hop marked
  rm -f /tmp/eh.*; cp $EH/sitecustomize.py /tmp/site/
  TR_EH=/tmp/eh UP_ARGS="--router-arg=--idle-spin-ms=1000" OUT=$W/ttft TAG=$1 DUR=${DUR:-30} COMPARE=1 \
    TRACED=0 timeout 200 bash bench/ttft_pinned.sh > /dev/null 2>&1
  rm -f /tmp/site/sitecustomize.py; cat /tmp/eh.* > $W/ttft/$1_eh.txt
  el "$1"; res $1; python3 $EH/summ.py $W/ttft/$1_eh.txt | tr -s ' ' | tr '\n' ';'; echo
}
on st && for r in $(seq ${SROUNDS:-2}); do one C$r; BENCH_ARGS="--mesh-calls stream" one S$r; done
PIN="--router-cpus 0 --redis-cpus 1 --tokenizer-cpus 2 --engine-cpus 3 --client-cpus 4-14 --clients 11 --probe-cpu 15"
LOCAL="--router-arg=--detokenize=local --router-arg=--tokenize-local-bytes=16384 --engine-arg=--frame-port=0"
calls() { [ $1 = S ] && echo stream || echo call; }
on rel && for r in $(seq ${RROUNDS:-1}); do for v in C S; do
  timeout 70 python3 bench/bench_relay.py --streams 256 --duration 6 --warmup 2 --targets mesh $PIN $LOCAL \
    --mesh-calls $(calls $v) --json-out $W/rel_$v$r.json > $W/rel_$v$r.txt 2>&1
  el "rel $v$r"; row $W/rel_$v$r.txt
done; done
# (oneab: the same, the engine's stream over its frame port (F) and over gRPC (G, as in the sixth and ninth sessions),
#  interleaved, OROUNDS pairs)
on one && for r in $(seq ${OROUNDS:-1}); do
  timeout 80 python3 bench/bench_relay.py --streams 256 --step-ms 10 --duration 6 --warmup 2 --targets mesh bare \
    --router-arg=--engine-wake-delay=0 $LOCAL $PIN --json-out $W/one_$r.json > $W/one_$r.txt 2>&1
  el "one $r"; row $W/one_$r.txt
done
on oneab && for r in $(seq ${OROUNDS:-1}); do for v in F G; do
  L=$LOCAL; [ $v = G ] && L=${LOCAL% --engine-arg=--frame-port=0}
  timeout 80 python3 bench/bench_relay.py --streams 256 --step-ms 10 --duration 6 --warmup 2 --targets mesh bare \
    --router-arg=--engine-wake-delay=0 $L $PIN --json-out $W/one_$v$r.json > $W/one_$v$r.txt 2>&1
  el "one $v$r"; row $W/one_$v$r.txt
done; done
G4="--calibrated --engines 4 --streams 1024 4096 --duration 8 --warmup 2 --routers 8 --router-cpus 0-7 --redis-cpus 8 \
 --tokenizer-cpus 8 --engine-cpus 9-12 --clients 3 --client-cpus 13-15"
on g4 && for r in $(seq ${G4ROUNDS:-1}); do
  timeout 170 python3 bench/bench_relay.py $G4 $LOCAL ${G4X:-} --json-out $W/g4_$r.json > $W/g4_$r.txt 2>&1
  el "g4 $r"; row $W/g4_$r.txt
done
on over && for r in $(seq ${VROUNDS:-1}); do
  timeout 90 python3 bench/bench_fairness.py --scenario d --routers 4 --clients 4 --cpu-list 0-15 --seconds 6 \
    --json $W/over_$r.json $LOCAL 2>&1 | grep -v warning > $W/over_$r.txt
  el "over $r"; grep -E "capacity alone|^\| RESOURCE|^\| (goodput /|rejection|router CPU|refusals)" $W/over_$r.txt
done
cd $W && tar czf $OUT/all.tgz . && cd - > /dev/null && rm -rf $W   # one file back (the call returns at most a few)
