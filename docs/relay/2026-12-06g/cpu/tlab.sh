#!/bin/bash
# The first token's path step by step (docs/relay/2026-12-06f/cpu/timeline/), with --idle-spin-ms 1000, this tree (new)
# against .before/ (old) interleaved, on Python 3.12 (a venv at /tmp/v312 with this project installed): the
# eager task starts (74694ab, reverted in a5d6021) ran only there. Outputs: cpu/tlab/.
set -u
PY=/tmp/v312/bin/python
for r in 1 2; do for v in new old; do
  D=/work/main; [ $v = old ] && D=/work/main/.before
  d=/tmp/tlab_$v$r; rm -rf $d; mkdir -p $d
  (cd $D && TR_TL=$d/tl PYTHONPATH=/work/main/docs/relay/2026-12-06f/cpu/timeline:$D $PY -m tokenrelay_tools.cli.main up --engine sim --port 0 --state-file $d/state.json --run-dir $d/run --router-arg=--idle-spin-ms=1000 > $d/up.log 2>&1) &
  for i in $(seq 90); do [ -s $d/state.json ] && break; sleep 1; done; sleep 7
  (cd $D && PYTHONPATH=$D $PY -m tokenrelay_tools.cli.main bench --workload chat-multiturn --compare --state-file $d/state.json --duration 20 --slo-ttft 0.5 --slo-itl 0.05) > $d/bench.txt 2>&1
  kill $(python3 -c "import json;print(json.load(open('$d/state.json'))['pid'])") 2>/dev/null; wait
  echo "== $v $r $(grep -E '^(TTFT p50|server TTFT p50)' $d/bench.txt | sed 's/  */ /g' | tr '\n' ';')"
  python3 /work/main/docs/relay/2026-12-06f/cpu/timeline/summ.py $d/tl.* | cut -c1-58
done; done
