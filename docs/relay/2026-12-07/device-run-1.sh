#!/bin/bash
# Device calls of 2026-12-07 (tenth session) on quiet cores: chat-multiturn TTFT added by the mesh, the tree
# before this session (f175382, extracted into .treeA/ and carried) against this tree, interleaved, every
# process pinned (bench/ttft_pinned.sh: `tokenrelay up --engine sim` on cores 0-5, the client on 8-11, the
# engine alone in the same run).
# SECTIONS:
#   ab     ROUNDS pairs (A = .treeA, B = this tree), DUR seconds a run (40), the routers with --idle-spin-ms 1000
#   marks  one pair with the first token's path marked step by step (docs/relay/2026-12-07/cpu/timeline/)
#   once   ONCE runs of this tree alone (issue 10's TTFT show as before)
#   chat   ROUNDS pairs of this tree: the bench's chats as Generate calls (G, the documented client) and through
#          the Chat API (C: one open call per conversation), interleaved (not run this session: no device time left)
# Outputs in $OUT/o/.   e.g. SECTIONS="ab" ROUNDS=2 bash docs/relay/2026-12-07/device-run-1.sh
set -u
SECTIONS=${SECTIONS:-ab}
on() { [[ " $SECTIONS " == *" $1 "* ]]; }
. bench/device_env.sh
W=$OUT/o   # written where the call's outputs come back from, so that a run cut off keeps what it made
el() { echo "$1 $(( $(date +%s) - t0 )) s"; }
nproc; grep -m1 "model name" /proc/cpuinfo; python3 -V
mkdir -p $W/ttft
res() { grep -E '^(TTFT p(50|99)|server TTFT p50)' $W/ttft/$1_compare.txt | sed 's/  */ /g' | tr '\n' ';'; echo; }
one() {  # $1 tag, $2 tree (BENCH_ARGS passes through to bench/ttft_pinned.sh)
  UP_ARGS="--router-arg=--idle-spin-ms=1000" OUT=$W/ttft TAG=$1 TREE=$2 DUR=${DUR:-40} COMPARE=1 TRACED=0 \
    timeout 150 bash bench/ttft_pinned.sh > /dev/null 2>&1
  el "$1"; res $1
}
on ab && for r in $(seq ${ROUNDS:-2}); do one A$r .treeA; one B$r .; done
on marks && for v in A B; do
  t=.; [ $v = A ] && t=.treeA
  mkdir -p /tmp/tl; rm -f /tmp/tl/m.*; cp docs/relay/2026-12-07/cpu/timeline/sitecustomize.py /tmp/site/
  TR_TL=/tmp/tl/m one marks$v $t
  rm -f /tmp/site/sitecustomize.py; cat /tmp/tl/m.* > $W/ttft/marks${v}_marks.txt
  python3 docs/relay/2026-12-07/cpu/timeline/summ.py $W/ttft/marks${v}_marks.txt
done
on once && for r in $(seq ${ONCE:-1}); do one once$r .; done
on chat && for r in $(seq ${ROUNDS:-2}); do one G$r .; BENCH_ARGS="--chat-api chat" one C$r .; done
