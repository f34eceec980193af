"""An exported checkpoint and the model it was converted from, served by vLLM the same way and measured
(`mla serve-bench`, the workflow's serve job with evaluate.serve): decode tokens/s of each at every batch x
context point, the KV cache's bytes per token as vLLM allocated it for each, and the greedy agreement of vLLM on
the export with transformers on the MLA checkpoint it was exported from (bf16 both, the near-tie rule of
mla.evaluation.greedy_agreement). One engine start per model (scripts/vllm_runner.py); the device decides the
engine settings (mla.evaluation.vllm_engine.engine_settings)."""

from __future__ import annotations

from pathlib import Path

from mla.evaluation import greedy_agreement, vllm_engine

PROMPT_TOKENS = 32     # the first tokens of each held-out block: a prompt of real text, short enough for any block
DTYPE = "bfloat16"     # vLLM's CPU MLA backend (AMX) takes bf16; the GPU backends run it too


def heldout_prompts(data: str | Path, count: int, length: int = PROMPT_TOKENS) -> list[list[int]]:
    """The first `length` tokens of `count` held-out blocks spread evenly over the validation split."""
    import numpy as np

    from mla.data.manifest import load_blocks

    blocks = load_blocks(data, "validation")
    rows = np.linspace(0, len(blocks) - 1, num=min(count, len(blocks))).round().astype(int)
    return [[int(t) for t in blocks[i, :length]] for i in dict.fromkeys(rows)]


def heldout_blocks(data: str | Path, count: int) -> list[list[int]]:
    """`count` held-out blocks spread evenly over the validation split (the evaluation's perplexity blocks)."""
    from mla.data.manifest import load_blocks
    from mla.stats import evenly_spaced

    blocks = load_blocks(data, "validation")
    return [[int(t) for t in blocks[i]] for i in evenly_spaced(len(blocks), min(count, len(blocks)))]


def export_backends(export_dir: str | Path) -> list[str]:
    """vLLM's GPU backends that serve the export's shape, as its report (mha2mla_export.json) states them."""
    import json

    report = json.loads((Path(export_dir) / "mha2mla_export.json").read_text())
    return report["engines"]["vllm_gpu"]["backends"]


def engine_summary(run: dict, model: str | Path) -> dict:
    """One engine run as serve.json keeps it."""
    kv = run["kv_cache"]
    return {"checkpoint": str(model), "attention_backend": kv["attention_backend"],
            "engine_start_s": run["engine_start_s"], "kv_bytes_per_token": kv["bytes_per_token"],
            "kv_cache": kv, "decode": run.get("decode", [])}


def reference_greedy(mla_dir: str | Path, prompts: list[list[int]], max_tokens: int, device: str):
    """transformers' greedy tokens and logits of the MLA checkpoint in bf16, on `device`."""
    import torch

    from mla import checkpoint

    model = checkpoint.load_model(mla_dir, dtype=torch.bfloat16).eval()
    model.to("cuda" if device == "gpu" else "cpu")
    return greedy_agreement.greedy_with_logits(model, prompts, max_tokens)


def measure(export_dir: str | Path, original_dir: str | Path, mla_dir: str | Path, prompts: list[list[int]],
            grid: list[tuple[int, int]], steps: int, max_tokens: int, device: str = "cpu", log=print) -> dict:
    """serve.json: both engines' speed and KV bytes, the ratios at each point, and the greedy agreement."""
    python = vllm_engine.engine_python(device)
    log(f"vLLM ({python}) on the export {export_dir}")
    exported = vllm_engine.run_offline(python, export_dir, prompts, max_tokens, bench=grid, steps=steps,
                                       settings=vllm_engine.engine_settings(device, export_backends(export_dir)))
    log(f"vLLM on the original {original_dir}")
    original = vllm_engine.run_offline(python, original_dir, None, bench=grid, steps=steps,
                                       settings=vllm_engine.engine_settings(device))
    log(f"transformers' greedy tokens of {mla_dir}")
    hf_tokens, hf_logits = reference_greedy(mla_dir, prompts, max_tokens, device)
    agreement = greedy_agreement.compare(hf_tokens, hf_logits, exported["tokens"])
    export_summary, original_summary = engine_summary(exported, export_dir), engine_summary(original, original_dir)
    decode = []
    for e, o in zip(export_summary["decode"], original_summary["decode"], strict=True):
        decode.append({"batch": e["batch"], "context": e["context"], "steps": e["steps"],
                       "export_tokens_per_s": e["decode_tokens_per_s"],
                       "original_tokens_per_s": o["decode_tokens_per_s"],
                       "speedup": e["decode_tokens_per_s"] / o["decode_tokens_per_s"]})
    return {
        "engine": "vllm", "vllm_version": exported.get("vllm_version"), "device": device, "dtype": DTYPE,
        "export": export_summary, "original": original_summary, "decode": decode,
        "kv_bytes_ratio": export_summary["kv_bytes_per_token"] / original_summary["kv_bytes_per_token"],
        "greedy_agreement": {"reference": f"transformers {DTYPE} on {mla_dir}", "prompt_tokens": PROMPT_TOKENS,
                             "max_tokens": max_tokens, **agreement},
    }


def summary_line(result: dict) -> str:
    a = result["greedy_agreement"]
    points = "; ".join(f"{d['batch']}x{d['context']}: {d['export_tokens_per_s']:.0f} vs {d['original_tokens_per_s']:.0f}"
                       for d in result["decode"])
    return (f"vLLM {result['vllm_version']} on {result['device']} ({result['export']['attention_backend']} / "
            f"{result['original']['attention_backend']}): decode tokens/s export vs original {points or 'not asked'}; "
            f"KV bytes/token {result['export']['kv_bytes_per_token']:.0f} vs "
            f"{result['original']['kv_bytes_per_token']:.0f}; greedy agreement with transformers "
            f"{a['prompts_agreeing']}/{a['prompts']} prompts, {a['token_agreement']:.0%} of tokens, every difference "
            f"a bf16 near-tie: {a['all_near_ties']}")
