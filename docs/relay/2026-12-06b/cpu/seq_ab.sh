#!/bin/bash
# Usage: OLD=dir NEW=dir [N=400] [MAXTOK=1] bash seq_ab.sh   (two checkouts, run from the newer one; uses seq_requests.py of docs/relay/2026-12-06/cpu)
# A/B of router CPU per request (sequential requests) between two trees: OLD and NEW (dirs)
N=${N:-400}
for r in 1 2; do for v in old new; do
  D=$([ $v = old ] && echo $OLD || echo $NEW)
  RD=/tmp/ab/run-$v; rm -rf $RD
  (cd $D && PYTHONPATH=$D python -m tokenrelay_tools.cli.main up --engine sim --run-dir $RD > /tmp/ab/up-$v.log 2>&1 &)
  for i in $(seq 1 60); do grep -q "try:" /tmp/ab/up-$v.log && break; sleep 1; done
  sleep 2
  echo "== $v round $r: $(cd $NEW && python docs/relay/2026-12-06/cpu/seq_requests.py /root/.cache/tokenrelay/local.json $N ${MAXTOK:-1} | tr "\n" " " | cut -c1-400)"
  kill $(python -c "import json;print(json.load(open('/root/.cache/tokenrelay/local.json'))['pid'])"); sleep 3
done; done
