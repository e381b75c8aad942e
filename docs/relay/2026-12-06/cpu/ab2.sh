#!/bin/bash
# chat-multiturn --compare: `up --engine sim` as it was (sim over every id, routers calling the tokenizer service) vs now, interleaved
cd /work/main
for r in ${ROUNDS:-1 2}; do for mode in old new; do
  d=/tmp/ab2_$mode$r; rm -rf $d; mkdir -p $d
  if [ $mode = old ]; then
    E="env TOKENRELAY_ROUTER_DETOKENIZE=tokenizer TOKENRELAY_ROUTER_TOKENIZE_LOCAL_BYTES=0"; A="--engine-arg=--sim-sample-ids-from=0 --engine-arg=--sim-sample-ids-below=0"
  else E="env"; A=""; fi
  $E tokenrelay up --engine sim --port 0 --state-file $d/state.json --run-dir $d/run $A > $d/up.log 2>&1 &
  for i in $(seq 60); do [ -s $d/state.json ] && break; sleep 1; done; sleep 2
  tokenrelay bench --workload chat-multiturn --compare --state-file $d/state.json --duration 20 --slo-ttft 0.5 --slo-itl 0.05 > /tmp/ab2_${mode}_$r.txt 2>&1
  kill %1; wait
done; done
