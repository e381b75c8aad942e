#!/bin/bash
# (Carried as device-run-2.sh: .whl/, .r4dev/, .sgw/.)
# Device run 3 of 2026-12-02c: issue 12's evict trace at its default size (32 conversations, 16 at a time, 96 KV
# blocks per replica), prefix against sglang-router cache_aware, seeds 0-7, paired; then the relay at one token
# per message with both local options twice more and the default once (device run 1 measured each once).
set -u
ROOT=$PWD
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
python3 -m venv /opt/sgvenv && /opt/sgvenv/bin/pip install -q --no-index --find-links .sgw sglang-router==0.3.2 || exit 1
export TOKENRELAY_CACHE=/tmp/trcache; V=$TOKENRELAY_CACHE/sglang-router-0.3.2; mkdir -p $V/bin
printf '#!/bin/sh\nunset PYTHONPATH\nexec /opt/sgvenv/bin/python "$@"\n' > $V/bin/python; chmod +x $V/bin/python
export PATH=$ROOT/.r4dev:$PATH LD_LIBRARY_PATH=$ROOT/.r4dev PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$ROOT
W=/tmp/o; mkdir -p $W; t0=$(date +%s)
for s in 0 1 2 3 4 5 6 7; do
  timeout 100 python3 bench/bench_routing.py --traces evict --configs prefix,sglang-cache_aware \
    --seed $s --json $W/evict32_s$s.json > $W/evict32_s$s.txt 2>&1
  echo "seed $s $(( $(date +%s) - t0 )) s"
done
PIN="--router-cpus 0 --redis-cpus 1 --tokenizer-cpus 2 --engine-cpus 3 --client-cpus 4-13 --clients 10"
LOCAL="--router-arg=--detokenize=local --router-arg=--tokenize-local-bytes=16384"
R1="python3 bench/bench_relay.py --streams 256 --step-ms 10 --duration 6 --warmup 2 --targets mesh $PIN --router-arg=--engine-wake-delay=0"
timeout 40 $R1 $LOCAL > $W/relay1_local_a.txt 2>&1
timeout 40 $R1 > $W/relay1_remote_a.txt 2>&1
timeout 40 $R1 $LOCAL > $W/relay1_local_b.txt 2>&1
echo "relay $(( $(date +%s) - t0 )) s"
tar czf $OUT/all.tgz -C $W .
for s in 0 1 2 3 4 5 6 7; do grep -E "^evict +(prefix|sglang)" $W/evict32_s$s.txt | sed "s/^/s$s /"; done
for f in $W/relay1_*.txt; do echo "$(basename $f): $(grep -E '^  mesh' $f | sed 's/  */ /g')"; done
