#!/bin/bash
# chat-multiturn TTFT added by the mesh on quiet cores: `tokenrelay up --engine sim` on cores 0-5, the
# bench client on 8-11; `--compare` (mesh, then the engine alone, same sessions), then a mesh run with
# every service writing spans (TOKENRELAY_TRACE_FILE) for bench/ttft_breakdown.py.
# On the lent GPU host (16 cores), from the repo root, with the service wheels carried in .whl/ and
# redis-server (+ libs) in .r4dev/:  OUT=/some/dir TAG=after DUR=30 bash bench/ttft_pinned.sh
# (TREE=dir runs the tree extracted there instead of this one; COMPARE=0 skips the --compare run, TRACED=0 the
# traced one; the services' event loop follows TOKENRELAY_EVENT_LOOP, services/eventloop.py; BENCH_ARGS: more
# `tokenrelay bench` options for both runs, e.g. "--chat-api chat"; AFTER_UP: a command run once the mesh is up,
# given its state file, e.g. one that pins its processes; UP_ENV: VAR=value words for the mesh of the --compare run
# only, e.g. gRPC core settings, the bench client left as it is.)
set -u
OUT=${OUT:?set OUT to a directory for the outputs}
TOP=$PWD; cd ${TREE:-.}; ROOT=$PWD
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site $TOP/.whl/*.whl || exit 1
export PATH=$TOP/.r4dev:$PATH LD_LIBRARY_PATH=$TOP/.r4dev PYTHONPATH=/tmp/site:$ROOT PYTHONUNBUFFERED=1
TR="python3 -m tokenrelay_tools.cli.main"
TAG=${TAG:-run}
DUR=${DUR:-30}
up() {  # $1 dir, rest env
  local d=$1; shift
  rm -rf $d; mkdir -p $d
  env "$@" taskset -c 0-5 $TR up --engine sim --port 0 --state-file $d/state.json --run-dir $d/run ${UP_ARGS:-} > $d/up.log 2>&1 &
  for i in $(seq 1 90); do [ -s $d/state.json ] && break; sleep 1; done
  [ -n "${AFTER_UP:-}" ] && $AFTER_UP $d/state.json > $d/after_up.log 2>&1
  sleep 2
}
if [ "${COMPARE:-1}" = 1 ]; then
  up /tmp/m1 X=1 ${UP_ENV:-}
  taskset -c 8-11 $TR bench --workload chat-multiturn --compare --state-file /tmp/m1/state.json --duration $DUR \
    --slo-ttft 0.5 --slo-itl 0.05 ${BENCH_ARGS:-} > $OUT/${TAG}_compare.txt 2>&1
  kill %1; wait
fi
[ "${TRACED:-1}" = 1 ] || { tail -25 $OUT/${TAG}_compare.txt; exit 0; }
up /tmp/m2 TOKENRELAY_TRACE_FILE=/tmp/m2/spans.jsonl
: > /tmp/m2/spans.jsonl
taskset -c 8-11 $TR bench --workload chat-multiturn --state-file /tmp/m2/state.json --duration $DUR ${BENCH_ARGS:-} > $OUT/${TAG}_traced.txt 2>&1
kill %1; wait
python3 bench/ttft_breakdown.py /tmp/m2/spans.jsonl --json $OUT/${TAG}_breakdown.json > $OUT/${TAG}_breakdown.txt 2>&1
tail -25 $OUT/${TAG}_compare.txt; cat $OUT/${TAG}_breakdown.txt
