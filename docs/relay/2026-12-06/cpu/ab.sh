#!/bin/bash
# chat-multiturn --compare, default router vs local tokenize+detokenize, interleaved (this 2-core machine)
cd /work/main
for r in ${ROUNDS:-1 2}; do for mode in ${MODES:-default local}; do
  d=/tmp/ab_$mode$r; rm -rf $d; mkdir -p $d
  case $mode in local) A="--router-arg=--detokenize=local --router-arg=--tokenize-local-bytes=16384";; ascii) A="--engine-arg=--sim-sample-ids-below=128";; asciilocal) A="--engine-arg=--sim-sample-ids-below=128 --router-arg=--detokenize=local --router-arg=--tokenize-local-bytes=16384";; *) A="";; esac
  tokenrelay up --engine sim --port 0 --state-file $d/state.json --run-dir $d/run $A > $d/up.log 2>&1 &
  for i in $(seq 60); do [ -s $d/state.json ] && break; sleep 1; done; sleep 2
  tokenrelay bench --workload chat-multiturn --compare --state-file $d/state.json --duration 20 --slo-ttft 0.5 --slo-itl 0.05 > /tmp/ab_${mode}_$r.txt 2>&1
  kill %1; wait
done; done
