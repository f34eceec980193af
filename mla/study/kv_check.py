"""The quantized cache's group size of each model (`evaluate.kv_group_size`) and its parse-time check against
every cached row of every variant: the original's keys, the latent and the RoPE key (arithmetic on the
conversion's layout, torch-free)."""

from __future__ import annotations

from mla import shapes
from mla.conversion.layout import resolve
from mla.kv.accounting import FULL_PRECISION_BITS
from mla.study import experiments
from mla.study.model_configs import model_config


def group_size_for(evaluate: dict, model: str) -> int:
    """`evaluate.kv_group_size` for one model: an integer, or a mapping of model keys (with `default`)."""
    size = evaluate["kv_group_size"]
    return size if isinstance(size, int) else size.get(model, size.get("default", 64))


def kv_group_errors(config: dict, results: str = "results") -> list[tuple[str, str]]:
    """(config key, message) for each variant whose cached rows `evaluate.kv_group_size` does not divide,
    found at parse time rather than in an evaluation job after its training (arithmetic only: the same
    rule as mla/modeling/cache_mla.check_quantization, without importing torch)."""
    e = config["evaluate"]
    bits = [b for b in e["kv_bits"] if b != FULL_PRECISION_BITS]
    if not bits:
        return []
    errors, seen, configs = [], set(), {}
    for v in experiments.all_variants(config):
        if v.model not in configs:
            configs[v.model] = model_config(config, v.model, results)
        cfg = configs[v.model]
        if cfg is None:           # shape unknown before download: the evaluation job checks it
            continue
        s = shapes.shape_of(cfg)
        group = group_size_for(e, v.model)
        key = "evaluate.kv_group_size" + ("" if isinstance(e["kv_group_size"], int) else f".{v.model}")
        if (s.kv_heads * s.head_dim) % group:   # the original's and baseline's cache: quanto's groups of a token
            errors.append((key, f"{group} does not divide the {s.kv_heads * s.head_dim} key channels per token "
                                f"(n_kv·d_h) of {v.model}, which its original and baseline caches quantize"))
        if v.is_baseline:
            continue
        try:
            layout = resolve(cfg, **v.budget())
        except ValueError:        # a budget the model cannot hold: mla.study.layout_check names it
            continue
        if (v.model, layout.kv_lora_rank, layout.rope_dims) in seen:
            continue
        seen.add((v.model, layout.kv_lora_rank, layout.rope_dims))
        for name, channels in (("latent", layout.kv_lora_rank), ("RoPE key", layout.rope_dims)):
            if channels and channels % group:
                errors.append((key, f"{group} does not divide the {channels} channels of the {name} of "
                                    f"{v.experiment}/{v.name} ({v.model})"))
        for b in bits:
            if group % (8 // b):
                errors.append((key, f"{group} is not a multiple of {8 // b}, as {b}-bit packing needs"))
    return list(dict.fromkeys(errors))
