#!/bin/bash
# chat-multiturn through the router's request core (full) and through the one-coroutine path of
# cpu/lean/sitecustomize.py (lean; measurement only), interleaved, the routers with --idle-spin-ms 1000.
#   OUT=dir ROUNDS=n [TR_LEAN_EARLY=0] bash docs/relay/2026-12-06h/cpu/lean.sh
set -u
OUT=${OUT:-/tmp/lean}; ROUNDS=${ROUNDS:-2}; PY=${PY:-python}
mkdir -p $OUT
for r in $(seq $ROUNDS); do for v in lean full; do
  d=$OUT/$v$r; rm -rf $d; mkdir -p $d
  if [ $v = lean ]; then E="TR_LEAN=$d/lean PYTHONPATH=/work/main/docs/relay/2026-12-06h/cpu/lean:/work/main"
  else E="TR_TL=$d/tl PYTHONPATH=/work/main/docs/relay/2026-12-06f/cpu/timeline:/work/main"; fi
  (env $E $PY -m tokenrelay_tools.cli.main up --engine sim --port 0 --state-file $d/state.json --run-dir $d/run --router-arg=--idle-spin-ms=1000 > $d/up.log 2>&1) &
  for i in $(seq 90); do [ -s $d/state.json ] && break; sleep 1; done; sleep 7
  $PY -m tokenrelay_tools.cli.main bench --workload chat-multiturn --compare --state-file $d/state.json --duration 20 --slo-ttft 0.5 --slo-itl 0.05 > $d/bench.txt 2>&1
  kill $($PY -c "import json;print(json.load(open('$d/state.json'))['pid'])") 2>/dev/null; wait
  if [ $v = lean ]; then
    $PY /work/main/docs/relay/2026-12-06h/cpu/lean/summ.py $d/lean.* > $d/steps.txt
  else $PY /work/main/docs/relay/2026-12-06f/cpu/timeline/summ.py $d/tl.* > $d/steps.txt; fi
  echo "== $v$r $(grep -E '^(TTFT p50|TTFT p99)' $d/bench.txt | sed 's/  */ /g' | tr '\n' ';') | arrival->submit $(grep 'call arrived -> submit' $d/steps.txt | awk '{print $(NF-2)}') | errors: $(grep -oE '[0-9]+ errors' $d/bench.txt | head -1)"
done; done
