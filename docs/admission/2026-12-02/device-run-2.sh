#!/bin/bash
# (Run from the repo root on the lent 16-core host with .whl/ (the service wheels + pytest) and .r4dev/ (redis-server + libs) carried; see docs/benchmarks.md.)
# Device run 2: issue 11's d after the refusal-path changes (2 routers twice, 4 routers, one traced), and the pinned overload test.
set -u
ROOT=$PWD
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PATH=$ROOT/.r4dev:$PATH LD_LIBRARY_PATH=$ROOT/.r4dev PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$ROOT
t0=$(date +%s)
for i in 1 2; do
timeout 100 python3 bench/bench_fairness.py --scenario d --routers 2 --clients 4 --cpu-list 0-15 --json $OUT/d2_$i.json 2>&1 | grep -v warning > $OUT/d2_$i.txt; echo "d2_$i $(( $(date +%s) - t0 )) s"
done
timeout 100 python3 bench/bench_fairness.py --scenario d --routers 4 --clients 4 --cpu-list 0-15 --json $OUT/d4.json 2>&1 | grep -v warning > $OUT/d4.txt; echo "d4 $(( $(date +%s) - t0 )) s"
mkdir -p /tmp/tr; : > /tmp/tr/spans.jsonl
TOKENRELAY_TRACE_FILE=/tmp/tr/spans.jsonl timeout 100 python3 bench/bench_fairness.py --scenario d --routers 2 --clients 4 --cpu-list 0-15 --json $OUT/d2t.json 2>&1 | grep -v warning > $OUT/d2t.txt; echo "d2t $(( $(date +%s) - t0 )) s"
python3 docs/admission/2026-12-02/refused_spans.py /tmp/tr/spans.jsonl > $OUT/d2t_refused_spans.txt 2>&1; gzip -c /tmp/tr/spans.jsonl > $OUT/d2t_spans.jsonl.gz
TR_OVERLOAD_LIMIT=8 TR_MESH_CPUS=0-3 TR_OVERLOAD_REFUSAL_MS=10,10 timeout 120 taskset -c 4-7 python3 -m pytest -p no:cacheprovider -q -s tests/router/test_overload_mesh.py > $OUT/overload_mesh.txt 2>&1; echo "overload_mesh $(( $(date +%s) - t0 )) s"
for f in d2_1 d2_2 d4 d2t; do echo "== $f"; grep -E "capacity alone|^\| (goodput|rejection|router|load)" $OUT/$f.txt; done
cat $OUT/d2t_refused_spans.txt; tail -30 $OUT/overload_mesh.txt
