#!/bin/bash
# The bare grpc.aio client hop (docs/relay/2026-12-07/cpu/hop/: bare.py, client.py) under gRPC core settings
# given as environment (both processes; "S:..." the server only, "C:..." the client only), interleaved.
#   OUT=/tmp/hopenv N=220 ROUNDS=2 bash docs/relay/2026-12-07c/cpu/hopenv.sh "" "GRPC_EXPERIMENTS=-event_engine_client" ...
set -u
HERE=$(cd $(dirname $0) && pwd); ROOT=$(cd $HERE/../../../.. && pwd); HOP=$ROOT/docs/relay/2026-12-07/cpu/hop
OUT=${OUT:-/tmp/hopenv}; N=${N:-220}; PY=${PY:-python}
for r in $(seq ${ROUNDS:-2}); do
  i=0
  for envs in "$@"; do
    i=$((i+1)); d=$OUT/v$i-$r; rm -rf $d; mkdir -p $d
    senv=$envs; cenv=$envs   # "S:VAR=x" applies to the server only, "C:VAR=x" to the client only
    case "$envs" in S:*) senv=${envs#S:}; cenv=X=1;; C:*) cenv=${envs#C:}; senv=X=1;; esac
    (env $senv TR_HOP=$d/hop PYTHONPATH=$ROOT${PYTHONPATH:+:$PYTHONPATH} ${SRV_PIN:-} $PY $HOP/bare.py $d/state.json > $d/bare.log 2>&1 &)
    for k in $(seq 50); do [ -s $d/state.json ] && break; sleep 0.2; done; sleep 1
    env $cenv PYTHONPATH=$ROOT${PYTHONPATH:+:$PYTHONPATH} ${CLI_PIN:-} $PY $HOP/client.py $d/state.json $N $d/client.txt > /dev/null
    pkill -f hop/bare.py; sleep 0.5
    echo "== v$i [$envs] round $r"; $PY $HOP/summ.py $d/client.txt $d/hop.* | grep -E "servicer starts|client has|client TTFT"
  done
done
