#!/bin/bash
# chat-multiturn through `tokenrelay up --engine sim` (routers with --idle-spin-ms), the engine hop marked on
# both ends (sitecustomize.py here), then summ.py.
#   OUT=/tmp/eh ROUNDS=2 DUR=20 bash docs/relay/2026-12-07b/cpu/enginehop/run.sh
set -u
HERE=$(cd $(dirname $0) && pwd); TREE=${TREE:-$(pwd)}
OUT=${OUT:-/tmp/eh}; ROUNDS=${ROUNDS:-2}; DUR=${DUR:-20}; SPIN=${SPIN:-1000}; PY=${PY:-python}
mkdir -p $OUT
for r in $(seq $ROUNDS); do
  d=$OUT/r$r; rm -rf $d; mkdir -p $d
  (cd $TREE && TR_EH=$d/eh PYTHONPATH=$HERE:$TREE $PY -m tokenrelay_tools.cli.main up --engine sim --port 0 \
     --state-file $d/state.json --run-dir $d/run --router-arg=--idle-spin-ms=$SPIN ${UP_ARGS:-} > $d/up.log 2>&1) &
  for i in $(seq 90); do [ -s $d/state.json ] && break; sleep 1; done; sleep 7
  (cd $TREE && PYTHONPATH=$TREE $PY -m tokenrelay_tools.cli.main bench --workload chat-multiturn --compare \
     --state-file $d/state.json --duration $DUR --slo-ttft 0.5 --slo-itl 0.05 ${BENCH_ARGS:-} > $d/bench.txt 2>&1)
  kill $($PY -c "import json;print(json.load(open('$d/state.json'))['pid'])") 2>/dev/null; wait
  echo "== $r $(grep -E '^(TTFT p(50|99)|server TTFT p50)' $d/bench.txt | sed 's/  */ /g' | tr '\n' ';')"
  $PY $HERE/summ.py $d/eh.* | tee $d/summ.txt
done
