#!/bin/bash
# Device run of 2026-12-06 (second session): this session's tree against the one it started from (42ecef0, extracted
# into the ignored .before/ and carried), interleaved, on quiet cores. SECTIONS picks parts (default: ttft relay):
#   ttft   chat-multiturn TTFT added by `tokenrelay up --engine sim` (bench/ttft_pinned.sh, --compare), new/old x ROUNDS
#   relay  the relay at 256 streams, fast sim, router pinned to one core (bench/bench_relay.py), new/old x ROUNDS
#   d      scenario d (3x overload, 2 routers: goodput and time to refusal; bench/bench_fairness.py), new/old
#   trace  one traced chat-multiturn run of the new tree (bench/ttft_breakdown.py)
#   local  the relay as in `relay`, with the routers' local options (`tokenrelay up`'s defaults), new/old x ROUNDS
#   h200   3 routers (3 cores) against one simulated H200 at 256 and 1,024 streams, new/old
set -u
SECTIONS=${SECTIONS:-ttft relay}
on() { [[ " $SECTIONS " == *" $1 "* ]]; }
. bench/device_env.sh
PIN="--router-cpus 0 --redis-cpus 1 --tokenizer-cpus 2 --engine-cpus 3 --client-cpus 4-14 --clients 11"
el() { echo "$1 $(( $(date +%s) - t0 )) s"; }
row() { grep -E '^  (mesh|bare|engine)' "$1" | sed 's/  */ /g' | cut -c1-330; }
tree() { [ $1 = old ] && echo $ROOT/.before || echo $ROOT; }
mkdir -p $W/ttft
on ttft && for r in $(seq ${ROUNDS:-2}); do for v in new old; do
  TREE=$(tree $v) OUT=$W/ttft TAG=${v}$r DUR=20 COMPARE=1 TRACED=0 timeout 80 bash bench/ttft_pinned.sh > /dev/null 2>&1
  el "ttft $v $r"; grep -E '^(TTFT p(50|99)|cached share)' $W/ttft/${v}${r}_compare.txt | sed 's/  */ /g' | tr '\n' ';'; echo
done; done
on relay && for r in $(seq ${ROUNDS:-2}); do for v in new old; do
  D=$(tree $v)
  (cd $D && PYTHONPATH=/tmp/site:$D timeout 45 python3 bench/bench_relay.py --streams 256 --duration 6 --warmup 2 \
    --targets mesh $PIN) > $W/relay_${v}_$r.txt 2>&1
  el "relay $v $r"; row $W/relay_${v}_$r.txt
done; done
LOCAL="--router-arg=--detokenize=local --router-arg=--tokenize-local-bytes=16384"
on local && for r in $(seq ${ROUNDS:-2}); do for v in new old; do
  D=$(tree $v)
  (cd $D && PYTHONPATH=/tmp/site:$D timeout 45 python3 bench/bench_relay.py --streams 256 --duration 6 --warmup 2 \
    --targets mesh $PIN $LOCAL) > $W/local_${v}_$r.txt 2>&1
  el "local $v $r"; row $W/local_${v}_$r.txt
done; done
on h200 && for v in new old; do
  D=$(tree $v)
  (cd $D && PYTHONPATH=/tmp/site:$D timeout 110 python3 bench/bench_relay.py --calibrated --duration 6 --warmup 2 \
    --streams 256 1024 --routers 3 --router-cpus 0-2 --redis-cpus 3 --tokenizer-cpus 4 --engine-cpus 5 --clients 10 \
    --client-cpus 6-15) > $W/h200x3_$v.txt 2>&1
  el "h200x3 $v"; grep -E '^\| (256|1024)' $W/h200x3_$v.txt
done
on d && for v in new old; do
  D=$(tree $v)
  (cd $D && PYTHONPATH=/tmp/site:$D timeout 90 python3 bench/bench_fairness.py --scenario d --routers 2 --clients 4 \
    --cpu-list 0-15 --seconds 6 --json $W/d_$v.json 2>&1 | grep -v warning) > $W/d_$v.txt
  el "scenario d $v"; grep -E "capacity alone|^\| RESOURCE|^\| (goodput /|rejection|router CPU|refusals decided)" $W/d_$v.txt
done
on trace && { OUT=$W/ttft TAG=newtraced DUR=20 COMPARE=0 TRACED=1 timeout 70 bash bench/ttft_pinned.sh > /dev/null 2>&1
  el "traced"; cat $W/ttft/newtraced_breakdown.txt; }
tar czf $OUT/run-$(echo $SECTIONS | tr ' ' '-').tgz -C $W .
