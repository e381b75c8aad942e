#!/bin/bash
# Device run 1 of 2026-12-03 (afternoon session): holds (7ff6a98) on quiet cores. Every policy side by side with the
# default bound (slack 2) and with slack 1, both with holds on (the default), 2 routers included; then the routing
# decision time at 1k requests/s (does `held` cost anything). Carried: .whl/, .r4dev/, .sgw/.
set -u
ROOT=$PWD
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
python3 -m venv /opt/sgvenv && /opt/sgvenv/bin/pip install -q --no-index --find-links .sgw sglang-router==0.3.2 || exit 1
export TOKENRELAY_CACHE=/tmp/trcache; V=$TOKENRELAY_CACHE/sglang-router-0.3.2; mkdir -p $V/bin
printf '#!/bin/sh\nunset PYTHONPATH\nexec /opt/sgvenv/bin/python "$@"\n' > $V/bin/python; chmod +x $V/bin/python
export PATH=$ROOT/.r4dev:$PATH LD_LIBRARY_PATH=$ROOT/.r4dev PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$ROOT
W=/tmp/o; mkdir -p $W; t0=$(date +%s)
for sl in 2 1; do
  timeout 230 python3 bench/bench_routing.py --traces shared-hot,evict,chat-multiturn \
    --configs prefix,prefix-2routers,round-robin,sglang-cache_aware \
    --router-flag=--prefix-balance-slack=$sl --json $W/hold-slack$sl.json > $W/hold-slack$sl.txt 2>&1
  echo "slack $sl $(( $(date +%s) - t0 )) s"
done
timeout 60 python3 bench/bench_routing.py --decision-time --rate 1000 --seconds 5 > $W/decision.txt 2>&1
echo "decision $(( $(date +%s) - t0 )) s"
tar czf $OUT/all.tgz -C $W .
for f in hold-slack2 hold-slack1; do grep -E "^(shared-hot|evict|chat-multiturn) +(prefix|round|sglang)" $W/$f.txt | sed "s/^/$f /"; grep -E "^(PASS|MISS)" $W/$f.txt | sed "s/^/$f /"; done
tail -5 $W/decision.txt
