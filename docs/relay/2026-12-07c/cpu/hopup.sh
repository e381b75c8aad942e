#!/bin/bash
# The client hop through `tokenrelay up --engine sim` (routers with --idle-spin-ms 1000, marked by
# docs/relay/2026-12-07/cpu/hop/sitecustomize.py), two `up` variants interleaved (A_UP, B_UP), N sequential
# chat turns each (docs/relay/2026-12-07/cpu/hop/client.py, GAP seconds apart).
#   A_UP="--router-arg=--no-engine-frames" B_UP="" OUT=/tmp/hopup N=220 ROUNDS=2 bash docs/relay/2026-12-07c/cpu/hopup.sh
set -u
HERE=$(cd $(dirname $0) && pwd); ROOT=$(cd $HERE/../../../.. && pwd); HOP=$ROOT/docs/relay/2026-12-07/cpu/hop
OUT=${OUT:-/tmp/hopup}; N=${N:-220}; PY=${PY:-python}
for r in $(seq ${ROUNDS:-2}); do
  for v in A B; do
    u=${v}_UP; d=$OUT/$v$r; rm -rf $d; mkdir -p $d
    (TR_HOP=$d/hop PYTHONPATH=$HOP:$ROOT $PY -m tokenrelay_tools.cli.main up --engine sim --port 0 \
       --state-file $d/state.json --run-dir $d/run --router-arg=--idle-spin-ms=1000 ${!u:-} > $d/up.log 2>&1 &)
    for i in $(seq 90); do [ -s $d/state.json ] && break; sleep 1; done; sleep 3
    PYTHONPATH=$ROOT $PY $HOP/client.py $d/state.json $N $d/client.txt > /dev/null
    kill $($PY -c "import json;print(json.load(open('$d/state.json'))['pid'])"); wait; sleep 1
    echo "== $v [${!u:-}] round $r"; $PY $HOP/summ.py $d/client.txt $d/hop.*
  done
done
