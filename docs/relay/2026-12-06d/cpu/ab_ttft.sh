#!/bin/bash
# chat-multiturn --compare (`tokenrelay up --engine sim` + `tokenrelay bench`), this tree against the tree
# extracted into .before/ (BEFORE, default 6e28d93: before this session's first-token changes), interleaved.
# Outputs: $OUT/ttft_{new,old}_R.txt.   OUT=dir [ROUNDS="1 2"] bash docs/relay/2026-12-06d/cpu/ab_ttft.sh
set -u
ROOT=$(cd "$(dirname "$0")/../../../.." && pwd); OUT=${OUT:?}
for r in ${ROUNDS:-1 2}; do for v in new old; do
  D=$ROOT; [ $v = old ] && D=$ROOT/.before
  d=/tmp/abt_$v$r; rm -rf $d; mkdir -p $d
  (cd $D && PYTHONPATH=$D python -m tokenrelay_tools.cli.main up --engine sim --port 0 --state-file $d/state.json \
     --run-dir $d/run > $d/up.log 2>&1) &
  for i in $(seq 90); do [ -s $d/state.json ] && break; sleep 1; done; sleep 2
  (cd $D && PYTHONPATH=$D python -m tokenrelay_tools.cli.main bench --workload chat-multiturn --compare \
     --state-file $d/state.json --duration 20 --slo-ttft 0.5 --slo-itl 0.05) > $OUT/ttft_${v}_$r.txt 2>&1
  kill $(python3 -c "import json;print(json.load(open('$d/state.json'))['pid'])") 2>/dev/null; wait
  echo "$v $r: $(grep -E 'TTFT added|ttft' $OUT/ttft_${v}_$r.txt | head -3 | tr '\n' ' ')"
done; done
