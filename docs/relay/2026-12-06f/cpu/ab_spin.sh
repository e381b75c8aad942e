#!/bin/bash
# chat-multiturn --compare (`tokenrelay up --engine sim` + `tokenrelay bench`), the routers with --idle-spin-ms
# (SPIN_MS, default 1000) against without, this tree, interleaved. Outputs: $OUT/spin_{on,off}_R.txt.
#   OUT=dir [ROUNDS="1 2 3"] [SPIN_MS=1000] bash docs/relay/2026-12-06f/cpu/ab_spin.sh
set -u
ROOT=$(cd "$(dirname "$0")/../../../.." && pwd); OUT=${OUT:?}
for r in ${ROUNDS:-1 2 3}; do for v in on off; do
  d=/tmp/abs_$v$r; rm -rf $d; mkdir -p $d
  extra=(); [ $v = on ] && extra=(--router-arg=--idle-spin-ms=${SPIN_MS:-1000})
  (cd $ROOT && python -m tokenrelay_tools.cli.main up --engine sim --port 0 --state-file $d/state.json \
     --run-dir $d/run "${extra[@]}" > $d/up.log 2>&1) &
  for i in $(seq 90); do [ -s $d/state.json ] && break; sleep 1; done; sleep 2
  (cd $ROOT && python -m tokenrelay_tools.cli.main bench --workload chat-multiturn --compare \
     --state-file $d/state.json --duration 20 --slo-ttft 0.5 --slo-itl 0.05) > $OUT/spin_${v}_$r.txt 2>&1
  grep -h "idle_spin_seconds_total " <(curl -s $(python3 -c "import json;print(json.load(open('$d/state.json'))['metrics']['router'])")) >> $OUT/spin_${v}_$r.txt
  kill $(python3 -c "import json;print(json.load(open('$d/state.json'))['pid'])") 2>/dev/null; wait
  echo "$v $r: $(grep -E '^(TTFT p(50|99)|server TTFT p50|ITL p50)' $OUT/spin_${v}_$r.txt | sed 's/  */ /g' | tr '\n' ';') $(grep idle_spin $OUT/spin_${v}_$r.txt)"
done; done
