"""KV-cache accounting: bytes measured from cache objects, elements predicted from configs."""

from __future__ import annotations

from mla import shapes


def cache_nbytes(cache) -> int:
    """Bytes held by a transformers cache (DynamicCache of a Llama, or the MLA latent cache)."""
    total = 0
    for layer in cache.layers:
        for t in (getattr(layer, "keys", None), getattr(layer, "values", None)):
            if t is not None:
                total += t.numel() * t.element_size()
    return total


def kv_elements_per_token(config) -> int:
    """Cached elements per token summed over layers: 2·n_kv·d_h·L (Llama) or n_kv·(d_kv + 2r)·L (MLA)."""
    cfg = config if isinstance(config, dict) else config.to_dict()
    s = shapes.shape_of(cfg)
    if cfg.get("model_type") == "mla_llama":
        return s.layers * (cfg["kv_lora_rank"] + s.kv_heads * cfg["qk_rope_head_dim"])
    return shapes.kv_elements_original(s)
