#!/usr/bin/env bash
# The GPU measurement (run on the lent H200 by the device tool; see docs/benchmarks.md):
# engine_svc (hf backend, Llama-3-8B shape, random bf16 weights) driven over gRPC by `tokenrelay
# bench --target engine`, against transformers' continuous batching in-process (raw_cb.py) with the
# same settings, at the same concurrency, in the same run.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
M=/tmp/llama8b; mkdir -p $M
cat > $M/config.json <<'JSON'
{"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336,
 "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256,
 "max_position_embeddings": 8192, "rms_norm_eps": 1e-05, "rope_theta": 500000.0, "bos_token_id": 128000,
 "eos_token_id": 128001, "tie_word_embeddings": false, "torch_dtype": "bfloat16"}
JSON
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee $OUT/gpu.txt
python3 -c "import torch, transformers, grpc; print('torch', torch.__version__, 'transformers', transformers.__version__, 'grpc', grpc.__version__)" | tee -a $OUT/gpu.txt
for N in ${RAW_CONCURRENCY-${CONCURRENCY:-16 64}}; do
  timeout 150 python3 bench/gpu/raw_cb.py --model $M --requests $N 2>$OUT/raw_$N.err | tail -1 | tee $OUT/raw_$N.json
done
rm -f /tmp/engine.port  # a warm machine keeps /tmp between calls
python3 -m engine_svc --backend hf --model $M --hf-random-weights --hf-device cuda --hf-dtype bfloat16 \
  --hf-num-blocks 8192 --hf-max-batch-tokens 8192 --hf-max-batch-size 256 --no-hf-sampling \
  --port 0 --port-file /tmp/engine.port --log-format console > $OUT/engine.log 2>&1 &
EPID=$!
for i in $(seq 1 180); do [ -f /tmp/engine.port ] && break; sleep 0.5; done
ADDR=127.0.0.1:$(cat /tmp/engine.port)
for N in ${CONCURRENCY:-16 64}; do
  timeout 200 python3 -m tokenrelay_tools.bench --target engine --engine-address $ADDR --workload bench/gpu/fixed-512-256.yaml \
    --concurrency $N --requests $N --duration 200 --drain-timeout 150 --vocab-size 128256 --max-context 8192 --no-progress \
    --json $OUT/engine_$N.json > $OUT/engine_$N.txt 2>&1
  tail -25 $OUT/engine_$N.txt
done
kill -TERM $EPID; wait $EPID
tail -5 $OUT/engine.log
