#!/bin/bash
# relay at 256 streams (fast sim), router pinned to core 0: HEAD (before the uvloop busy fix) vs the working tree, on each loop
# BEFORE: a checkout of the tree before the fix (git worktree add $BEFORE 282d46b~1); run from the repo root
for r in 1 2; do
for tree in before after; do for L in uvloop asyncio; do
  if [ $tree = before ]; then D=$BEFORE; else D=$PWD; fi
  (cd $D && PYTHONPATH=$D python bench/bench_relay.py --streams 256 --duration 6 --warmup 2 --targets mesh --router-cpus 0 --redis-cpus 1 --tokenizer-cpus 1 --engine-cpus 1 --client-cpus 1 --clients 1 --router-arg=--event-loop=$L 2>&1 | grep -E "^  mesh" | sed "s/^/$tree $L $r: /" | cut -c1-230)
done; done; done
