#!/bin/bash
# Device run of 2026-12-06 (third session): issue 11's scenario d (3x overload, 2 routers; goodput and time
# to refusal, bench/bench_fairness.py) with this session's tree (the full-queue memo, refusals on the real
# count decided in the arrival turn, the routers' own refusal timing) against the tree it started from
# (7fc78de, extracted into the ignored .before/ and carried), interleaved, every process pinned.
#   dl   with the routers' local options (`tokenrelay up`'s defaults), new/old x ROUNDS_L (default 3)
#   d    the router's defaults (tokenizer service in the path), new/old x ROUNDS_D (default 2)
#   rN   this tree with local options and 2 / 4 / 2 / 4 / 3 router processes (the second call)
#   r4   4 router processes with local options, new/old x 3 (the third call)
#   dump 2 / 4 / 2 / 4 routers, this tree, local options, every request dumped (--dump-requests; the fourth call)
#   late 2 and 4 routers, local options, requests dumped, this tree against .before = the tree before the late-grant
#        pass-over (bba7cc8's parent, carried as .before for this call), new/old x 2 (the fifth call)
#   long the same as late, this tree at 76afa48 (the long lease set aside, tombstones that say why) against
#        the same .before (the sixth call)
set -u
SECTIONS=${SECTIONS:-dl d}
on() { [[ " $SECTIONS " == *" $1 "* ]]; }
. bench/device_env.sh
el() { echo "$1 $(( $(date +%s) - t0 )) s"; }
tree() { [ $1 = old ] && echo $ROOT/.before || echo $ROOT; }
LOCAL="--router-arg=--detokenize=local --router-arg=--tokenize-local-bytes=16384"
run_d() {  # tag version extra-args...
  local tag=$1 v=$2; shift 2; local D=$(tree $v)
  (cd $D && PYTHONPATH=/tmp/site:$D timeout 90 python3 bench/bench_fairness.py --scenario d --routers ${NR:-2} --clients 4 \
    --cpu-list 0-15 --seconds 6 --json $W/${tag}.json "$@" 2>&1 | grep -v warning) > $W/${tag}.txt
  el "$tag"; grep -E "capacity alone|^\| RESOURCE|^\| (goodput /|rejection|router CPU|refusals)" $W/${tag}.txt
}
on dl && for r in $(seq ${ROUNDS_L:-3}); do for v in new old; do run_d dl_${v}_$r $v $LOCAL; done; done
k=0; on rN && for n in 2 4 2 4 3; do NR=$n run_d rN_${n}_$((++k)) new $LOCAL; done
on r4 && for r in 1 2 3; do for v in new old; do NR=4 run_d r4_${v}_$r $v $LOCAL; done; done
k=0; on dump && for n in 2 4 2 4; do k=$((k+1)); NR=$n run_d dump_${n}_$k new $LOCAL --dump-requests $W/dump_${n}_$k.jsonl; done
on late && for r in 1 2; do for n in 2 4; do for v in new old; do
  NR=$n run_d late_${n}_${v}_$r $v $LOCAL --dump-requests $W/late_${n}_${v}_$r.jsonl; done; done; done
on long && for r in 1 2; do for n in 2 4; do for v in new old; do
  NR=$n run_d long_${n}_${v}_$r $v $LOCAL --dump-requests $W/long_${n}_${v}_$r.jsonl; done; done; done
on d && for r in $(seq ${ROUNDS_D:-2}); do for v in new old; do run_d d_${v}_$r $v; done; done
tar czf $OUT/run-$(echo $SECTIONS | tr ' ' '-').tgz -C $W .
