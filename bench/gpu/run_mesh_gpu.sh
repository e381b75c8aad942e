#!/usr/bin/env bash
# The whole mesh on the GPU machine vs the same engine called in process (issue 13, "On a GPU").
#
# One engine process (bench/gpu/mesh_bench.py host: engine_svc's own start_engine, hf backend on
# the GPU, a Llama-3-8B-shaped model with random bf16 weights, the flags of run_gpu.sh) loads the
# model once and serves gRPC; then for each N in STREAMS, back to back:
#   inproc  the closed loop inside the engine process, calling its Engine object (no gRPC)
#   mesh    the same closed loop from another process through ROUTERS router processes (token-id
#           prompts; Redis admission, the tokenizer service detokenizing every output token), each on
#           its own port (one load process would put all its streams on one connection, so on one
#           router, behind --reuse-port); request i goes to router i mod ROUTERS
#   engine  the same closed loop from that process straight at the engine's multiplexed Stream
# Each phase: max(PER_STREAM x N, MIN_REQUESTS) requests of PROMPT random ids, OUTPUT tokens, ignore_eos.
# Routers: production defaults except --engine-progress-timeout 120 (a queued request hears nothing
# while 256 prompts of 512 tokens prefill ahead of it; the default 10 s would fail it as stalled).
# Every process pinned (taskset) to its own cores; every phase under a time limit, the whole run
# under BUDGET seconds (phases that would start past it are skipped and say so).
#
#   bash bench/gpu/run_mesh_gpu.sh                      # on the H200 (carried .whl, .whl-hf, .r4dev)
#   MODE=tiny bash bench/gpu/run_mesh_gpu.sh            # CPU dry run: 2-layer model, N = 1 4
#   (STREAMS, PROMPT, OUTPUT, PER_STREAM, PHASE_LIMIT, HF_FLAGS, ... override the mode's defaults;
#   ROUTER_FLAGS adds router flags, e.g. "--capacity-factor 2")
#
# Writes to $OUT: mesh_gpu.txt (versions, phase lines, table), mesh_gpu.json (every row), logs.tgz.
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
cd "$ROOT"
T0=$(date +%s)
OUT=${OUT:-/tmp/mesh-gpu-out}
MODE=${MODE:-gpu}
W=$(mktemp -d /tmp/mesh-gpu.XXXXXX)
mkdir -p "$OUT" "$W/ctl"
TXT=$OUT/mesh_gpu.txt
: > "$TXT"
say() { echo "$*" | tee -a "$TXT"; }
elapsed() { echo $(( $(date +%s) - T0 )); }

if [ "$MODE" = tiny ]; then
  STREAMS=${STREAMS:-"1 4"}; PROMPT=${PROMPT:-64}; OUTPUT=${OUTPUT:-16}; ROUTERS=${ROUTERS:-2}
  BUDGET=${BUDGET:-500}; PIN=${PIN:-0}; INSTALL=${INSTALL:-0}; PHASE_LIMIT=${PHASE_LIMIT:-60}
  M=$W/tiny; DEVICE=cpu; DTYPE=float32
  HF_FLAGS=${HF_FLAGS:-"--hf-num-blocks 512 --hf-max-batch-tokens 256 --hf-max-batch-size 32 --hf-threads 1"}
else
  STREAMS=${STREAMS:-"1 16 64 256"}; PROMPT=${PROMPT:-512}; OUTPUT=${OUTPUT:-64}; ROUTERS=${ROUTERS:-3}
  BUDGET=${BUDGET:-500}; PIN=${PIN:-1}; INSTALL=${INSTALL:-1}; PHASE_LIMIT=${PHASE_LIMIT:-75}
  M=/tmp/llama8b; DEVICE=cuda; DTYPE=bfloat16
  HF_FLAGS=${HF_FLAGS:-"--hf-num-blocks 8192 --hf-max-batch-tokens 8192 --hf-max-batch-size 256"}
fi
PER_STREAM=${PER_STREAM:-2}; MIN_REQUESTS=${MIN_REQUESTS:-4}
# 16 cores: engine 0-5, redis 6, tokenizer 7, routers 8.., the load generator 12-15.
ENGINE_CPUS=${ENGINE_CPUS:-0-5}; REDIS_CPUS=${REDIS_CPUS:-6}; TOKENIZER_CPUS=${TOKENIZER_CPUS:-7}
ROUTER_CPUS=${ROUTER_CPUS:-"8 9 10 11"}; LOAD_CPUS=${LOAD_CPUS:-12-15}
pin() { if [ "$PIN" = 1 ]; then echo "taskset -c $1"; fi; }
LOAD_FLAGS="--prompt $PROMPT --output $OUTPUT --per-stream $PER_STREAM --min-requests $MIN_REQUESTS --timeout 120"

# ---------------------------------------------------------------- environment
if [ "$INSTALL" = 1 ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || { say "pip install .whl failed"; exit 1; }
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site-hf \
    .whl-hf/*.whl || { say "pip install .whl-hf failed"; exit 1; }
  export PYTHONPATH=/tmp/site-hf:/tmp/site:$ROOT
else
  export PYTHONPATH=$ROOT${PYTHONPATH:+:$PYTHONPATH}
fi
REDIS=redis-server   # the carried build (.r4dev) where there is one: its libraries only for it, not for torch
[ -x .r4dev/redis-server ] && [ "$MODE" != tiny ] && REDIS="env LD_LIBRARY_PATH=$ROOT/.r4dev $ROOT/.r4dev/redis-server"
if [ "$PIN" = 1 ] && ! command -v taskset >/dev/null; then echo "# no taskset here: nothing is pinned"; PIN=0; fi
export PYTHONUNBUFFERED=1
say "# run_mesh_gpu.sh MODE=$MODE STREAMS='$STREAMS' PROMPT=$PROMPT OUTPUT=$OUTPUT PER_STREAM=$PER_STREAM" \
    "MIN_REQUESTS=$MIN_REQUESTS ROUTERS=$ROUTERS PIN=$PIN BUDGET=$BUDGET PHASE_LIMIT=$PHASE_LIMIT $(date -u +%FT%TZ)"
{ command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  timeout 60 python3 -c "
import sys, torch, transformers, tokenizers, huggingface_hub, grpc, google.protobuf as pb, pydantic, redis
print('python', sys.version.split()[0], '| torch', torch.__version__, '| cuda', torch.cuda.is_available(),
      '| transformers', transformers.__version__, transformers.__file__.rsplit('/', 2)[0],
      '| tokenizers', tokenizers.__version__, '| huggingface_hub', huggingface_hub.__version__,
      '| grpcio', grpc.__version__, '| protobuf', pb.__version__, '| pydantic', pydantic.__version__,
      '| redis-py', redis.__version__)"
  $REDIS --version; nproc; } 2>&1 | tee -a "$TXT" | tee "$W/versions.txt"

# ---------------------------------------------------------------- model dir + tokenizer
mkdir -p "$M"
if [ "$MODE" = tiny ]; then
  cat > "$M/config.json" <<'JSON'
{"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
 "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 128256,
 "max_position_embeddings": 8192, "rms_norm_eps": 1e-05, "rope_theta": 500000.0, "bos_token_id": 128000,
 "eos_token_id": 128001, "tie_word_embeddings": false, "torch_dtype": "float32"}
JSON
else
  cat > "$M/config.json" <<'JSON'
{"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336,
 "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256,
 "max_position_embeddings": 8192, "rms_norm_eps": 1e-05, "rope_theta": 500000.0, "bos_token_id": 128000,
 "eos_token_id": 128001, "tie_word_embeddings": false, "torch_dtype": "bfloat16"}
JSON
fi
timeout 120 python3 bench/gpu/make_vocab_tokenizer.py "$M" --check 2>&1 | tee -a "$TXT"
VOCAB=$(python3 -c "import json; print(json.load(open('$M/config.json'))['vocab_size'])")

PIDS=()
cleanup() {  # SIGTERM (each service drains and stops), up to 15 s, then SIGKILL what is left
  local pid i
  for pid in "${PIDS[@]}"; do kill -TERM "$pid" 2>/dev/null; done
  for i in $(seq 1 150); do
    for pid in "${PIDS[@]}"; do kill -0 "$pid" 2>/dev/null && break; pid=""; done
    [ -z "$pid" ] && break
    sleep 0.1
  done
  for pid in "${PIDS[@]}"; do kill -KILL "$pid" 2>/dev/null && echo "# killed $pid (did not stop on SIGTERM)"; done
  for pid in "${PIDS[@]}"; do wait "$pid" 2>/dev/null; done
  PIDS=()
}
trap cleanup EXIT
wait_file() {  # file, seconds, pid that must stay alive
  local i=0
  while [ ! -s "$1" ] && [ ! -S "$1" ]; do
    if [ -n "${3:-}" ] && ! kill -0 "$3" 2>/dev/null; then return 1; fi
    i=$((i + 1)); [ $i -gt $(( $2 * 10 )) ] && return 1
    sleep 0.1
  done
}

# ---------------------------------------------------------------- redis + tokenizer (while the model loads)
$(pin "$REDIS_CPUS") $REDIS --port 0 --unixsocket "$W/redis.sock" --unixsocketperm 700 --save "" \
  --appendonly no --dir "$W" > "$W/redis.log" 2>&1 &
PIDS+=($!)
$(pin "$TOKENIZER_CPUS") python3 -m tokenizer_svc --tokenizer "$M" --host 127.0.0.1 --port 0 \
  --port-file "$W/tokenizer.port" --log-format console > "$W/tokenizer.log" 2>&1 &
TPID=$!; PIDS+=($TPID)
KEY=trk-mesh-gpu-bench
python3 - "$W/tenants.yaml" "$KEY" <<'PY'
import hashlib, sys
open(sys.argv[1], "w").write("tenants:\n  - name: bench\n"
    f"    api_key_sha256: {hashlib.sha256(sys.argv[2].encode()).hexdigest()}\n"
    "    max_in_flight: 100000\n    max_queued: 100000\n")
PY
# ---------------------------------------------------------------- engine (loaded once)
$(pin "$ENGINE_CPUS") python3 bench/gpu/mesh_bench.py host --port-file "$W/engine.port" --control-dir "$W/ctl" \
  $LOAD_FLAGS -- --backend hf --model "$M" --hf-random-weights --hf-device $DEVICE --hf-dtype $DTYPE $HF_FLAGS \
  --no-hf-sampling --host 127.0.0.1 --port 0 --log-format console > "$W/engine.log" 2>&1 &
EPID=$!; PIDS+=($EPID)
if ! wait_file "$W/engine.port" 240 $EPID; then
  say "engine did not start:"; tail -30 "$W/engine.log" | tee -a "$TXT"; exit 1
fi
ENGINE=127.0.0.1:$(cat "$W/engine.port")
grep "^# engine ready" "$W/engine.log" | tee -a "$TXT"

# ---------------------------------------------------------------- routers
wait_file "$W/redis.sock" 20 || { say "redis-server did not start"; cat "$W/redis.log" | tee -a "$TXT"; exit 1; }
wait_file "$W/tokenizer.port" 120 $TPID || { say "tokenizer_svc did not start"; tail -20 "$W/tokenizer.log" | tee -a "$TXT"; exit 1; }
TOKENIZER=127.0.0.1:$(cat "$W/tokenizer.port")
read -r -a RCPUS <<< "$ROUTER_CPUS"
RPIDS=()
for i in $(seq 0 $((ROUTERS - 1))); do
  $(pin "${RCPUS[$((i % ${#RCPUS[@]}))]}") python3 -m router_svc --tokenizers "$TOKENIZER" --engines "$ENGINE" \
    --redis-url "unix://$W/redis.sock" --tenants-file "$W/tenants.yaml" --engine-progress-timeout 120 \
    --host 127.0.0.1 --port 0 --port-file "$W/router$i.port" --log-format console ${ROUTER_FLAGS:-} > "$W/router$i.log" 2>&1 &
  RPIDS+=($!); PIDS+=($!)
done
ROUTER_ADDRS=""
for i in $(seq 0 $((ROUTERS - 1))); do
  wait_file "$W/router$i.port" 120 "${RPIDS[$i]}" || { say "router$i did not start"; tail -20 "$W/router$i.log" | tee -a "$TXT"; exit 1; }
  ROUTER_ADDRS+="${ROUTER_ADDRS:+,}127.0.0.1:$(cat "$W/router$i.port")"
done
say "# mesh up at $(elapsed) s: engine $ENGINE, tokenizer $TOKENIZER, routers $ROUTER_ADDRS (each stream at one, round robin)"

# ---------------------------------------------------------------- phases
limit_for() {  # the phase's seconds: PHASE_LIMIT, less if the budget is nearly spent
  local left=$(( BUDGET - $(elapsed) - 15 ))
  [ $left -lt "$PHASE_LIMIT" ] && echo $left || echo "$PHASE_LIMIT"
}
for N in $STREAMS; do
  for TARGET in inproc mesh engine; do   # the pair the target is about first: a spent budget skips engine
    L=$(limit_for)
    if [ "$L" -lt 10 ]; then say "# $TARGET $N: skipped, the budget ($BUDGET s) is spent at $(elapsed) s"; continue; fi
    case $TARGET in
      inproc)
        echo "$L" > "$W/ctl/inproc_$N.go.tmp" && mv "$W/ctl/inproc_$N.go.tmp" "$W/ctl/inproc_$N.go"
        wait_file "$W/ctl/inproc_$N.json" $((L + 30)) $EPID || say "# inproc $N: no result (see engine.log)"
        [ -s "$W/ctl/inproc_$N.json" ] && cp "$W/ctl/inproc_$N.json" "$W/inproc_$N.json"
        grep "inproc *$N streams" "$W/engine.log" | tail -1 | tee -a "$TXT" ;;
      engine)
        $(pin "$LOAD_CPUS") timeout $((L + 30)) python3 bench/gpu/mesh_bench.py load --target engine --address "$ENGINE" \
          --streams "$N" --vocab "$VOCAB" --seed $((2000 + N)) --limit "$L" $LOAD_FLAGS --json "$W/engine_$N.json" \
          > "$W/load_engine_$N.log" 2>&1
        tail -1 "$W/load_engine_$N.log" | tee -a "$TXT" ;;
      mesh)
        $(pin "$LOAD_CPUS") timeout $((L + 30)) python3 bench/gpu/mesh_bench.py load --target mesh --address "$ROUTER_ADDRS" \
          --api-key "$KEY" --streams "$N" --vocab "$VOCAB" --seed $((3000 + N)) --limit "$L" $LOAD_FLAGS \
          --json "$W/mesh_$N.json" > "$W/load_mesh_$N.log" 2>&1
        tail -1 "$W/load_mesh_$N.log" | tee -a "$TXT" ;;
    esac
  done
done
say "# phases done at $(elapsed) s"

# ---------------------------------------------------------------- stop, report
cleanup
trap - EXIT
# Optional reference (RAW_CB="16 64"): transformers' continuous batching alone (raw_cb.py: its own model
# load, fifo scheduler, one wave of N requests), only while the budget lasts.
for N in ${RAW_CB:-}; do
  L=$(limit_for)
  if [ "$L" -lt 40 ]; then say "# raw_cb $N: skipped, the budget ($BUDGET s) is spent at $(elapsed) s"; continue; fi
  $(pin "$ENGINE_CPUS") timeout "$L" python3 bench/gpu/raw_cb.py --model "$M" --requests "$N" --prompt "$PROMPT" \
    --output "$OUTPUT" --device $DEVICE --dtype $DTYPE $(echo "$HF_FLAGS" | sed 's/--hf-/--/g; s/--threads [0-9]*//') \
    2> "$W/raw_cb_$N.err" | tail -1 > "$W/raw_cb_$N.json"
  say "raw_cb $N: $(cat "$W/raw_cb_$N.json")"
done
python3 bench/gpu/mesh_report.py "$W" --streams "$STREAMS" --json "$OUT/mesh_gpu.json" | tee -a "$TXT"
for f in engine tokenizer redis $(seq -f router%g 0 $((ROUTERS - 1))); do
  echo "--- tail $f.log"; grep -v "^\s*$" "$W/$f.log" | tail -4
done >> "$TXT"
tar -czf "$OUT/logs.tgz" -C "$W" --exclude=./tiny . 2>/dev/null
say "# done at $(elapsed) s; files in $OUT: mesh_gpu.txt mesh_gpu.json logs.tgz (work dir $W)"
