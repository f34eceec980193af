"""The workflow config of the evaluate.serve tests: the smoke settings on one tiny GQA Llama with d_h 64 (vLLM's
CPU attention takes no smaller head, llama.cpp's quantized caches none below 32) and a ladder variant, the only
conversion DeepSeek's attention expresses."""

from __future__ import annotations

import copy

from workflow_helpers import smoke_config

LADDER = {"d_kv": 8, "r": 4, "rope_strategy": "ladder"}     # 2 KV heads: 8 RoPE components, latent 16


def serve_config(serve: str | bool = "vllm", variants: dict | None = None) -> dict:
    cfg = copy.deepcopy(smoke_config())
    cfg["models"] = {"tiny-d64": {"source": "tiny-random", "num_kv_heads": 2, "head_dim": 64,
                                  "label": "tiny GQA Llama, d_h 64"}}
    cfg["experiments"] = {"served": {"kind": "GQA", "model": "tiny-d64", "svd": "joint", "baseline": False,
                                     "variants": variants or {"ladder": dict(LADDER)}}}
    cfg["evaluate"].update(serve=serve, inference=False, serve_prompts=4, serve_tokens=8, kv_bits=[], needle_lengths=[], mmlu=0,
                           decode_grid=["1x16", "2x16"], decode_steps=4)
    return cfg
