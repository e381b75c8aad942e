#!/bin/bash
# chat-multiturn with the chat prefetch on (the default, --chat-prefetch-max-in-flight 32) and off (0), the same
# tree, interleaved, with the first token's path step by step (docs/relay/2026-12-06f/cpu/timeline/) and
# the router's prefetch counter. OUT=dir ROUNDS=n SPIN=1000 bash docs/relay/2026-12-06h/cpu/prefetchab.sh
# Another router option's A/B the same way: FLAG (the option), ON (its value in the "on" arm; "off" sets 0) and
# METRICS (the counters kept per run, an extended regex), e.g. docs/relay/2026-12-06i/cpu/sbgab.sh.
set -u
OUT=${OUT:-/tmp/prefetchab}; ROUNDS=${ROUNDS:-3}; SPIN=${SPIN:-1000}; PY=${PY:-python}
FLAG=${FLAG:-chat-prefetch-max-in-flight}; ON=${ON:-32}
METRICS=${METRICS:-^tokenrelay_router_chat_prefetch_total|^tokenrelay_tokenizer_chat_reused_tokens_total}
mkdir -p $OUT
for r in $(seq $ROUNDS); do for v in on off; do
  n=0; [ $v = on ] && n=$ON
  d=$OUT/$v$r; rm -rf $d; mkdir -p $d
  (TR_TL=$d/tl PYTHONPATH=/work/main/docs/relay/2026-12-06f/cpu/timeline:/work/main $PY -m tokenrelay_tools.cli.main up --engine sim --port 0 --state-file $d/state.json --run-dir $d/run --router-arg=--idle-spin-ms=$SPIN --router-arg=--$FLAG=$n > $d/up.log 2>&1) &
  for i in $(seq 90); do [ -s $d/state.json ] && break; sleep 1; done; sleep 7
  $PY -m tokenrelay_tools.cli.main bench --workload chat-multiturn --compare --state-file $d/state.json --duration 20 --slo-ttft 0.5 --slo-itl 0.05 > $d/bench.txt 2>&1
  m=$($PY -c "import json;print(json.load(open('$d/state.json'))['metrics']['router'])")
  curl -s $m | grep -E "$METRICS" > $d/prefetch.txt
  kill $($PY -c "import json;print(json.load(open('$d/state.json'))['pid'])") 2>/dev/null; wait
  echo "== $v $r $(grep -E '^(TTFT p50|server TTFT p50)' $d/bench.txt | sed 's/  */ /g' | tr '\n' ';') $(tr '\n' ' ' < $d/prefetch.txt)"
  $PY /work/main/docs/relay/2026-12-06f/cpu/timeline/summ.py $d/tl.* | cut -c1-58
done; done
