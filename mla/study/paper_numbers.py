"""Published numbers of the MHA2MLA paper (arXiv 2502.14837 v1, Table 1), for side-by-side tables.

Scores are percentages (zero-shot, length-normalised accuracy, lighteval); `avg` is the unweighted
mean of the six columns (ARC is one column: the paper's `arc` task covers Easy and Challenge).
`kv_change` is the KV-cache memory change vs the original model in percent (negative = smaller).
Variants: "original" (the released model), "baseline" (the unconverted model fine-tuned with the same
recipe; the paper writes "GQA/MHA d_kv=128/256 (ft)"), or an int d_kv (S_2-norm, r = d_h/16, SVD_joint).
"""

from __future__ import annotations

TASKS = ("mmlu", "arc", "piqa", "hellaswag", "openbookqa", "winogrande")
TASK_TITLES = {"mmlu": "MMLU", "arc": "ARC", "piqa": "PIQA", "hellaswag": "HS", "openbookqa": "OBQA",
               "winogrande": "WG"}


def _row(kv_change, avg, mmlu, arc, piqa, hs, obqa, wg):
    return {"kv_change": kv_change, "avg": avg, "mmlu": mmlu, "arc": arc, "piqa": piqa,
            "hellaswag": hs, "openbookqa": obqa, "winogrande": wg}


# model -> {"kind", "d_h", "finetune_tokens", "rows": {variant: row}}
TABLE1 = {
    "SmolLM-135M": {
        "kind": "GQA", "d_h": 64, "finetune_tokens": "2.25B (3.8‰)",
        "rows": {
            "original": _row(None, 44.50, 29.80, 42.43, 68.06, 41.09, 33.60, 52.01),
            "baseline": _row(0.0, 44.25, 29.82, 42.05, 68.34, 41.03, 33.20, 51.07),
            32: _row(-68.75, 43.06, 29.50, 40.48, 66.59, 37.99, 33.80, 49.96),
            16: _row(-81.25, 41.84, 28.66, 39.95, 65.02, 36.04, 31.60, 49.80),
            8: _row(-87.50, 40.97, 28.37, 38.04, 64.69, 33.58, 30.80, 50.36),
        },
    },
    "SmolLM-360M": {
        "kind": "GQA", "d_h": 64, "finetune_tokens": "2.25B (3.8‰)",
        "rows": {
            "original": _row(None, 49.60, 33.70, 49.82, 71.87, 51.65, 37.60, 52.96),
            "baseline": _row(0.0, 49.63, 34.01, 50.02, 71.33, 51.43, 38.20, 52.80),
            32: _row(-68.75, 47.91, 32.94, 48.36, 70.73, 48.16, 36.00, 51.30),
            16: _row(-81.25, 46.94, 31.55, 45.73, 70.51, 45.80, 36.60, 51.46),
            8: _row(-87.50, 45.04, 30.54, 43.33, 68.50, 42.83, 35.00, 50.04),
        },
    },
    "SmolLM-1.7B": {
        "kind": "MHA", "d_h": 64, "finetune_tokens": "6B (6.0‰)",
        "rows": {
            "original": _row(None, 55.90, 39.27, 59.87, 75.73, 62.93, 42.80, 54.85),
            "baseline": _row(0.0, 55.93, 39.11, 59.19, 75.95, 62.92, 43.40, 55.09),
            32: _row(-68.75, 54.76, 38.11, 57.13, 76.12, 61.35, 42.00, 53.83),
            16: _row(-81.25, 54.65, 37.87, 56.81, 75.84, 60.41, 42.60, 54.38),
            8: _row(-87.50, 53.61, 37.17, 55.50, 74.86, 58.55, 41.20, 54.38),
        },
    },
    "Llama-2-7B": {
        "kind": "MHA", "d_h": 128, "finetune_tokens": "6B (3.0‰)",
        "rows": {
            "original": _row(None, 59.85, 41.43, 59.24, 78.40, 73.29, 41.80, 64.96),
            "baseline": _row(0.0, 60.22, 41.63, 60.89, 77.80, 71.98, 45.00, 63.38),
            64: _row(-68.75, 59.51, 41.36, 59.51, 77.37, 71.72, 44.20, 62.90),
            32: _row(-81.25, 59.61, 40.86, 59.74, 77.75, 70.75, 45.60, 62.98),
            16: _row(-87.50, 58.96, 40.39, 59.29, 77.75, 69.70, 43.40, 63.22),
        },
    },
}

# The paper's ablations on SmolLM-135M (r = 4 unless named; scores only, the paper gives no KV column):
# Table 5 (App. D, partial RoPE only, no SVD, r = 2 / 4 / 8) and Table 3 (the SVD rows at d_kv = 16; the
# S_2-norm + SVD_joint row is Table 1's d_kv = 16 row). Keys are what a variant's `paper:` names.
ABLATIONS = {
    "SmolLM-135M": {
        "NoPE": _row(None, 38.99, 27.03, 34.23, 62.68, 31.89, 29.40, 48.70),
        "S_high r=2": _row(None, 42.86, 29.58, 40.91, 66.54, 38.48, 32.00, 49.64),
        "S_high": _row(None, 43.40, 29.90, 41.15, 66.92, 39.34, 32.60, 50.51),
        "S_high r=8": _row(None, 43.56, 29.90, 40.89, 67.63, 40.41, 32.20, 50.36),
        "S_low r=2": _row(None, 37.94, 26.95, 33.56, 60.28, 31.51, 27.80, 47.51),
        "S_low": _row(None, 37.76, 27.11, 32.06, 59.79, 30.68, 28.40, 48.54),
        "S_low r=8": _row(None, 42.54, 29.34, 39.58, 67.36, 37.86, 32.00, 49.09),
        "S_uniform r=2": _row(None, 43.16, 29.89, 41.80, 66.27, 38.78, 32.40, 49.80),
        "S_uniform": _row(None, 43.76, 29.87, 41.29, 67.36, 40.22, 32.80, 50.99),
        "S_uniform r=8": _row(None, 43.74, 29.95, 40.81, 67.19, 40.47, 32.60, 51.38),
        "S_2-norm r=2": _row(None, 43.13, 29.75, 40.13, 67.25, 39.03, 32.80, 49.80),
        "S_2-norm": _row(None, 43.77, 30.14, 41.69, 67.57, 39.53, 33.00, 50.67),
        "S_2-norm r=8": _row(None, 43.88, 29.91, 41.35, 67.74, 40.40, 33.40, 50.51),
        "S_high+SVD_joint": _row(-81.25, 41.04, 28.16, 37.55, 64.91, 34.91, 32.00, 48.70),
        "S_uniform+SVD_joint": _row(-81.25, 41.77, 28.58, 38.69, 65.67, 36.17, 32.00, 49.49),
        "S_2-norm+SVD_joint": _row(-81.25, 41.84, 28.66, 39.95, 65.02, 36.04, 31.60, 49.80),
        "S_2-norm+SVD_split": _row(-81.25, 40.92, 28.04, 37.85, 65.56, 34.60, 29.80, 49.65),
    },
}

# names under which a checkpoint of a reported model may appear (case-insensitive)
ALIASES = {
    "smollm-135m": "SmolLM-135M", "huggingfacetb/smollm-135m": "SmolLM-135M", "smollm1-135m": "SmolLM-135M",
    "smollm-360m": "SmolLM-360M", "huggingfacetb/smollm-360m": "SmolLM-360M", "smollm1-360m": "SmolLM-360M",
    "smollm-1.7b": "SmolLM-1.7B", "huggingfacetb/smollm-1.7b": "SmolLM-1.7B", "smollm1-1b7": "SmolLM-1.7B",
    "llama-2-7b": "Llama-2-7B", "meta-llama/llama-2-7b-hf": "Llama-2-7B", "llama2-7b": "Llama-2-7B",
}


def paper_model(name: str | None) -> str | None:
    """The Table 1 model a checkpoint name refers to, or None (e.g. SmolLM2-135M is not in the paper)."""
    if not name:
        return None
    key = name.strip().lower()
    if name in TABLE1:
        return name
    return ALIASES.get(key) or ALIASES.get(key.removesuffix("-hf"))


def paper_row(model: str, variant: str | int) -> dict | None:
    """The paper's row of `model` for a variant: Table 1's "original", "baseline" or an int d_kv, or an
    ablation key of ABLATIONS ("S_high", "S_2-norm+SVD_split", ...); None if the paper has none."""
    entry = TABLE1.get(model)
    if entry is None:
        return None
    return entry["rows"].get(variant) or ABLATIONS.get(model, {}).get(variant)


def known_rows(model: str) -> list:
    """Every variant key `paper_row` answers for `model`."""
    return [*TABLE1.get(model, {}).get("rows", {}), *ABLATIONS.get(model, {})]


def kv_change_percent(d_kv: int, d_h: int, r: int | None = None) -> float:
    """KV memory change (%) of MHA2MLA vs the original: (d_kv + 2r)/(2 d_h) − 1, r = d_h/16 by default."""
    r = d_h // 16 if r is None else r
    return ((d_kv + 2 * r) / (2 * d_h) - 1.0) * 100.0
