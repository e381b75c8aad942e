#!/bin/bash
# (Carried as device-run-1.sh: .whl/, .r4dev/, .sgw/.)
# Device run 3 of 2026-12-03: after the in-flight share fix (86aa42f), the three traces with round-robin, one and two
# tokenrelay routers and SGLang cache_aware, twice; then issue 11's scenario d once (the
# fix sends a message per loop iteration with an end: does the refusal path notice?), and once traced
# (bench/refusal_breakdown.py: where a refusal's time goes inside the router).
set -u
ROOT=$PWD
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
python3 -m venv /opt/sgvenv && /opt/sgvenv/bin/pip install -q --no-index --find-links .sgw sglang-router==0.3.2 || exit 1
export TOKENRELAY_CACHE=/tmp/trcache; V=$TOKENRELAY_CACHE/sglang-router-0.3.2; mkdir -p $V/bin
printf '#!/bin/sh\nunset PYTHONPATH\nexec /opt/sgvenv/bin/python "$@"\n' > $V/bin/python; chmod +x $V/bin/python
export PATH=$ROOT/.r4dev:$PATH LD_LIBRARY_PATH=$ROOT/.r4dev PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$ROOT
W=/tmp/o; mkdir -p $W; t0=$(date +%s)
for r in 1 2; do
  timeout 200 python3 bench/bench_routing.py --traces chat-multiturn,shared-hot,evict \
    --configs round-robin,prefix,prefix-2routers,sglang-cache_aware --json $W/routing3_$r.json > $W/routing3_$r.txt 2>&1
  echo "routing $r $(( $(date +%s) - t0 )) s"
done
timeout 55 python3 bench/bench_fairness.py --scenario d --routers 2 --clients 4 --cpu-list 0-15 --seconds 6 \
  --json $W/d_default5.json 2>&1 | grep -v warning > $W/d_default5.txt
TOKENRELAY_TRACE_FILE=$W/dspans.jsonl timeout 60 python3 bench/bench_fairness.py --scenario d --routers 2 --clients 4 \
  --cpu-list 0-15 --seconds 6 --json $W/d_traced.json 2>&1 | grep -v warning > $W/d_traced.txt
python3 bench/refusal_breakdown.py $W/dspans.jsonl > $W/d_traced_breakdown.txt 2>&1
tar czf $OUT/all.tgz -C $W .
for r in 1 2; do grep -E "^ +[a-z-]+ +[a-z0-9_-]+ +hit|^(PASS|MISS)" $W/routing3_$r.txt; done
grep -E "^capacity alone|^\| (goodput /|rejection|router CPU|RESOURCE)" $W/d_default5.txt
grep -E "^capacity alone|^\| (rejection latency)" $W/d_traced.txt; head -40 $W/d_traced_breakdown.txt
