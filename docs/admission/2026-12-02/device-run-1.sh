#!/bin/bash
# (Run from the repo root on the lent 16-core host with .whl/ (the service wheels + pytest) and .r4dev/ (redis-server + libs) carried; see docs/benchmarks.md.)
# Device run 1 of this session: issue 11's c/d on quiet cores (2 and 4 routers, one traced), issue 10's chat-multiturn TTFT.
set -u
ROOT=$PWD
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PATH=$ROOT/.r4dev:$PATH LD_LIBRARY_PATH=$ROOT/.r4dev PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$ROOT
nproc; python3 --version; python3 -c "import grpc; print(grpc.__version__)"
t0=$(date +%s)
timeout 150 python3 bench/bench_fairness.py --scenario c,d --routers 2 --clients 4 --cpu-list 0-15 --json $OUT/cd2.json 2>&1 | grep -v warning > $OUT/cd2.txt; echo "cd2 $(( $(date +%s) - t0 )) s"
mkdir -p /tmp/tr; : > /tmp/tr/spans.jsonl
TOKENRELAY_TRACE_FILE=/tmp/tr/spans.jsonl timeout 100 python3 bench/bench_fairness.py --scenario d --routers 2 --clients 4 --cpu-list 0-15 --json $OUT/d2t.json 2>&1 | grep -v warning > $OUT/d2t.txt; echo "d2t $(( $(date +%s) - t0 )) s"
python3 docs/admission/2026-12-02/refused_spans.py /tmp/tr/spans.jsonl > $OUT/d2t_refused_spans.txt 2>&1; gzip -c /tmp/tr/spans.jsonl > $OUT/d2t_spans.jsonl.gz
timeout 100 python3 bench/bench_fairness.py --scenario d --routers 4 --clients 4 --cpu-list 0-15 --json $OUT/d4.json 2>&1 | grep -v warning > $OUT/d4.txt; echo "d4 $(( $(date +%s) - t0 )) s"
OUT=$OUT TAG=now DUR=20 timeout 200 bash bench/ttft_pinned.sh > $OUT/ttft.txt 2>&1; echo "ttft $(( $(date +%s) - t0 )) s"
tail -30 $OUT/cd2.txt; tail -14 $OUT/d2t.txt; cat $OUT/d2t_refused_spans.txt; tail -14 $OUT/d4.txt; tail -45 $OUT/ttft.txt
