#!/bin/bash
# Device run 3 of 2026-12-03 (afternoon): the new defaults (slack 1, holds on; no routing flags) once more, every policy
# side by side, then the routing decision time with holds' O(1) weight at 1000 and 500 requests/s.
# Carried: .whl/, .r4dev/, .sgw/.
set -u
ROOT=$PWD
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
python3 -m venv /opt/sgvenv && /opt/sgvenv/bin/pip install -q --no-index --find-links .sgw sglang-router==0.3.2 || exit 1
export TOKENRELAY_CACHE=/tmp/trcache; V=$TOKENRELAY_CACHE/sglang-router-0.3.2; mkdir -p $V/bin
printf '#!/bin/sh\nunset PYTHONPATH\nexec /opt/sgvenv/bin/python "$@"\n' > $V/bin/python; chmod +x $V/bin/python
export PATH=$ROOT/.r4dev:$PATH LD_LIBRARY_PATH=$ROOT/.r4dev PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$ROOT
W=/tmp/o3; mkdir -p $W; t0=$(date +%s)
timeout 200 python3 bench/bench_routing.py --traces shared-hot,evict,chat-multiturn \
  --configs prefix,prefix-2routers,round-robin,sglang-cache_aware --json $W/default.json > $W/default.txt 2>&1
echo "default $(( $(date +%s) - t0 )) s"
for r in 1000 500; do
  timeout 60 python3 bench/bench_routing.py --decision-time --rate $r --seconds 10 > $W/decision$r.txt 2>&1
done
echo "decision $(( $(date +%s) - t0 )) s"
tar czf $OUT/all.tgz -C $W .
grep -E "^(shared-hot|evict|chat-multiturn) +(prefix|round|sglang)" $W/default.txt; grep -E "^(PASS|MISS)" $W/default.txt
for r in 1000 500; do grep -E "achieved|route_seconds|errors\"" $W/decision$r.txt | tr -d '\n'; echo; done
