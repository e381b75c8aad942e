#!/bin/bash
# (Run from the repo root on the lent 16-core host with .whl/ (the service wheels + pytest) and .r4dev/ (redis-server + libs) carried; see docs/benchmarks.md.)
# Device run 5: A/B of the mux wake slice (A: WAKE_SLICE 16, this tree; B: no slicing, a copy with it set huge):
# issue 11's d (2 and 4 routers), chat-multiturn TTFT (bench/ttft_pinned.sh), relay at 256 streams.
set -u
ROOT=$PWD
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PATH=$ROOT/.r4dev:$PATH LD_LIBRARY_PATH=$ROOT/.r4dev PYTHONUNBUFFERED=1
rm -rf /tmp/B && mkdir /tmp/B && tar --exclude=./.whl --exclude=./.r4dev --exclude=./.git -cf - . | tar -xf - -C /tmp/B && sed -i "s/^WAKE_SLICE = 16 /WAKE_SLICE = 1000000000 /" /tmp/B/services/mux.py
grep -n "^WAKE_SLICE" services/mux.py /tmp/B/services/mux.py
W=/tmp/o; mkdir -p $W
t0=$(date +%s)
fair() { # $1 tag, $2 tree, $3 routers
  (cd $2 && PYTHONPATH=/tmp/site:$2 timeout 100 python3 bench/bench_fairness.py --scenario d --routers $3 --clients 4 --cpu-list 0-15 --json $W/$1.json 2>&1 | grep -v warning > $W/$1.txt); echo "$1 $(( $(date +%s) - t0 )) s"; }
fair d2_A $ROOT 2; fair d2_B /tmp/B 2; fair d4_B /tmp/B 4; fair d4_A $ROOT 4
PIN="--router-cpus 0 --redis-cpus 1 --tokenizer-cpus 2 --engine-cpus 3 --client-cpus 4-13 --clients 10"
relay() { (cd $2 && PYTHONPATH=/tmp/site:$2 timeout 90 python3 bench/bench_relay.py --streams 256 --duration 8 --warmup 2 --targets mesh $PIN > $W/$1.txt 2>&1); echo "$1 $(( $(date +%s) - t0 )) s"; }
relay relay_B /tmp/B; relay relay_A $ROOT
for t in A B; do tree=$ROOT; [ $t = B ] && tree=/tmp/B
  OUT=$W TAG=ttft_$t DUR=20 TREE=$tree timeout 200 bash bench/ttft_pinned.sh > $W/ttft_$t.txt 2>&1; echo "ttft_$t $(( $(date +%s) - t0 )) s"; done
tar czf $OUT/all.tgz -C $W .
for f in d2_A d2_B d4_A d4_B; do echo "== $f"; grep -E "capacity alone|^\| (goodput /|rejection|router CPU|load)" $W/$f.txt; done
for f in relay_A relay_B; do echo "== $f"; tail -6 $W/$f.txt; done
for t in A B; do echo "== ttft_$t"; grep -E "TTFT p|output tok" $W/ttft_${t}_compare.txt; grep -E "detok|router TTFT|mesh part|tokenize  " $W/ttft_${t}_breakdown.txt; done
