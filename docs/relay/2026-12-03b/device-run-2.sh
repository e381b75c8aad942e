#!/bin/bash
# Device run 2 of 2026-12-03 (afternoon): run 1 again for its spread, holds on and off in the same run (slack 1 on,
# slack 1 off, slack 2 off), then shared-hot with 128 conversations (slack 1, holds on) beside round-robin and SGLang:
# balance costs copies of the shared prefixes, paid once per replica. Carried: .whl/, .r4dev/, .sgw/.
set -u
ROOT=$PWD
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
python3 -m venv /opt/sgvenv && /opt/sgvenv/bin/pip install -q --no-index --find-links .sgw sglang-router==0.3.2 || exit 1
export TOKENRELAY_CACHE=/tmp/trcache; V=$TOKENRELAY_CACHE/sglang-router-0.3.2; mkdir -p $V/bin
printf '#!/bin/sh\nunset PYTHONPATH\nexec /opt/sgvenv/bin/python "$@"\n' > $V/bin/python; chmod +x $V/bin/python
export PATH=$ROOT/.r4dev:$PATH LD_LIBRARY_PATH=$ROOT/.r4dev PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$ROOT
W=/tmp/o2; mkdir -p $W; t0=$(date +%s)
for v in "1 0.5" "1 0" "2 0"; do set -- $v
  timeout 200 python3 bench/bench_routing.py --traces shared-hot,evict,chat-multiturn \
    --configs prefix,prefix-2routers,round-robin,sglang-cache_aware \
    --router-flag=--prefix-balance-slack=$1 --router-flag=--prefix-hold-seconds=$2 \
    --json $W/slack$1-hold$2.json > $W/slack$1-hold$2.txt 2>&1
  echo "slack $1 hold $2 $(( $(date +%s) - t0 )) s"
done
timeout 150 python3 bench/bench_routing.py --traces shared-hot --conversations 128 --configs prefix,round-robin,sglang-cache_aware \
  --router-flag=--prefix-balance-slack=1 --json $W/long-slack1.json > $W/long-slack1.txt 2>&1
echo "long $(( $(date +%s) - t0 )) s"
tar czf $OUT/all.tgz -C $W .
for f in slack1-hold0.5 slack1-hold0 slack2-hold0 long-slack1; do
  grep -E "^(shared-hot|evict|chat-multiturn) +(prefix|round|sglang)" $W/$f.txt | sed "s/^/$f /"
  grep -E "^MISS" $W/$f.txt | sed "s/^/$f /"; done
