#!/bin/bash
# (Carried as device-run-1.sh: .whl/, .r4dev/, .sgw/.)
# Device run 2 of 2026-12-03: run 1's routing rows of two tokenrelay routers (prefix-2routers) on the three traces
# beside one router, round-robin and SGLang's cache_aware (run 1's summary missed those rows and its files did not
# come back); then issue 11's scenario d with 2 routers (the default router) twice more, for the refusal tail's spread.
set -u
ROOT=$PWD
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
python3 -m venv /opt/sgvenv && /opt/sgvenv/bin/pip install -q --no-index --find-links .sgw sglang-router==0.3.2 || exit 1
export TOKENRELAY_CACHE=/tmp/trcache; V=$TOKENRELAY_CACHE/sglang-router-0.3.2; mkdir -p $V/bin
printf '#!/bin/sh\nunset PYTHONPATH\nexec /opt/sgvenv/bin/python "$@"\n' > $V/bin/python; chmod +x $V/bin/python
export PATH=$ROOT/.r4dev:$PATH LD_LIBRARY_PATH=$ROOT/.r4dev PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$ROOT
W=/tmp/o; mkdir -p $W; t0=$(date +%s)
timeout 200 python3 bench/bench_routing.py --traces chat-multiturn,shared-hot,evict \
  --configs round-robin,prefix,prefix-2routers,sglang-cache_aware --json $W/routing2.json > $W/routing2.txt 2>&1
echo "routing $(( $(date +%s) - t0 )) s"
D="python3 bench/bench_fairness.py --scenario d --routers 2 --clients 4 --cpu-list 0-15 --seconds 6"
for r in 3 4; do
  timeout 55 $D --json $W/d_default$r.json 2>&1 | grep -v warning > $W/d_default$r.txt; echo "d default$r $(( $(date +%s) - t0 )) s"
done
tar czf $OUT/all.tgz -C $W .
grep -E "^ +[a-z-]+ +[a-z0-9_-]+ +hit" $W/routing2.txt
for f in $W/d_*.txt; do echo "== $(basename $f)"; grep -E "^capacity alone|^\| (goodput /|rejection|router CPU|tokenizer)" $f; done
