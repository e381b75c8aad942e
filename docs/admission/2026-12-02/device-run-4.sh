#!/bin/bash
# (Run from the repo root on the lent 16-core host with .whl/ (the service wheels + pytest) and .r4dev/ (redis-server + libs) carried; see docs/benchmarks.md.)
# Device run 4: issue 11's d after the deadline-aware wait (4 routers twice, 2 routers once); per-request dumps.
set -u
ROOT=$PWD
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PATH=$ROOT/.r4dev:$PATH LD_LIBRARY_PATH=$ROOT/.r4dev PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$ROOT
W=/tmp/o; mkdir -p $W
t0=$(date +%s)
for run in d4_1:4 d4_2:4 d2_1:2; do f=${run%%:*}; n=${run##*:}
timeout 100 python3 bench/bench_fairness.py --scenario d --routers $n --clients 4 --cpu-list 0-15 --json $W/$f.json --dump-requests /tmp/$f.jsonl 2>&1 | grep -v warning > $W/$f.txt; echo "$f $(( $(date +%s) - t0 )) s"
python3 docs/admission/2026-12-02/goodput_by_outcome.py /tmp/$f.jsonl 8 > $W/${f}_goodput.txt; gzip -c /tmp/$f.jsonl > $W/${f}_requests.jsonl.gz
done
tar czf $OUT/all.tgz -C $W .
for f in d4_1 d4_2 d2_1; do echo "== $f"; grep -E "capacity alone|^\| " $W/$f.txt | grep -v -- "---" | tail -16; grep -A12 "overload" $W/${f}_goodput.txt; done
