#!/usr/bin/env bash
# Does a closed loop's wave reaching the engine in parts cost throughput? (issue 13, the 16-stream gap)
#
# One engine (bench/gpu/mesh_bench.py host, the hf backend as in run_mesh_gpu.sh), in-process phases
# only, alternating: each wave submitted as it comes (stagger 0) and each wave in three parts
# STAGGER ms apart (request i held back (i mod 3) x STAGGER ms, as a wave through three routers).
#
#   bash bench/gpu/stagger_run.sh                  # on the H200 (carried .whl, .whl-hf)
#   MODE=tiny bash bench/gpu/stagger_run.sh        # CPU dry run
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
cd "$ROOT"
OUT=${OUT:-/tmp/stagger-out}
MODE=${MODE:-gpu}
W=$(mktemp -d /tmp/stagger.XXXXXX)
mkdir -p "$OUT" "$W/ctl" "$W/m"
STREAMS=${STREAMS:-16}; STAGGERS=${STAGGERS:-"0 3 0 3 0 10"}; PER_STREAM=${PER_STREAM:-4}
PROMPT=${PROMPT:-512}; OUTPUT=${OUTPUT:-32}; PHASE_LIMIT=${PHASE_LIMIT:-60}
if [ "$MODE" = tiny ]; then
  DEVICE=cpu; DTYPE=float32; PROMPT=${PROMPT_TINY:-64}
  HF_FLAGS="--hf-num-blocks 512 --hf-max-batch-tokens 1024 --hf-max-batch-size 32 --hf-threads 1"
  SHAPE='"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 512'
  export PYTHONPATH=$ROOT${PYTHONPATH:+:$PYTHONPATH}
else
  DEVICE=cuda; DTYPE=bfloat16
  HF_FLAGS="--hf-num-blocks 8192 --hf-max-batch-tokens 8192 --hf-max-batch-size 256"
  SHAPE='"hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256'
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site-hf .whl-hf/*.whl || exit 1
  export PYTHONPATH=/tmp/site-hf:/tmp/site:$ROOT
fi
cat > "$W/m/config.json" <<JSON
{"architectures": ["LlamaForCausalLM"], "model_type": "llama", $SHAPE,
 "max_position_embeddings": 8192, "rms_norm_eps": 1e-05, "rope_theta": 500000.0, "bos_token_id": 1,
 "eos_token_id": 2, "tie_word_embeddings": false}
JSON
python3 bench/gpu/mesh_bench.py host --port-file "$W/engine.port" --control-dir "$W/ctl" --prompt "$PROMPT" \
  --output "$OUTPUT" --per-stream "$PER_STREAM" --timeout 120 -- --backend hf --model "$W/m" --hf-random-weights \
  --hf-device $DEVICE --hf-dtype $DTYPE $HF_FLAGS --no-hf-sampling --host 127.0.0.1 --port 0 \
  --log-format console > "$W/engine.log" 2>&1 &
EPID=$!
trap 'kill -TERM $EPID 2>/dev/null; wait $EPID 2>/dev/null' EXIT
for i in $(seq 1 2400); do [ -s "$W/engine.port" ] && break; kill -0 $EPID 2>/dev/null || break; sleep 0.1; done
[ -s "$W/engine.port" ] || { tail -30 "$W/engine.log"; exit 1; }
grep "^# engine ready" "$W/engine.log"
k=0
for S in $STAGGERS; do
  echo "$PHASE_LIMIT $S" > "$W/ctl/inproc_$STREAMS.go.tmp" && mv "$W/ctl/inproc_$STREAMS.go.tmp" "$W/ctl/inproc_$STREAMS.go"
  for i in $(seq 1 $(( (PHASE_LIMIT + 60) * 10 ))); do [ -s "$W/ctl/inproc_$STREAMS.json" ] && break; sleep 0.1; done
  mv "$W/ctl/inproc_$STREAMS.json" "$OUT/inproc_${STREAMS}_$k.json" 2>/dev/null || { echo "no result"; tail -20 "$W/engine.log"; exit 1; }
  echo "stagger $S ms: $(grep "inproc *$STREAMS streams" "$W/engine.log" | tail -1)"
  k=$((k + 1))
done
