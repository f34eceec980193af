"""The latent KV cache of MLA models: growing, preallocated, or group-quantized with a full-precision window.

Self-contained like modeling_mla.py (copied into every saved checkpoint): imports only torch and
transformers.

Per layer the cache holds exactly two tensors in transformers' own MLA layout (DeepSeek-V3's): one head
axis of size 1, the token axis second to last,
    latent  c_kv    [B, 1, T, n_kv·d_kv]
    rope    k_rope  [B, 1, T, n_kv·2r]   (RoPE applied; the n_kv heads' 2r side by side; 2m for the shared layout)
so that every transformers layer that stores 4-D keys and values stores them unchanged: `DynamicLayer`
(growing, offloaded), `StaticLayer` (preallocated, compiled `generate`, CUDA graphs) and the layers here,
which add the names `latent` [B, T, n_kv·d_kv] and `k_rope` [B, heads, T, 2r] (views of the same data).
`check_cache` refuses every other cache type with one line naming it.

`MLAQuantizedLayer` stores every token older than the newest `residual_length` as `nbits` unsigned
integers per channel, asymmetric, one scale and one zero point per group of `group_size` channels of one
token (for k_rope the channels of all heads, n_kv·2r, form the token's row). Tokens are quantized
independently of each other, so a token is quantized once, when it leaves the window, and never again.
Bytes per quantized token and layer: C·nbits/8 packed + 2·(C/group_size) scale/zero elements, for
C = n_kv·d_kv and C = n_kv·2r (see `quantized_bytes_per_token`).

Every attention read goes through `update`, which returns the tokens cached before the step as the cache
holds them (dequantized) followed by the step's own tokens in full precision: a prefill attends to its
prompt unquantized and later steps read it quantized, the procedure of transformers' `QuantizedLayer`
(which quantizes a prompt on the way out of its first `update`), so both caches quantize only what later
steps read. Scales are rounded up when stored, so a group's maximum stays within the integer range, and
dequantization computes in fp32 and rounds once to the cache's dtype: the round trip errs by at most
half a step plus that one rounding (in bf16 a second rounding would add up to half an 8-bit step more).
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, DynamicCache, DynamicLayer, StaticCache, StaticLayer

SUPPORTED_BITS = (2, 4, 8)


def cached_widths(latent: int, rope: int) -> dict[str, int]:
    """The two rows one layer caches per token, by the names error messages give them."""
    return {"the latent (n_kv·d_kv)": latent, "the RoPE key (n_kv·2r, or 2m shared)": rope}


def rope_heads(config) -> int:
    """Heads of the cached RoPE key: 1 (shared layout) or n_kv."""
    return 1 if getattr(config, "rope_layout", "per_head") == "shared" else config.num_key_value_heads


def rope_key_channels(config) -> int:
    """Channels of one token's cached RoPE key: every RoPE head's 2r (n_kv heads, or 1 in the shared layout)."""
    return rope_heads(config) * config.qk_rope_head_dim


def to_cache_rows(c_kv: torch.Tensor, k_rope: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(latent [B, T, C], k_rope [B, heads, T, 2r]) -> the cached layout ([B, 1, T, C], [B, 1, T, heads·2r])."""
    b, heads, t, width = k_rope.shape
    return c_kv.unsqueeze(1), k_rope.transpose(1, 2).reshape(b, 1, t, heads * width)


def from_cache_rows(latent: torch.Tensor, rope: torch.Tensor, heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse of `to_cache_rows`, as views: ([B, T, C], [B, heads, T, 2r])."""
    return latent[:, 0], rope[:, 0].unflatten(-1, (heads, rope.shape[-1] // heads)).transpose(1, 2)


def check_quantization(nbits: int, group_size: int, channels: dict[str, int]) -> None:
    """Raise ValueError naming the cause when `nbits`/`group_size` cannot quantize these channel counts."""
    if nbits not in SUPPORTED_BITS:
        raise ValueError(f"unsupported cache bit width {nbits}: choose 2, 4 or 8 (16 = unquantized)")
    per_byte = 8 // nbits
    if group_size < 1 or group_size % per_byte:
        raise ValueError(f"group size {group_size} must be a positive multiple of {per_byte} for {nbits}-bit packing")
    for name, c in channels.items():
        if c and c % group_size:
            raise ValueError(f"group size {group_size} does not divide the {c} channels of {name}")


def quantized_bytes_per_token(channels: int, nbits: int, group_size: int, scale_bytes: int) -> int:
    """Bytes one token's row of `channels` takes quantized: packed integers plus a scale and a zero per group."""
    return channels * nbits // 8 + 2 * (channels // group_size) * scale_bytes


class QuantizedRows:
    """Rows of channels, quantized per group: packed uint8 [..., T, C·nbits/8], scale and zero [..., T, C/g]."""

    def __init__(self, packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, nbits: int):
        self.packed, self.scale, self.zero, self.nbits = packed, scale, zero, nbits

    @classmethod
    def quantize(cls, x: torch.Tensor, nbits: int, group_size: int) -> "QuantizedRows":
        *lead, channels = x.shape
        groups = x.reshape(*lead, channels // group_size, group_size)
        lo = groups.amin(-1)                                                # exact in x's dtype: one of its values
        exact = (groups.amax(-1).float() - lo.float()) / (2 ** nbits - 1)
        scale = _cast_rounding_up(exact, x.dtype)
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))      # a constant group is exact with q = 0
        # quantize against the stored (cast) scale and zero, so dequantization inverts exactly what was done
        q = ((groups.float() - lo.unsqueeze(-1).float()) / scale.unsqueeze(-1).float()).round_()
        q = q.clamp_(0, 2 ** nbits - 1).to(torch.uint8).reshape(*lead, channels)
        return cls(_pack(q, nbits), scale, lo, nbits)

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        """q·scale + zero computed in fp32 and rounded once to `dtype`."""
        q = _unpack(self.packed, self.nbits)
        *lead, channels = q.shape
        groups = q.reshape(*lead, self.scale.shape[-1], -1).float()
        values = groups * self.scale.unsqueeze(-1).float() + self.zero.unsqueeze(-1).float()
        return values.reshape(*lead, channels).to(dtype)

    @property
    def tokens(self) -> int:
        return self.packed.shape[-2]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.packed, self.scale, self.zero))

    def map(self, fn) -> "QuantizedRows":
        """The same rows with `fn` applied to each stored tensor (batch selection, device moves)."""
        return QuantizedRows(fn(self.packed), fn(self.scale), fn(self.zero), self.nbits)

    def append(self, other: "QuantizedRows") -> "QuantizedRows":
        return QuantizedRows(*(torch.cat([a, b], dim=-2) for a, b in
                               ((self.packed, other.packed), (self.scale, other.scale), (self.zero, other.zero))),
                             self.nbits)


def _cast_rounding_up(exact: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Non-negative fp32 values cast to `dtype`, rounded up instead of to nearest: a scale rounded down
    would map a group's maximum beyond the top integer, where clamping errs by up to a full step."""
    cast = exact.to(dtype)
    if dtype.itemsize >= exact.dtype.itemsize:
        return cast
    bits = {2: torch.int16, 4: torch.int32}[dtype.itemsize]
    next_up = (cast.view(bits) + 1).view(dtype)       # the next representable value above a positive float
    return torch.where(cast.float() < exact, next_up, cast)


def _pack(q: torch.Tensor, nbits: int) -> torch.Tensor:
    per_byte = 8 // nbits
    if per_byte == 1:
        return q
    q = q.reshape(*q.shape[:-1], -1, per_byte)
    shifts = torch.arange(0, 8, nbits, dtype=torch.uint8, device=q.device)
    return (q << shifts).sum(-1, dtype=torch.uint8)


def _unpack(packed: torch.Tensor, nbits: int) -> torch.Tensor:
    per_byte = 8 // nbits
    if per_byte == 1:
        return packed
    shifts = torch.arange(0, 8, nbits, dtype=torch.uint8, device=packed.device)
    return ((packed.unsqueeze(-1) >> shifts) & (2 ** nbits - 1)).reshape(*packed.shape[:-1], -1)


class _LatentNames:
    """`latent` [B, T, n_kv·d_kv] and `k_rope` [B, heads, T, 2r]: views of the layer's two cached tensors."""

    rope_heads: int

    @property
    def latent(self) -> torch.Tensor | None:
        return None if self.keys is None else self.keys[:, 0]

    @property
    def k_rope(self) -> torch.Tensor | None:
        return None if self.values is None else from_cache_rows(self.keys, self.values, self.rope_heads)[1]

    def nbytes(self) -> int:
        """Bytes the layer holds (a preallocated layer: its whole buffer)."""
        return sum(t.numel() * t.element_size() for t in (self.keys, self.values) if t is not None)


class MLALatentLayer(_LatentNames, DynamicLayer):
    """One layer's latent cache in full precision, growing by concatenation (DynamicLayer's two slots hold
    the latent and the RoPE key, so cropping, beam reordering, offloading and batch selection work unchanged).
    `rope_heads`: the RoPE key's heads (n_kv, or 1 for the shared layout), for the `k_rope` view only."""

    def __init__(self, rope_heads: int = 1, **kwargs):
        super().__init__(**kwargs)
        self.rope_heads = rope_heads


class MLAStaticLayer(_LatentNames, StaticLayer):
    """One layer's latent cache preallocated for `max_cache_len` tokens and written in place (StaticLayer:
    fixed addresses, so `torch.compile` and CUDA graphs can capture decode steps)."""

    def __init__(self, max_cache_len: int, rope_heads: int = 1, **kwargs):
        super().__init__(max_cache_len=max_cache_len, **kwargs)
        self.rope_heads = rope_heads


class MLAQuantizedLayer(MLALatentLayer):
    """The latent cache with tokens older than the newest `residual_length` quantized (module docstring).

    `keys`/`values` hold the full-precision window; `quantized` the older tokens as (latent, rope) rows.
    """

    is_croppable = False

    def __init__(self, nbits: int = 4, group_size: int = 64, residual_length: int = 128, rope_heads: int = 1):
        super().__init__(rope_heads=rope_heads)
        check_quantization(nbits, group_size, {})
        if residual_length < 0:
            raise ValueError(f"residual length must be >= 0, got {residual_length}")
        self.nbits, self.group_size, self.residual_length = nbits, group_size, residual_length
        self.quantized: tuple[QuantizedRows, QuantizedRows] | None = None

    def update(self, latent: torch.Tensor, rope: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            check_quantization(self.nbits, self.group_size, cached_widths(latent.shape[-1], rope.shape[-1]))
        # what the tokens cached before this step read as: quantized ones dequantized, the window as it is
        held = self._dequantize() if self.quantized is not None else None
        super().update(latent, rope)
        window_latent, window_rope = self.keys, self.values        # the window and this step's tokens, full precision
        overflow = self.keys.shape[-2] - self.residual_length
        if overflow > 0:                      # the oldest window tokens leave it: quantize them, once, for later steps
            old = self._quantize(self.keys[..., :overflow, :], self.values[..., :overflow, :])
            self.quantized = old if self.quantized is None else tuple(a.append(b) for a, b in zip(self.quantized, old))
            # copies, so the storage of the quantized tokens is freed rather than kept alive by a view
            self.keys, self.values = self.keys[..., overflow:, :].clone(), self.values[..., overflow:, :].clone()
        if held is None:
            return window_latent, window_rope
        return torch.cat([held[0], window_latent], dim=-2), torch.cat([held[1], window_rope], dim=-2)

    def _quantize(self, latent: torch.Tensor, rope: torch.Tensor) -> tuple[QuantizedRows, QuantizedRows]:
        return (QuantizedRows.quantize(latent, self.nbits, self.group_size),
                QuantizedRows.quantize(rope, self.nbits, self.group_size) if rope.shape[-1] else
                QuantizedRows(rope.to(torch.uint8), rope, rope, self.nbits))

    def _dequantize(self) -> tuple[torch.Tensor, torch.Tensor]:
        q_latent, q_rope = self.quantized
        dtype = self.keys.dtype
        rope = q_rope.dequantize(dtype) if self.values.shape[-1] else q_rope.zero.to(dtype)
        return q_latent.dequantize(dtype), rope

    def get_seq_length(self) -> int:
        window = super().get_seq_length()
        return window + (self.quantized[0].tokens if self.quantized is not None else 0)

    def nbytes(self) -> int:
        return super().nbytes() + (sum(q.nbytes for q in self.quantized) if self.quantized is not None else 0)

    def _map_quantized(self, fn) -> None:
        if self.quantized is not None:
            self.quantized = tuple(q.map(fn) for q in self.quantized)

    def reset(self) -> None:
        super().reset()
        self.quantized = None

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("a quantized latent cache cannot be cropped")

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        super().reorder_cache(beam_idx)
        self._map_quantized(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        super().batch_repeat_interleave(repeats)
        self._map_quantized(lambda t: t.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        super().batch_select_indices(indices)
        self._map_quantized(lambda t: t[indices, ...])

    def offload(self):
        super().offload()
        self._map_quantized(lambda t: t.to("cpu", non_blocking=True))

    def prefetch(self):
        super().prefetch()
        self._map_quantized(lambda t: t.to(self.device, non_blocking=True))


def check_offloading(offloading: bool) -> None:
    """transformers' offloading moves layers between a CUDA device and the CPU on CUDA streams."""
    if offloading and not torch.cuda.is_available():
        raise ValueError("an offloaded cache ('offloaded', 'offloaded_static') moves layers between a CUDA device "
                         "and the CPU, and CUDA is not available here: use the default cache or 'static'")


class MLACache(DynamicCache):
    """The full-precision latent cache: one `MLALatentLayer` per layer. What `generate()` builds by default;
    `offloading=True` (cache_implementation="offloaded", CUDA only) keeps the layers not in use on the CPU."""

    def __init__(self, config=None, offloading: bool = False, offload_only_non_sliding: bool = False, **_):
        check_offloading(offloading)
        if config is None:   # layers added as the forward pass reaches them
            Cache.__init__(self, layer_class_to_replicate=MLALatentLayer, offloading=offloading,
                           offload_only_non_sliding=offload_only_non_sliding)
        else:
            layers = [MLALatentLayer(rope_heads(config)) for _ in range(config.num_hidden_layers)]
            Cache.__init__(self, layers=layers, offloading=offloading, offload_only_non_sliding=offload_only_non_sliding)

    def nbytes(self) -> int:
        return sum(layer.nbytes() for layer in self.layers)


class MLAStaticCache(StaticCache):
    """The latent cache preallocated for `max_cache_len` tokens per sequence, one `MLAStaticLayer` per layer:
    what `generate(cache_implementation="static")` builds, and what compiled decode steps need (written in
    place at fixed addresses). Its buffers are allocated by the first forward pass, or by `preallocate`."""

    def __init__(self, config, max_cache_len: int, offloading: bool = False, offload_only_non_sliding: bool = True,
                 **_):
        check_offloading(offloading)
        self.widths = (config.kv_lora_rank, rope_key_channels(config))
        layers = [MLAStaticLayer(max_cache_len, rope_heads(config)) for _ in range(config.num_hidden_layers)]
        Cache.__init__(self, layers=layers, offloading=offloading, offload_only_non_sliding=offload_only_non_sliding)

    def preallocate(self, batch_size: int, dtype: torch.dtype, device) -> "MLAStaticCache":
        """Allocate every layer's buffers now (zeros), e.g. before timing or compiling decode steps."""
        latent, rope = (torch.zeros(batch_size, 1, 0, w, dtype=dtype, device=device) for w in self.widths)
        for layer in self.layers:
            if not layer.is_initialized:
                layer.lazy_initialization(latent, rope)
        return self

    def nbytes(self) -> int:
        return sum(layer.nbytes() for layer in self.layers)


class MLAQuantizedCache(MLACache):
    """The latent cache quantized to `nbits` (2, 4, 8) per group of `group_size` channels, the newest
    `residual_length` tokens kept in full precision. `generate(..., cache_implementation="quantized",
    cache_config={"nbits": 4, "q_group_size": 64, "residual_length": 128})` builds one."""

    def __init__(self, config, nbits: int = 4, group_size: int = 64, residual_length: int = 128):
        if config is not None:   # refuse a group size that does not divide the channels before any forward pass
            check_quantization(nbits, group_size, cached_widths(config.kv_lora_rank, rope_key_channels(config)))
        self.nbits, self.group_size, self.residual_length = nbits, group_size, residual_length
        layers = [MLAQuantizedLayer(nbits, group_size, residual_length, rope_heads(config))
                  for _ in range(config.num_hidden_layers)]
        Cache.__init__(self, layers=layers)

    @classmethod
    def from_cache_config(cls, config, cache_config: dict | None) -> "MLAQuantizedCache":
        """Build from transformers' `cache_config` keys (nbits, q_group_size, residual_length; backend "mla")."""
        options = dict(cache_config or {})
        backend = options.pop("backend", "mla")
        if backend != "mla":
            raise ValueError(f"cache backend {backend!r} quantizes per-head keys and values, which an MLA model "
                             "does not cache; use backend 'mla' (the latent cache's own quantization)")
        unknown = set(options) - {"nbits", "q_group_size", "residual_length"}
        if unknown:
            raise ValueError(f"unknown cache_config keys for the MLA quantized cache: {sorted(unknown)}")
        return cls(config, nbits=options.get("nbits", 4), group_size=options.get("q_group_size", 64),
                   residual_length=options.get("residual_length", 128))


SUPPORTED_CACHES = ("MLACache (generate's 'dynamic' and 'offloaded'), MLAStaticCache ('static', 'offloaded_static'), "
                    "MLAQuantizedCache ('quantized', backend 'mla'), or transformers' DynamicCache / StaticCache")


def check_cache(cache, config) -> None:
    """Raise a ValueError naming the cache type when `cache` cannot hold this model's latent cache: a cache
    that is no `Cache`, whose layers are not plain growing or preallocated ones (sliding windows, per-head
    quantization, linear attention, ...), or whose filled layers hold tensors of other shapes (per-head keys
    and values of an MHA/GQA model)."""
    if cache is None:
        return
    latent, rope = config.kv_lora_rank, rope_key_channels(config)
    expected = f"the latent [B, 1, T, {latent}] and the RoPE key [B, 1, T, {rope}] per layer"
    if not isinstance(cache, Cache):
        raise ValueError(f"cache of type {type(cache).__name__} is not supported by this MLA model, which caches "
                         f"{expected}: use {SUPPORTED_CACHES}")
    kinds = [type(layer) for layer in cache.layers]
    if getattr(cache, "layer_class_to_replicate", None) is not None:
        kinds.append(cache.layer_class_to_replicate)
    for kind in kinds:
        if not (kind in (DynamicLayer, StaticLayer) or issubclass(kind, (MLALatentLayer, MLAStaticLayer))):
            raise ValueError(f"{type(cache).__name__} with {kind.__name__} layers is not supported by this MLA model, "
                             f"which caches {expected}: use {SUPPORTED_CACHES}")
    for i, layer in enumerate(cache.layers):
        keys, values = layer.keys, layer.values
        if keys is None or values is None or (keys.numel() == 0 and keys.dim() == 1):   # not filled yet
            continue
        if keys.dim() != 4 or keys.shape[1] != 1 or keys.shape[-1] != latent or values.shape[-1] != rope:
            raise ValueError(f"layer {i} of the {type(cache).__name__} holds tensors of shapes {tuple(keys.shape)} and "
                             f"{tuple(values.shape)}, not {expected} (a cache filled by another model?)")


__all__ = ["MLACache", "MLAStaticCache", "MLAQuantizedCache", "MLALatentLayer", "MLAStaticLayer", "MLAQuantizedLayer",
           "QuantizedRows", "check_cache", "check_offloading", "to_cache_rows", "from_cache_rows", "rope_heads", "cached_widths",
           "rope_key_channels", "check_quantization", "quantized_bytes_per_token", "SUPPORTED_BITS", "SUPPORTED_CACHES"]
