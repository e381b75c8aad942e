#!/bin/bash
# (Run from the repo root on the lent 16-core host with .whl/ (service wheels), .r4dev/ (redis-server + libs),
# .sgw/ (sglang-router 0.3.2 and its wheels) carried; see docs/benchmarks.md.)
# Device run 1 of 2026-12-03: issue 12's whole side-by-side (bench_routing.py's default configurations: every
# policy on chat-multiturn, the hard ones plus 2 routers on shared-hot and evict) on quiet cores, which had never
# run there (TTFT against round-robin, 2 routers' hit); then issue 11's scenario d with 2 routers, the default
# router against one that tokenizes and detokenizes itself, interleaved twice.
set -u
ROOT=$PWD
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
python3 -m venv /opt/sgvenv && /opt/sgvenv/bin/pip install -q --no-index --find-links .sgw sglang-router==0.3.2 || exit 1
export TOKENRELAY_CACHE=/tmp/trcache; V=$TOKENRELAY_CACHE/sglang-router-0.3.2; mkdir -p $V/bin
printf '#!/bin/sh\nunset PYTHONPATH\nexec /opt/sgvenv/bin/python "$@"\n' > $V/bin/python; chmod +x $V/bin/python
export PATH=$ROOT/.r4dev:$PATH LD_LIBRARY_PATH=$ROOT/.r4dev PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$ROOT
W=$OUT; t0=$(date +%s)
timeout 320 python3 bench/bench_routing.py --json $W/routing_all.json > $W/routing_all.txt 2>&1
echo "routing $(( $(date +%s) - t0 )) s"
LOCAL="--router-arg=--detokenize=local --router-arg=--tokenize-local-bytes=16384"
D="python3 bench/bench_fairness.py --scenario d --routers 2 --clients 4 --cpu-list 0-15 --seconds 6"
for r in 1 2; do
  timeout 55 $D --json $W/d_default$r.json 2>&1 | grep -v warning > $W/d_default$r.txt; echo "d default$r $(( $(date +%s) - t0 )) s"
  timeout 55 $D $LOCAL --json $W/d_local$r.json 2>&1 | grep -v warning > $W/d_local$r.txt; echo "d local$r $(( $(date +%s) - t0 )) s"
done
grep -E "^ +[a-z-]+ +[a-z_-]+ +hit" $W/routing_all.txt
for f in $W/d_*.txt; do echo "== $(basename $f)"; grep -E "^capacity alone|^\| (goodput /|rejection|router CPU|tokenizer)" $f; done
