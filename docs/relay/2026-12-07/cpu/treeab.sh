#!/bin/bash
# chat-multiturn TTFT added by `tokenrelay up --engine sim`, two trees interleaved (each run from its own
# checkout on PYTHONPATH), with the first token's path marked step by step (timeline/ here).
#   A=/tmp/treeA B=/work/main OUT=/tmp/treeab ROUNDS=3 DUR=20 bash docs/relay/2026-12-07/cpu/treeab.sh
# (A_BENCH / B_BENCH: more `tokenrelay bench` options for that arm, e.g. B_BENCH="--chat-api chat" with A=B.)
set -u
HERE=$(cd $(dirname $0) && pwd)
OUT=${OUT:-/tmp/treeab}; ROUNDS=${ROUNDS:-3}; DUR=${DUR:-20}; SPIN=${SPIN:-1000}; PY=${PY:-python}
mkdir -p $OUT
for r in $(seq $ROUNDS); do for v in A B; do
  tree=${!v}; d=$OUT/$v$r; rm -rf $d; mkdir -p $d
  (cd $tree && TR_TL=$d/tl PYTHONPATH=$HERE/timeline:$tree $PY -m tokenrelay_tools.cli.main up --engine sim --port 0 \
     --state-file $d/state.json --run-dir $d/run --router-arg=--idle-spin-ms=$SPIN ${UP_ARGS:-} > $d/up.log 2>&1) &
  for i in $(seq 90); do [ -s $d/state.json ] && break; sleep 1; done; sleep 7
  (cd $tree && PYTHONPATH=$tree $PY -m tokenrelay_tools.cli.main bench --workload chat-multiturn --compare \
     --state-file $d/state.json --duration $DUR --slo-ttft 0.5 --slo-itl 0.05 $(eval echo \${${v}_BENCH:-}) > $d/bench.txt 2>&1)
  kill $($PY -c "import json;print(json.load(open('$d/state.json'))['pid'])") 2>/dev/null; wait
  echo "== $v $r $(grep -E '^(TTFT p(50|99)|server TTFT p50)' $d/bench.txt | sed 's/  */ /g' | tr '\n' ';')"
  $PY $HERE/timeline/summ.py $d/tl.* | cut -c1-60
done; done
