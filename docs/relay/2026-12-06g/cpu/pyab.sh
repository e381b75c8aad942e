#!/bin/bash
# Python 3.11 against 3.12 (a venv at /tmp/v312 with this project installed), this tree, --idle-spin-ms 1000, the
# first token's path timed (docs/relay/2026-12-06f/cpu/timeline/); outputs: cpu/pyab/.
set -u
cd /work/main
for r in 1 2 3; do for v in 311 312; do
  PY=python; [ $v = 312 ] && PY=/tmp/v312/bin/python
  d=/tmp/pyab_$v$r; rm -rf $d; mkdir -p $d
  TR_TL=$d/tl PYTHONPATH=docs/relay/2026-12-06f/cpu/timeline:$PWD $PY -m tokenrelay_tools.cli.main up --engine sim --port 0 --state-file $d/state.json --run-dir $d/run --router-arg=--idle-spin-ms=1000 > $d/up.log 2>&1 &
  for i in $(seq 90); do [ -s $d/state.json ] && break; sleep 1; done; sleep 7
  $PY -m tokenrelay_tools.cli.main bench --workload chat-multiturn --compare --state-file $d/state.json --duration 20 --slo-ttft 0.5 --slo-itl 0.05 > $d/bench.txt 2>&1
  kill $(python3 -c "import json;print(json.load(open('$d/state.json'))['pid'])") 2>/dev/null; wait
  echo "== py$v $r $(grep -E '^(TTFT p50|server TTFT p50)' $d/bench.txt | sed 's/  */ /g' | tr '\n' ';') $(python3 docs/relay/2026-12-06f/cpu/timeline/summ.py $d/tl.* | grep -E 'submit posted  ' | head -1 | sed 's/  */ /g')"
done; done
