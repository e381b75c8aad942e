"""Baseline for the GPU run: transformers continuous batching in-process, no gRPC, no tokenrelay.

Same model shape, same dtype, same CB settings as `engine_svc --backend hf`; N requests of
512 random prompt ids and 256 output tokens submitted at once; prints output tokens/s and the
per-request TTFT distribution, as JSON on the last line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--prompt", type=int, default=512)
    p.add_argument("--output", type=int, default=256)
    p.add_argument("--num-blocks", type=int, default=8192)
    p.add_argument("--max-batch-tokens", type=int, default=8192)
    p.add_argument("--max-batch-size", type=int, default=256)
    p.add_argument("--device", default="cuda", help="torch device (cpu for a dry run)")
    p.add_argument("--dtype", default="bfloat16", help="weights' dtype (float32 on a CPU)")
    a = p.parse_args()

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, ContinuousBatchingConfig, GenerationConfig

    torch.manual_seed(0)
    config = AutoConfig.from_pretrained(a.model)
    with torch.device(a.device):  # random init on the GPU: seconds, not minutes on the host CPU
        model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=getattr(torch, a.dtype))
    model = model.eval()
    print("model ready", flush=True, file=__import__("sys").stderr)
    manager = model.init_continuous_batching(
        generation_config=GenerationConfig(do_sample=False, eos_token_id=-1),
        continuous_batching_config=ContinuousBatchingConfig(
            num_blocks=a.num_blocks, max_batch_tokens=a.max_batch_tokens, page_size=32,
            max_requests_per_batch=a.max_batch_size, auto_switch_to_flash=False))
    manager.start()
    gen = torch.Generator().manual_seed(1)
    # warm-up
    manager.add_request(torch.randint(0, config.vocab_size, (a.prompt,), generator=gen).tolist(),
                        request_id="warm", max_new_tokens=8)
    while manager.get_result(request_id="warm", timeout=60) is None:
        pass
    first: dict[str, float] = {}
    done: dict[str, float] = {}
    t0 = time.perf_counter()
    for i in range(a.requests):
        ids = torch.randint(0, config.vocab_size, (a.prompt,), generator=gen).tolist()
        manager.add_request(ids, request_id=f"r{i}", max_new_tokens=a.output, streaming=True)
    tokens = 0
    while len(done) < a.requests:
        out = manager.get_result(timeout=120)
        if out is None:
            break
        now = time.perf_counter()
        first.setdefault(out.request_id, now - t0)
        if out.is_finished():
            done[out.request_id] = now - t0
            tokens += len(out.generated_tokens)
    wall = time.perf_counter() - t0
    manager.stop(block=True)
    ttft = sorted(first.values())
    print(json.dumps({"requests": a.requests, "finished": len(done), "output_tokens": tokens, "wall_s": wall,
                      "output_tok_s": tokens / wall, "ttft_p50_s": statistics.median(ttft),
                      "ttft_p99_s": ttft[int(0.99 * (len(ttft) - 1))]}))


if __name__ == "__main__":
    main()
