#!/bin/bash
# Device calls of 2026-12-06 (seventh session) on quiet cores; .before/ holds 144fb51 (the session's start).
# SECTIONS:
#   ttft  chat-multiturn TTFT added by `tokenrelay up --engine sim` (bench/ttft_pinned.sh, --compare), ROUNDS of
#         three interleaved runs: this tree with the routers' --idle-spin-ms 1000 (newspin), .before/ with the same
#         (oldspin), this tree without it (newplain)
#   tl    the first token's path step by step (docs/relay/2026-12-06f/cpu/timeline/, measurement only), this tree
#         with --idle-spin-ms 1000, one chat-multiturn run
set -u
SECTIONS=${SECTIONS:-ttft tl}
on() { [[ " $SECTIONS " == *" $1 "* ]]; }
. bench/device_env.sh
el() { echo "$1 $(( $(date +%s) - t0 )) s"; }
nproc; grep -m1 "model name" /proc/cpuinfo; python3 -V
SPIN="--router-arg=--idle-spin-ms=1000"
mkdir -p $W/ttft
on ttft && for r in $(seq ${ROUNDS:-3}); do for v in newspin oldspin newplain; do
  A=""; [ $v != newplain ] && A="$SPIN"
  T=.; [ $v = oldspin ] && T=.before
  UP_ARGS="$A" TREE=$T OUT=$W/ttft TAG=${v}$r DUR=20 COMPARE=1 TRACED=0 timeout 80 bash bench/ttft_pinned.sh > /dev/null 2>&1
  el "ttft $v $r"; grep -E '^(TTFT p(50|99)|server TTFT p50)' $W/ttft/${v}${r}_compare.txt | sed 's/  */ /g' | tr '\n' ';'; echo
done; done
if on tl; then
  cp docs/relay/2026-12-06f/cpu/timeline/sitecustomize.py /tmp/site/ 2>/dev/null || { mkdir -p /tmp/site; cp docs/relay/2026-12-06f/cpu/timeline/sitecustomize.py /tmp/site/; }
  rm -f /tmp/tlm.*
  TR_TL=/tmp/tlm UP_ARGS="$SPIN" OUT=$W/ttft TAG=tl DUR=20 COMPARE=1 TRACED=0 timeout 80 bash bench/ttft_pinned.sh > /dev/null 2>&1
  rm -f /tmp/site/sitecustomize.py
  el "tl"; grep -E '^(TTFT p(50|99)|server TTFT p50)' $W/ttft/tl_compare.txt | sed 's/  */ /g' | tr '\n' ';'; echo
  cat /tmp/tlm.* > $W/ttft/tl_marks.txt; python3 docs/relay/2026-12-06f/cpu/timeline/summ.py $W/ttft/tl_marks.txt | tee $W/ttft/tl_summ.txt
fi
tar czf $OUT/run-$(echo $SECTIONS | tr ' ' '-').tgz -C $W .
