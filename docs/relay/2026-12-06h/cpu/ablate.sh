#!/bin/bash
# chat-multiturn with parts of the router's request path taken out (cpu/ablate/sitecustomize.py, measurement
# only), each variant against the full path, interleaved, the routers with --idle-spin-ms 1000.
#   OUT=dir ROUNDS=n VARIANTS="trace claim,sticky all" bash docs/relay/2026-12-06h/cpu/ablate.sh
set -u
OUT=${OUT:-/tmp/ablate}; ROUNDS=${ROUNDS:-2}; VARIANTS=${VARIANTS:-"trace claim,sticky trace,claim,sticky"}; PY=${PY:-python}
mkdir -p $OUT
for r in $(seq $ROUNDS); do for v in full $VARIANTS; do
  tag=$(echo $v | tr ',' '+')$r; d=$OUT/$tag; rm -rf $d; mkdir -p $d
  abl=$v; [ $v = full ] && abl=""
  (TR_ABL=$abl TR_TL=$d/tl PYTHONPATH=/work/main/docs/relay/2026-12-06h/cpu/ablate:/work/main $PY -m tokenrelay_tools.cli.main up --engine sim --port 0 --state-file $d/state.json --run-dir $d/run --router-arg=--idle-spin-ms=1000 > $d/up.log 2>&1) &
  for i in $(seq 90); do [ -s $d/state.json ] && break; sleep 1; done; sleep 7
  $PY -m tokenrelay_tools.cli.main bench --workload chat-multiturn --compare --state-file $d/state.json --duration 20 --slo-ttft 0.5 --slo-itl 0.05 > $d/bench.txt 2>&1
  kill $($PY -c "import json;print(json.load(open('$d/state.json'))['pid'])") 2>/dev/null; wait
  $PY /work/main/docs/relay/2026-12-06f/cpu/timeline/summ.py $d/tl.* > $d/steps.txt
  echo "== $tag $(grep -E '^TTFT p50' $d/bench.txt | sed 's/  */ /g') | arrival->submit $(grep 'call arrived -> submit' $d/steps.txt | awk '{print $(NF-2)}')"
done; done
