#!/bin/bash
# (Run from the repo root on the lent 16-core host with .whl/, .r4dev/ and .sgw/ (sglang-router 0.3.2 and its
# dependencies, wheels for Python 3.12) carried.)
# Device run 2 of 2026-12-02c: issue 12's evict trace at 96 conversations on quiet cores, tokenrelay's prefix
# policy against sglang-router's cache_aware, four seeds (the 2-core machine shares its cores between the
# 8 sims, the routers and the client); per-request dumps for bench/routing_dump_report.py.
set -u
ROOT=$PWD
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
python3 -m venv /opt/sgvenv && /opt/sgvenv/bin/pip install -q --no-index --find-links .sgw sglang-router==0.3.2 || exit 1
export TOKENRELAY_CACHE=/tmp/trcache; V=$TOKENRELAY_CACHE/sglang-router-0.3.2; mkdir -p $V/bin
printf '#!/bin/sh\nunset PYTHONPATH\nexec /opt/sgvenv/bin/python "$@"\n' > $V/bin/python; chmod +x $V/bin/python
$V/bin/python -c "import sglang_router" || exit 1
export PATH=$ROOT/.r4dev:$PATH LD_LIBRARY_PATH=$ROOT/.r4dev PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$ROOT
W=/tmp/o; mkdir -p $W; t0=$(date +%s)
for s in 0 1 2 3; do
  timeout 150 python3 bench/bench_routing.py --traces evict --conversations 96 --configs prefix,sglang-cache_aware \
    --seed $s --json $W/evict96_s$s.json --dump-requests $W/evict96_dump_s$s.jsonl > $W/evict96_s$s.txt 2>&1
  echo "seed $s $(( $(date +%s) - t0 )) s"
done
timeout 200 python3 bench/bench_routing.py --traces evict,shared-hot,chat-multiturn --configs prefix,sglang-cache_aware \
  --json $W/three.json > $W/three.txt 2>&1; echo "three $(( $(date +%s) - t0 )) s"
tar czf $OUT/all.tgz -C $W .
for s in 0 1 2 3; do grep -E "^evict +(prefix|sglang)" $W/evict96_s$s.txt | sed "s/^/s$s /"; done
grep -E "^(evict|shared-hot|chat-multiturn) +(prefix|sglang)" $W/three.txt
