#!/bin/bash
# Needs the idle warm-up, which was not merged: `git apply docs/relay/2026-12-06g/cpu/idle_warm.patch` first.
# Outputs: cpu/warmab/.
# chat-multiturn --compare with the first token's path timed: routers with --idle-spin-ms 1000 and
# --idle-warm-ms ${WARM_MS:-2} (warm) against --idle-spin-ms 1000 alone (spin), this tree, interleaved.
set -u
cd /work/main
OUT=${OUT:?}; mkdir -p $OUT
for r in ${ROUNDS:-1 2 3}; do for v in warm spin; do
  d=/tmp/warmab_$v$r; rm -rf $d; mkdir -p $d
  extra=(--router-arg=--idle-spin-ms=1000); [ $v = warm ] && extra+=(--router-arg=--idle-warm-ms=${WARM_MS:-2})
  TR_TL=$d/tl PYTHONPATH=docs/relay/2026-12-06f/cpu/timeline:$PWD python -m tokenrelay_tools.cli.main up --engine sim --port 0 --state-file $d/state.json --run-dir $d/run "${extra[@]}" > $d/up.log 2>&1 &
  for i in $(seq 90); do [ -s $d/state.json ] && break; sleep 1; done; sleep 7
  python -m tokenrelay_tools.cli.main bench --workload chat-multiturn --compare --state-file $d/state.json --duration 20 --slo-ttft 0.5 --slo-itl 0.05 > $OUT/${v}_$r.txt 2>&1
  kill $(python3 -c "import json;print(json.load(open('$d/state.json'))['pid'])") 2>/dev/null; wait
  python3 docs/relay/2026-12-06f/cpu/timeline/summ.py $d/tl.* > $OUT/${v}_${r}_summ.txt
  echo "$v $r: $(grep -E '^(TTFT p(50|99)|server TTFT p50|ITL p99)' $OUT/${v}_$r.txt | sed 's/  */ /g' | tr '\n' ';') $(grep -E 'call arrived -> submit|^encode  ' $OUT/${v}_${r}_summ.txt | sed 's/  */ /g' | tr '\n' ';')"
done; done
