#!/bin/bash
# The engine hop marked on both ends (enginehop/), two trees interleaved on this 2-core machine:
# H = the session's start (e840139, `git archive` into /tmp/treeH), W = the working tree.
#   bash docs/relay/2026-12-07b/cpu/ehab.sh > /tmp/ehab.log      (outputs under /tmp/ehab/{H,W}N/r1/)
cd /work/main
for r in 1 2 3; do
 for v in H W; do
  if [ $v = H ]; then T=/tmp/treeH; else T=/work/main; fi
  TREE=$T OUT=/tmp/ehab/$v$r ROUNDS=1 DUR=20 bash docs/relay/2026-12-07b/cpu/enginehop/run.sh 2>&1 | sed "s/^/$v$r /"
 done
done
