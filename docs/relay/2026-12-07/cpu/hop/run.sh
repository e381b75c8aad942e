#!/bin/bash
# The client hop, step by step, on this machine: `tokenrelay up --engine sim` (the router marked by
# sitecustomize.py here; SPIN: its --idle-spin-ms) and the bare server (bare.py), N sequential chat turns each.
#   OUT=/tmp/hop N=320 ROUNDS=2 bash docs/relay/2026-12-07/cpu/hop/run.sh
set -u
HERE=$(cd $(dirname $0) && pwd); ROOT=$(cd $HERE/../../../../.. && pwd)
OUT=${OUT:-/tmp/hop}; N=${N:-320}; PY=${PY:-python}
for r in $(seq ${ROUNDS:-2}); do
  for spin in ${SPINS:-1000 0}; do
    d=$OUT/up$spin-$r; rm -rf $d; mkdir -p $d
    (TR_HOP=$d/hop PYTHONPATH=$HERE:$ROOT $PY -m tokenrelay_tools.cli.main up --engine sim --port 0 \
       --state-file $d/state.json --run-dir $d/run --router-arg=--idle-spin-ms=$spin > $d/up.log 2>&1 &)
    for i in $(seq 90); do [ -s $d/state.json ] && break; sleep 1; done; sleep 3
    PYTHONPATH=$ROOT $PY $HERE/client.py $d/state.json $N $d/client.txt > /dev/null
    kill $($PY -c "import json;print(json.load(open('$d/state.json'))['pid'])"); wait; sleep 1
    echo "== router, --idle-spin-ms $spin, round $r"; $PY $HERE/summ.py $d/client.txt $d/hop.*
  done
  d=$OUT/bare-$r; rm -rf $d; mkdir -p $d
  (TR_HOP=$d/hop PYTHONPATH=$ROOT $PY $HERE/bare.py $d/state.json > $d/bare.log 2>&1 &)
  sleep 3; PYTHONPATH=$ROOT $PY $HERE/client.py $d/state.json $N $d/client.txt > /dev/null; pkill -f hop/bare.py; sleep 1
  echo "== bare grpc.aio server, round $r"; $PY $HERE/summ.py $d/client.txt $d/hop.*
done
