"""KV-cache accounting: bytes measured from cache objects, elements and bytes predicted from configs.

Full precision: 2·n_kv·d_h elements per token and layer (Llama), n_kv·(d_kv + 2r) (MLA: the latent and
the RoPE'd keys), kv_lora_rank + 2m for the shared RoPE layout (mla/conversion/layout.py). Quantized to b bits with a scale and a zero point per group of g channels of a token
(mla/modeling/cache_mla.py): C·b/8 + 2·(C/g)·s bytes for each cached row of C channels, s the bytes of
a scale; the newest `residual` tokens stay in full precision.
"""

from __future__ import annotations

from mla import shapes

FULL_PRECISION_BITS = 16    # the paper's name for "not quantized" (the cache keeps the model's dtype)


def _tensor_bytes(t) -> int:
    """Bytes of a tensor, including the inner tensors of a tensor subclass (optimum-quanto's packed ones)."""
    flatten = getattr(t, "__tensor_flatten__", None)
    if flatten is not None and type(t).__name__ not in ("Tensor", "Parameter"):
        names, _ = flatten()
        return sum(_tensor_bytes(getattr(t, name)) for name in names)
    return t.numel() * t.element_size()


def cache_nbytes(cache) -> int:
    """Bytes held by a transformers cache: the MLA latent caches (full or quantized), a DynamicCache, or
    transformers' QuantizedCache (its quantized states and its full-precision window)."""
    total = 0
    for layer in cache.layers:
        if hasattr(layer, "nbytes"):              # the MLA layers count their own quantized rows
            total += layer.nbytes()
            continue
        for name in ("keys", "values", "_quantized_keys", "_quantized_values"):
            t = getattr(layer, name, None)
            if t is not None:
                total += sum(_tensor_bytes(x) for x in (t if isinstance(t, tuple) else (t,)) if hasattr(x, "numel"))
    return total


def cached_rows(config) -> list[int]:
    """Channels of each tensor one layer caches per token: [latent, RoPE key] (MLA) or [keys, values]."""
    cfg = config if isinstance(config, dict) else config.to_dict()
    s = shapes.shape_of(cfg)
    if cfg.get("model_type") == "mla_llama":
        rope_heads = 1 if cfg.get("rope_layout", "per_head") == "shared" else s.kv_heads
        return [cfg["kv_lora_rank"], rope_heads * cfg["qk_rope_head_dim"]]
    return [s.kv_heads * s.head_dim] * 2


def kv_elements_per_token(config) -> int:
    """Cached elements per token summed over layers: 2·n_kv·d_h·L (Llama) or n_kv·(d_kv + 2r)·L (MLA)."""
    cfg = config if isinstance(config, dict) else config.to_dict()
    return shapes.shape_of(cfg).layers * sum(cached_rows(cfg))


def quantized_bytes_per_token(config, nbits: int, group_size: int, scale_bytes: int) -> int:
    """Bytes per quantized token summed over layers, scales and zero points included."""
    # lazy: torch; the workflow's parse checks cache widths
    from mla.modeling.cache_mla import quantized_bytes_per_token as row_bytes

    cfg = config if isinstance(config, dict) else config.to_dict()
    rows = [c for c in cached_rows(cfg) if c]
    return shapes.shape_of(cfg).layers * sum(row_bytes(c, nbits, group_size, scale_bytes) for c in rows)


def quantized_cache_bytes(config, *, batch: int, tokens: int, nbits: int, group_size: int, residual: int,
                          element_bytes: int) -> int:
    """Bytes the MLA quantized cache holds after `tokens` tokens: the newest `residual` in full precision
    (`element_bytes` each), the older ones quantized with scales and zeros of `element_bytes` too."""
    window = min(tokens, residual)
    full = kv_elements_per_token(config) * element_bytes
    return batch * (window * full + (tokens - window) * quantized_bytes_per_token(config, nbits, group_size,
                                                                                     element_bytes))
