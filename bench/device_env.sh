# Sourced by the device scripts under docs/relay/: the lent GPU host has no network, so the service
# wheels carried in .whl/ are installed into /tmp/site and the carried redis-server (.r4dev/, with its
# libraries) goes on PATH. Sets ROOT (the tree), W (a scratch folder tarred into $OUT at the end by the
# caller) and t0 (the start, for elapsed seconds).
ROOT=$PWD
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PATH=$ROOT/.r4dev:$PATH LD_LIBRARY_PATH=$ROOT/.r4dev PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$ROOT
W=/tmp/o; mkdir -p $W; t0=$(date +%s)
