#!/bin/bash
# chat-multiturn TTFT added by `tokenrelay up --engine sim` (this tree), two environments for the mesh's
# processes interleaved (A_ENV, B_ENV: `env` arguments given to `up` only; the bench client runs with
# CLIENT_ENV in both arms; A_UP, B_UP: more `up` options for that arm; A_BENCH, B_BENCH: more `bench`
# options for that arm, after BENCH), the first token's path marked
# (docs/relay/2026-12-07/cpu/timeline/).
#   A_ENV="X=1" B_ENV="GRPC_EXPERIMENTS=-event_engine_client,-event_engine_listener" OUT=/tmp/envab ROUNDS=3 DUR=20 \
#     bash docs/relay/2026-12-07c/cpu/envab.sh
#   A_UP="--router-arg=--no-engine-frames" OUT=/tmp/frab ROUNDS=3 bash docs/relay/2026-12-07c/cpu/envab.sh
#   B_BENCH="--mesh-calls stream" OUT=/tmp/callab ROUNDS=3 bash docs/relay/2026-12-07c/cpu/envab.sh
set -u
HERE=$(cd $(dirname $0) && pwd); ROOT=$(cd $HERE/../../../.. && pwd); TL=$ROOT/docs/relay/2026-12-07/cpu/timeline
A_ENV=${A_ENV:-X=1}; B_ENV=${B_ENV:-X=1}
OUT=${OUT:-/tmp/envab}; ROUNDS=${ROUNDS:-3}; DUR=${DUR:-20}; SPIN=${SPIN:-1000}; PY=${PY:-python}
mkdir -p $OUT
for r in $(seq $ROUNDS); do for v in A B; do
  e=${v}_ENV; u=${v}_UP; b=${v}_BENCH; d=$OUT/$v$r; rm -rf $d; mkdir -p $d
  (cd $ROOT && env ${!e} TR_TL=$d/tl PYTHONPATH=$TL:$ROOT $PY -m tokenrelay_tools.cli.main up --engine sim --port 0 \
     --state-file $d/state.json --run-dir $d/run --router-arg=--idle-spin-ms=$SPIN ${UP_ARGS:-} ${!u:-} > $d/up.log 2>&1) &
  for i in $(seq 90); do [ -s $d/state.json ] && break; sleep 1; done; sleep 7
  (cd $ROOT && env ${CLIENT_ENV:-X=1} PYTHONPATH=$ROOT $PY -m tokenrelay_tools.cli.main bench --workload chat-multiturn \
     --compare --state-file $d/state.json --duration $DUR --slo-ttft 0.5 --slo-itl 0.05 ${BENCH:-} ${!b:-} > $d/bench.txt 2>&1)
  kill $($PY -c "import json;print(json.load(open('$d/state.json'))['pid'])") 2>/dev/null; wait
  echo "== $v $r [${!e} ${!u:-} ${!b:-}] $(grep -E '^(TTFT p(50|99)|server TTFT p50)' $d/bench.txt | sed 's/  */ /g' | tr '\n' ';')"
  $PY $TL/summ.py $d/tl.* | cut -c1-60
done; done
