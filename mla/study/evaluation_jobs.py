"""What the two evaluation jobs of each checkpoint measure, from a validated workflow config.

*quality* (eval.json, run by `snakemake` / `all`): KV-cache bytes, held-out perplexity, the local
lm-eval task, the paper's tasks, MMLU (cloze) and pass-key retrieval with the full-precision cache
(greedy, and teacher-forced on more prompts).
*inference* (inference.json, `snakemake inference`, and `all` when `evaluate.inference` is true):
decode speed over a grid, the quantized caches' bytes and decoded losses, pass keys with each
quantized cache, LongBench.

`settings(config, model, part)` is both what `mla evaluate --config FILE --part PART` runs (as
`EvalOptions` fields) and what the rules list as `params:`, Snakemake's rerun trigger: a setting
appears only in the part it changes, and only when it changes something (the quantized cache's
group size only with quantized widths), so changing `evaluate.decode_steps` reruns no quality job.
"""

from __future__ import annotations

from mla.evaluation.mmlu import TOTAL_QUESTIONS
from mla.kv.accounting import FULL_PRECISION_BITS
from mla.study.kv_check import group_size_for

QUALITY, INFERENCE = "quality", "inference"
PARTS = (QUALITY, INFERENCE)
# Evaluation data is fetched by a local rule on the submitting host; the jobs run offline and read it.
PREFETCH_MANIFEST = "results/evaluation-data/manifest.json"


def needs_prefetch(config: dict, part: str | None = None) -> bool:
    """Whether a job of `part` (None: any) reads data that the `evaluation_data` rule fetches: the quality job
    MMLU and the paper's tasks, the inference job LongBench."""
    e = config["evaluate"]
    quality = e["mmlu"] != 0 or e["paper_tasks"] == "auto"
    inference = e["longbench"] == "auto"
    return {QUALITY: quality, INFERENCE: inference, None: quality or inference}[part]


def settings(config: dict, model: str, part: str) -> dict:
    """The `EvalOptions` fields of `part` for a checkpoint of `model` (a key of config.models)."""
    e = config["evaluate"]
    if part == QUALITY:
        out = {"part": QUALITY, "max_blocks": e["perplexity_blocks"], "kv_new_tokens": e["kv_new_tokens"],
               "local_task": e["local_task"], "paper_tasks": e["paper_tasks"], "mmlu": e["mmlu"]}
        if e["local_task"]:
            out.update(local_docs=e["local_docs"], validation_fraction=config["data"]["validation_fraction"])
        if e["paper_tasks"] != "off":
            out["paper_limit"] = e["paper_limit"]
        if e["mmlu"] is None:   # null: all of MMLU's test split

            out["mmlu"] = TOTAL_QUESTIONS
        if out["mmlu"]:
            out["mmlu_seed"] = e["mmlu_seed"]
        if e["needle_lengths"]:
            out.update(needle_lengths=list(e["needle_lengths"]), needle_samples=e["needle_samples"],
                       passkey_scored=e["passkey_scored"])
        out["prefetched"] = PREFETCH_MANIFEST if needs_prefetch(config, QUALITY) else None
        return out
    if part == INFERENCE:
        quantized = [b for b in e["kv_bits"] if b != FULL_PRECISION_BITS]
        out = {"part": INFERENCE, "kv_bits": list(e["kv_bits"]), "longbench": e["longbench"],
               "decode_grid": [[int(x) for x in point.split("x")] for point in e["decode_grid"]]}
        if e["kv_bits"]:
            out.update(kv_new_tokens=e["kv_new_tokens"], kv_scored=e["kv_scored"], kv_blocks=e["kv_blocks"])
        if quantized:
            out.update(kv_group_size=group_size_for(e, model), kv_residual=e["kv_residual"])
            if e["needle_lengths"]:
                out.update(needle_lengths=list(e["needle_lengths"]), needle_samples=e["needle_samples"])
        if e["longbench"] != "off":
            out["longbench_limit"] = e["longbench_limit"]
            out["prefetched"] = PREFETCH_MANIFEST if needs_prefetch(config, INFERENCE) else None
        if e["decode_grid"]:
            out["decode_steps"] = e["decode_steps"]
        return out
    raise ValueError(f"unknown evaluation part {part!r} (one of {', '.join(PARTS)})")


def serve_settings(config: dict) -> dict:
    """What a serve job (evaluate.serve) measures, as `mla serve-bench` options: the serve rule's params (its
    rerun trigger). The device is a machine choice, as for the evaluation jobs: the JSON records it. llama.cpp
    also measures each K cache type and the perplexity on the evaluation's held-out blocks."""
    e = config["evaluate"]
    out = {"engine": e["serve"], "decode_grid": list(e["decode_grid"]), "decode_steps": e["decode_steps"],
           "prompts": e["serve_prompts"], "max_tokens": e["serve_tokens"]}
    if e["serve"] == "llama.cpp":
        out.update(cache_types=list(e["serve_cache_types"]), blocks=e["perplexity_blocks"])
    return out
