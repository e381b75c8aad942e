#!/bin/bash
# Device calls of 2026-12-06 (ninth session) on quiet cores: issue 10's shows once more on the final tree,
# every process pinned, the baselines in the same call. No A/B: this tree alone.
# SECTIONS:
#   onetoken  one token per client message: the router (up's local options, engine wake-up delay 0) against the
#             bare grpc.aio Generate server on the same core, 256 streams, 10 ms sim steps, a probe on core 15; ROUNDS
#   local     the relay at 256 streams (fast sim: 1 ms steps, 256-token replies) with up's local options; ROUNDS
#   g4        four simulated H200s (Llama 3.1 8B FP8 calibration), 8 routers on cores 0-7 with the local options,
#             a core per engine, mesh and engines alone at 1,024 and 4,096 streams; G4ROUNDS
#   over      issue 11's scenario d (3x overload; bench/bench_fairness.py) through 4 routers with the local options;
#             OROUNDS
#   ttft      chat-multiturn TTFT added by `tokenrelay up --engine sim` (bench/ttft_pinned.sh, --compare), the routers
#             with --idle-spin-ms 1000, DUR seconds a run (40), ROUNDS
#   sbg       the same, --submit-before-grant on (the default, 4) and off (0), interleaved, ROUNDS (ran at 7d83550;
#             the option was removed after that measurement, docs/benchmarks.md)
set -u
SECTIONS=${SECTIONS:-onetoken local g4 over}
on() { [[ " $SECTIONS " == *" $1 "* ]]; }
. bench/device_env.sh
el() { echo "$1 $(( $(date +%s) - t0 )) s"; }
row() { grep -E '^  (mesh|bare|engine)' "$1" | sed 's/  */ /g' | cut -c1-330; }
nproc; grep -m1 "model name" /proc/cpuinfo; python3 -V
PIN="--router-cpus 0 --redis-cpus 1 --tokenizer-cpus 2 --engine-cpus 3 --client-cpus 4-14 --clients 11 --probe-cpu 15"
LOCAL="--router-arg=--detokenize=local --router-arg=--tokenize-local-bytes=16384"
on onetoken && for r in $(seq ${ROUNDS:-2}); do
  timeout 80 python3 bench/bench_relay.py --streams 256 --step-ms 10 --duration 6 --warmup 2 --targets mesh bare \
    --router-arg=--engine-wake-delay=0 $LOCAL $PIN --json-out $W/onetoken_$r.json > $W/onetoken_$r.txt 2>&1
  el "onetoken $r"; row $W/onetoken_$r.txt; grep -iE "probe" $W/onetoken_$r.txt | head -3
done
on local && for r in $(seq ${ROUNDS:-2}); do
  timeout 60 python3 bench/bench_relay.py --streams 256 --duration 6 --warmup 2 --targets mesh $PIN $LOCAL \
    --json-out $W/local_$r.json > $W/local_$r.txt 2>&1
  el "local $r"; row $W/local_$r.txt; grep -iE "probe" $W/local_$r.txt | head -3
done
G4="--calibrated --engines 4 --streams 1024 4096 --duration 8 --warmup 2 --routers 8 --router-cpus 0-7 --redis-cpus 8 \
 --tokenizer-cpus 8 --engine-cpus 9-12 --clients 3 --client-cpus 13-15"
on g4 && for r in $(seq ${G4ROUNDS:-1}); do
  timeout 170 python3 bench/bench_relay.py $G4 $LOCAL --json-out $W/g4_$r.json > $W/g4_$r.txt 2>&1
  el "g4 $r"; row $W/g4_$r.txt; grep -E '^\| (1024|4096)' $W/g4_$r.txt
done
on over && for r in $(seq ${OROUNDS:-2}); do
  timeout 90 python3 bench/bench_fairness.py --scenario d --routers 4 --clients 4 --cpu-list 0-15 --seconds 6 \
    --json $W/over_$r.json $LOCAL 2>&1 | grep -v warning > $W/over_$r.txt
  el "over $r"; grep -E "capacity alone|^\| RESOURCE|^\| (goodput /|rejection|router CPU|refusals)" $W/over_$r.txt
done
mkdir -p $W/ttft
on ttft && for r in $(seq ${ROUNDS:-3}); do
  UP_ARGS="--router-arg=--idle-spin-ms=1000" OUT=$W/ttft TAG=spin$r DUR=${DUR:-40} COMPARE=1 TRACED=0 timeout 150 \
    bash bench/ttft_pinned.sh > /dev/null 2>&1
  el "ttft $r"; grep -E '^(TTFT p(50|99)|server TTFT p50)' $W/ttft/spin${r}_compare.txt | sed 's/  */ /g' | tr '\n' ';'; echo
done
# (sbg: the first token's path marked step by step, docs/relay/2026-12-06f/cpu/timeline/, in both arms; medians
#  by docs/relay/2026-12-06i/cpu/marks.py)
on sbg && for r in $(seq ${ROUNDS:-2}); do for v in on off; do
  A="--router-arg=--idle-spin-ms=1000"; [ $v = off ] && A="$A --router-arg=--submit-before-grant=0"
  mkdir -p /tmp/site; cp docs/relay/2026-12-06f/cpu/timeline/sitecustomize.py /tmp/site/; rm -f /tmp/tlm.*
  TR_TL=/tmp/tlm UP_ARGS="$A" OUT=$W/ttft TAG=sbg$v$r DUR=${DUR:-40} COMPARE=1 TRACED=0 timeout 150 \
    bash bench/ttft_pinned.sh > /dev/null 2>&1
  rm -f /tmp/site/sitecustomize.py; cat /tmp/tlm.* > $W/ttft/sbg$v${r}_marks.txt
  el "sbg $v $r"; grep -E '^(TTFT p(50|99)|server TTFT p50)' $W/ttft/sbg$v${r}_compare.txt | sed 's/  */ /g' | tr '\n' ';'; echo
  python3 docs/relay/2026-12-06i/cpu/marks.py $W/ttft/sbg$v${r}_marks.txt | sed 's|.*: ||'
done; done
tar czf $OUT/run-$(echo $SECTIONS | tr ' ' '-').tgz -C $W .
