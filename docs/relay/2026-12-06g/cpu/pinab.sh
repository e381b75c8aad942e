#!/bin/bash
# chat-multiturn --compare with the first token's path timed, routers with --idle-spin-ms 1000: the router
# process pinned to core 0 and every other process (engine, tokenizer, Redis, the bench client) to core 1
# (pin), against nothing pinned (free); this tree, interleaved.
# Outputs: cpu/pinab/.
set -u
cd /work/main
OUT=${OUT:?}; mkdir -p $OUT
for r in ${ROUNDS:-1 2 3}; do for v in pin free; do
  d=/tmp/pinab_$v$r; rm -rf $d; mkdir -p $d
  TR_TL=$d/tl PYTHONPATH=docs/relay/2026-12-06f/cpu/timeline:$PWD python -m tokenrelay_tools.cli.main up --engine sim --port 0 --state-file $d/state.json --run-dir $d/run --router-arg=--idle-spin-ms=1000 > $d/up.log 2>&1 &
  for i in $(seq 90); do [ -s $d/state.json ] && break; sleep 1; done; sleep 7
  B=""
  if [ $v = pin ]; then
    for p in $(pgrep -f "python.* -m (engine_svc|tokenizer_svc)") $(pgrep -x redis-server) $(pgrep -f "tokenrelay_tools.cli.main up"); do taskset -a -p -c 1 $p > /dev/null; done
    for p in $(pgrep -f "python.* -m router_svc"); do taskset -a -p -c 0 $p > /dev/null; done
    B="taskset -c 1"
  fi
  $B python -m tokenrelay_tools.cli.main bench --workload chat-multiturn --compare --state-file $d/state.json --duration 20 --slo-ttft 0.5 --slo-itl 0.05 > $OUT/${v}_$r.txt 2>&1
  kill $(python3 -c "import json;print(json.load(open('$d/state.json'))['pid'])") 2>/dev/null; wait
  python3 docs/relay/2026-12-06f/cpu/timeline/summ.py $d/tl.* > $OUT/${v}_${r}_summ.txt
  echo "$v $r: $(grep -E '^(TTFT p(50|99)|server TTFT p50)' $OUT/${v}_$r.txt | sed 's/  */ /g' | tr '\n' ';') $(grep -E 'call arrived -> submit|^encode  ' $OUT/${v}_${r}_summ.txt | sed 's/  */ /g' | tr '\n' ';')"
done; done
