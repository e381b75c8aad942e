#!/bin/bash
# (Run from the repo root on the lent 16-core host with .whl/ (the service wheels + pytest) and .r4dev/ (redis-server + libs) carried; see docs/benchmarks.md.)
# Device run 3: issue 11's a-d with 4 routers (after today's refusal-path changes), d again with 4 and with 2 routers; per-request dumps.
set -u
ROOT=$PWD
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PATH=$ROOT/.r4dev:$PATH LD_LIBRARY_PATH=$ROOT/.r4dev PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$ROOT
W=/tmp/o; mkdir -p $W
t0=$(date +%s)
timeout 240 python3 bench/bench_fairness.py --routers 4 --clients 4 --cpu-list 0-15 --json $W/abcd4.json --dump-requests /tmp/abcd4.jsonl 2>&1 | grep -v warning > $W/abcd4.txt; echo "abcd4 $(( $(date +%s) - t0 )) s"
timeout 100 python3 bench/bench_fairness.py --scenario d --routers 4 --clients 4 --cpu-list 0-15 --json $W/d4b.json --dump-requests /tmp/d4b.jsonl 2>&1 | grep -v warning > $W/d4b.txt; echo "d4b $(( $(date +%s) - t0 )) s"
timeout 100 python3 bench/bench_fairness.py --scenario d --routers 2 --clients 4 --cpu-list 0-15 --json $W/d2c.json --dump-requests /tmp/d2c.jsonl 2>&1 | grep -v warning > $W/d2c.txt; echo "d2c $(( $(date +%s) - t0 )) s"
for f in abcd4 d4b d2c; do python3 docs/admission/2026-12-02/goodput_by_outcome.py /tmp/$f.jsonl 8 > $W/${f}_goodput.txt; gzip -c /tmp/$f.jsonl > $W/${f}_requests.jsonl.gz; done
tar czf $OUT/all.tgz -C $W .
for f in abcd4 d4b d2c; do echo "== $f"; grep -E "capacity alone|^\| " $W/$f.txt | grep -v -- "---" | tail -40; cat $W/${f}_goodput.txt | grep -A12 "overload\|capacity"; done
