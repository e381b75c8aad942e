#!/bin/bash
# Usage: bash enq_corr.sh TREE_DIR  (a checkout to run; the mesh in /tmp/m3; DUR seconds of load, 12 by default)
# traced chat-multiturn + Redis MONITOR: when each request's ENQUEUE reaches Redis against its encode
D=$1; R=/tmp/m3; rm -rf $R && mkdir -p $R
(cd $D && PYTHONPATH=$D TOKENRELAY_TRACE_FILE=$R/spans.jsonl python -m tokenrelay_tools.cli.main up --engine sim --port 0 --state-file $R/state.json --run-dir $R/run > $R/up.log 2>&1 &)
for i in $(seq 1 60); do [ -s $R/state.json ] && break; sleep 1; done; sleep 2; : > $R/spans.jsonl
(timeout 14 redis-cli -s $R/run/redis.sock monitor > $R/mon.txt &); sleep 0.5
tokenrelay bench --workload chat-multiturn --state-file $R/state.json --duration ${DUR:-12} > $R/bench.txt 2>&1; sleep 2
kill $(python -c "import json;print(json.load(open('$R/state.json'))['pid'])"); sleep 2
python $(dirname $0)/enq_corr.py $R
