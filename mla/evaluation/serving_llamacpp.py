"""An MLA checkpoint's GGUF export and its original model's GGUF, run by the same llama.cpp build the same way
and measured (`mla serve-bench --engine llama.cpp`, the workflow's serve job with evaluate.serve: llama.cpp).

Per K cache type (f16, q8_0, q4_0, ...), on the narrowest export file laid out for it (its report says which
types it takes): the KV bytes per token as llama.cpp's own log states them, for both models; prompt processing
and decode tokens/s at every batch x context point and their ratios, with llama.cpp's own decode time per call;
held-out perplexity from llama.cpp's logits for both, beside transformers' on the MLA checkpoint (paired, per
block); the greedy agreement of llama.cpp on the export with transformers (fp32) on the MLA checkpoint.

Where the decode time goes: llama.cpp's time per decode call at the grid's contexts, fitted per model as
a + b·context: a is the context-independent part (weights, MLP, projections), b the attention's cost per cached
token, whose ratio between the models is what the smaller cache buys or costs on this machine.
"""

from __future__ import annotations

import math
from pathlib import Path

from mla.evaluation import greedy_agreement, llamacpp_engine

# near-tie tolerances (relative to transformers' top logit) by the export's weight type: a greedy path may part
# only where transformers' own two candidates are this close; f16 weights and llama.cpp's f16 attention
# (flash attention converts to f16) round every activation to 11 bits
TOLERANCES = {"f32": 2.0 ** -10, "bf16": 2.0 ** -5, "f16": 2.0 ** -7, "q8_0": 2.0 ** -5}


def choose_files(exports: list[str | Path], cache_types: list[str]) -> dict[str, tuple[Path, dict]]:
    """For each cache type the smallest-cache export file laid out for it, with its report (refuses a type none
    takes)."""
    from mla.errors import UserError
    from mla.export.llamacpp import read_report

    reports = {Path(p): read_report(p) for p in exports}
    chosen = {}
    for cache_type in cache_types:
        fits = [p for p, r in reports.items() if cache_type in r.get("cache_types", [])]
        if not fits:
            raise UserError(f"--cache-types {cache_type}: none of {', '.join(map(str, reports))} is laid out for it; "
                            f"export one with `mla export --format gguf --cache-type {cache_type}`")
        path = min(fits, key=lambda p: reports[p]["kv_elements_per_token"])
        chosen[cache_type] = path, reports[path]
    return chosen


def reference(mla_dir: str | Path, prompts: list[list[int]], blocks, max_tokens: int) -> dict:
    """transformers (fp32) on the MLA checkpoint: greedy tokens with their logits, and per-block mean losses."""
    import numpy as np
    import torch

    from mla import checkpoint
    from mla.perplexity import per_block_losses

    model = checkpoint.load_model(mla_dir, dtype=torch.float32).eval()
    tokens, logits = greedy_agreement.greedy_with_logits(model, prompts, max_tokens)
    losses, _ = per_block_losses(model, np.asarray(blocks, dtype=np.int64))
    return {"tokens": tokens, "logits": logits, "block_losses": losses}


def perplexity(block_losses: list[float]) -> dict:
    from mla.stats import mean_and_stderr

    mean, se = mean_and_stderr(block_losses)
    return {"blocks": len(block_losses), "mean_loss": mean, "mean_loss_stderr": se,
            "perplexity": math.exp(mean), "perplexity_stderr": None if se is None else math.exp(mean) * se}


def paired(a: list[float], b: list[float]) -> dict:
    """Mean of a − b over the same blocks, with its standard error."""
    from mla.stats import mean_and_stderr

    mean, se = mean_and_stderr([x - y for x, y in zip(a, b, strict=True)])
    return {"mean": mean, "stderr": se}


def decode_model(points: list[dict]) -> dict | None:
    """llama.cpp's ms per decode call against the context, least squares a + b·context (batch 1 points)."""
    xs = [(p["context"], p["llama_decode_ms"] / p["llama_decode_calls"]) for p in points
          if p["batch"] == 1 and p["llama_decode_calls"]]
    if len({x for x, _ in xs}) < 2:
        return None
    n, sx, sy = len(xs), sum(x for x, _ in xs), sum(y for _, y in xs)
    sxx, sxy = sum(x * x for x, _ in xs), sum(x * y for x, y in xs)
    slope = (n * sxy - sx * sy) / (n * sxx - sx * sx)
    return {"ms_per_call_at_0": (sy - slope * sx) / n, "ms_per_1k_context": 1000 * slope,
            "points": [{"context": x, "ms_per_call": y} for x, y in xs]}


def engine_summary(run: dict, path: Path) -> dict:
    blocks = run.get("blocks", [])
    return {"file": str(path), "kv_cache": run["kv_cache"], "kv_bytes_per_token": run["kv_cache"]["bytes_per_token"],
            "flash_attention": run["kv_cache"]["flash_attention"], "load_s": run["load_s"],
            "bench": run.get("bench", []), "decode_model": decode_model(run.get("bench", [])),
            "block_losses": [b["nll"] / b["tokens"] for b in blocks]}


def measure(exports: list[str | Path], original: str | Path, mla_dir: str | Path, prompts: list[list[int]],
            blocks, grid: list[tuple[int, int]], steps: int, max_tokens: int, cache_types: list[str],
            threads: int, flash_attn: str = "auto", log=print) -> dict:
    """serve.json for llama.cpp (module docstring). `flash_attn`: llama.cpp's choice (auto, its default), on or
    off (a quantized cache needs it on)."""
    from mla.export import engines
    from mla.export.llamacpp import read_report

    python = llamacpp_engine.llamacpp_python()
    files = choose_files(exports, cache_types)
    blocks = [[int(t) for t in row] for row in blocks]
    log(f"transformers (fp32) on {mla_dir}: greedy tokens and {len(blocks)} held-out blocks")
    ref = reference(mla_dir, prompts, blocks, max_tokens)
    run = dict(threads=threads, prompts=prompts, max_tokens=max_tokens, blocks=blocks, bench=grid, steps=steps,
               flash_attn=flash_attn)
    original_report = read_report(original)
    result = {"engine": "llama.cpp", "threads": threads, "flash_attn": flash_attn, "mla_checkpoint": str(mla_dir),
              "original": {"file": str(original), "type": original_report["type"]},
              "transformers_mla": perplexity(ref["block_losses"]), "cache_types": []}
    original_f16 = None
    for cache_type, (path, export_report) in files.items():
        log(f"llama.cpp, {cache_type} K cache: {path} and {original}")
        mla_run = llamacpp_engine.run(python, path, cache_type=cache_type, **run)
        original_run = llamacpp_engine.run(python, original, cache_type=cache_type, **dict(run, prompts=None))
        result["llama_cpp_python"] = mla_run["llama_cpp_python"]
        e, o = engine_summary(mla_run, path), engine_summary(original_run, Path(original))
        if cache_type == "f16":
            original_f16 = o["kv_bytes_per_token"]
        tolerance = TOLERANCES.get(export_report["type"], greedy_agreement.BF16_RELATIVE_TOLERANCE)
        if engines.cache_block(cache_type) > 1:
            tolerance = max(tolerance, 2.0 ** -4)   # a block-quantized cache rounds every cached element
        points = [{"batch": pe["batch"], "context": pe["context"],
                   "export_decode_tokens_per_s": pe["decode_tokens_per_s"],
                   "original_decode_tokens_per_s": po["decode_tokens_per_s"],
                   "decode_speedup": pe["decode_tokens_per_s"] / po["decode_tokens_per_s"],
                   "export_prompt_tokens_per_s": pe["prompt_tokens_per_s"],
                   "original_prompt_tokens_per_s": po["prompt_tokens_per_s"],
                   "prompt_speedup": pe["prompt_tokens_per_s"] / po["prompt_tokens_per_s"]}
                  for pe, po in zip(e["bench"], o["bench"], strict=True)]
        result["cache_types"].append({
            "cache_type": cache_type, "export": e, "original": o, "export_type": export_report["type"],
            "kv_bytes_ratio": e["kv_bytes_per_token"] / o["kv_bytes_per_token"],
            "decode": points,
            "perplexity": {"export": perplexity(e["block_losses"]), "original": perplexity(o["block_losses"]),
                           "export_minus_transformers_loss": paired(e["block_losses"], ref["block_losses"])},
            "greedy_agreement": {"reference": f"transformers float32 on {mla_dir}", "max_tokens": max_tokens,
                                 "tolerance": tolerance,
                                 **greedy_agreement.compare(ref["tokens"], ref["logits"], mla_run["tokens"],
                                                            tolerance=tolerance)}})
    for entry in result["cache_types"]:
        if original_f16:
            entry["kv_bytes_ratio_vs_original_f16"] = entry["export"]["kv_bytes_per_token"] / original_f16
    return result


def summary_line(result: dict) -> str:
    parts = []
    for c in result["cache_types"]:
        a, speed = c["greedy_agreement"], "; ".join(
            f"{d['batch']}x{d['context']} {d['decode_speedup']:.2f}x" for d in c["decode"])
        vs_f16 = c.get("kv_bytes_ratio_vs_original_f16")
        parts.append(f"{c['cache_type']}: KV {c['export']['kv_bytes_per_token']:.0f} vs "
                     f"{c['original']['kv_bytes_per_token']:.0f} B/token ({c['kv_bytes_ratio']:.3f}x"
                     + (f", {vs_f16:.3f}x the original's f16" if vs_f16 else "") + f"), decode {speed or 'not asked'}, "
                     f"perplexity {c['perplexity']['export']['perplexity']:.2f} vs transformers "
                     f"{result['transformers_mla']['perplexity']:.2f}, greedy {a['prompts_agreeing']}/{a['prompts']}")
    return f"llama.cpp ({result.get('llama_cpp_python')}, {result['threads']} threads): " + " | ".join(parts)
