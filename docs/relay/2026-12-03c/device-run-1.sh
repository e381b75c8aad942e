#!/bin/bash
# Device run 1 of 2026-12-03c: the lent host's CPU topology (are the 16 CPUs 8 cores x 2 threads?), and
# the relay at 256 streams with the router's SMT sibling busy (a load process on it) against idle, twice
# each, interleaved. Run from the repo root with .whl/ and .r4dev/ carried.
set -u
ROOT=$PWD
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PATH=$ROOT/.r4dev:$PATH LD_LIBRARY_PATH=$ROOT/.r4dev PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$ROOT
W=/tmp/o; mkdir -p $W; t0=$(date +%s)
{ lscpu; echo; lscpu -e; echo; for c in /sys/devices/system/cpu/cpu[0-9]*; do echo "$(basename $c): $(cat $c/topology/thread_siblings_list) core $(cat $c/topology/core_id) pkg $(cat $c/topology/physical_package_id)"; done;
  echo; cat /sys/fs/cgroup/cpu.max 2>/dev/null; cat /sys/fs/cgroup/cpuset.cpus.effective 2>/dev/null; grep MHz /proc/cpuinfo | head -16; uptime; } > $W/topology.txt 2>&1
cat $W/topology.txt | grep -E "^cpu[0-9]+:|Thread|Core\(s\)|Socket|Model name|NUMA"
SIB=$(cat /sys/devices/system/cpu/cpu0/topology/thread_siblings_list | tr ',' '\n' | grep -v '^0$' | head -1)
echo "cpu0 sibling: ${SIB:-none}"
# CPUs other than 0 and its sibling, in order
REST=$(for c in $(seq 1 15); do [ "$c" != "$SIB" ] && echo $c; done | tr '\n' ' ')
set -- $REST
R1=$1 R2=$2 R3=$3; shift 3
CL_IDLE=$(echo "$@" | tr ' ' ',')           # the clients avoid cpu0's sibling
CL_BUSY="${SIB:-$1},$(echo "$@" | tr ' ' ',')"  # one client on cpu0's sibling
N_IDLE=$#; N_BUSY=$(( $# + 1 ))
for r in 1 2; do
  for mode in busy idle; do
    if [ $mode = busy ]; then CL=$CL_BUSY; N=$N_BUSY; else CL=$CL_IDLE; N=$N_IDLE; fi
    PIN="--router-cpus 0 --redis-cpus $R1 --tokenizer-cpus $R2 --engine-cpus $R3 --client-cpus $CL --clients $N"
    echo "== $mode$r: $PIN" > $W/relay_${mode}$r.txt
    timeout 45 python3 bench/bench_relay.py --streams 256 --duration 6 --warmup 2 --targets mesh $PIN >> $W/relay_${mode}$r.txt 2>&1
    echo "$mode$r $(( $(date +%s) - t0 )) s: $(grep -E '^  mesh' $W/relay_${mode}$r.txt | sed 's/  */ /g')"
  done
done
tar czf $OUT/all.tgz -C $W .
