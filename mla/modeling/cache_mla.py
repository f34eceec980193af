"""The latent KV cache of MLA models, in full precision or group-quantized with a full-precision window.

Self-contained like modeling_mla.py (copied into every saved checkpoint): imports only torch and
transformers.

Per layer the cache holds exactly two tensors, each with the token axis second to last:
    latent  c_kv    [B, T, n_kv·d_kv]
    k_rope          [B, n_kv, T, 2r]   (RoPE already applied; [B, 1, T, 2m] for the shared RoPE layout)

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
from transformers.cache_utils import Cache, DynamicCache, DynamicLayer

SUPPORTED_BITS = (2, 4, 8)


def cached_widths(latent: int, rope: int) -> dict[str, int]:
    """The two rows one layer caches per token, by the names error messages give them."""
    return {"the latent (n_kv·d_kv)": latent, "the RoPE key (n_kv·2r, or 2m shared)": rope}


def rope_key_channels(config) -> int:
    """Channels of one token's cached RoPE key: every RoPE head's 2r (n_kv heads, or 1 in the shared layout)."""
    heads = 1 if getattr(config, "rope_layout", "per_head") == "shared" else config.num_key_value_heads
    return heads * config.qk_rope_head_dim


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


class MLALatentLayer(DynamicLayer):
    """One layer's latent cache in full precision: `latent` [B, T, n_kv·d_kv] and `k_rope` [B, n_kv, T, 2r].

    They live in DynamicLayer's two slots, whose token axis (second to last) both share, so cropping,
    beam reordering, offloading and batch selection work unchanged; `latent` and `k_rope` name them.
    """

    @property
    def latent(self) -> torch.Tensor | None:
        return self.keys

    @property
    def k_rope(self) -> torch.Tensor | None:
        return self.values

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.keys, self.values) if t is not None)


class MLAQuantizedLayer(MLALatentLayer):
    """The latent cache with tokens older than the newest `residual_length` quantized (module docstring).

    `keys`/`values` hold the full-precision window; `quantized` the older tokens as (latent, k_rope) rows.
    """

    is_croppable = False

    def __init__(self, nbits: int = 4, group_size: int = 64, residual_length: int = 128):
        super().__init__()
        check_quantization(nbits, group_size, {})
        if residual_length < 0:
            raise ValueError(f"residual length must be >= 0, got {residual_length}")
        self.nbits, self.group_size, self.residual_length = nbits, group_size, residual_length
        self.quantized: tuple[QuantizedRows, QuantizedRows] | None = None

    def update(self, latent: torch.Tensor, k_rope: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            check_quantization(self.nbits, self.group_size,
                               cached_widths(latent.shape[-1], k_rope.shape[1] * k_rope.shape[-1]))
        # what the tokens cached before this step read as: quantized ones dequantized, the window as it is
        held = self._dequantize() if self.quantized is not None else None
        super().update(latent, k_rope)
        window_latent, window_rope = self.keys, self.values        # the window and this step's tokens, full precision
        overflow = self.keys.shape[-2] - self.residual_length
        if overflow > 0:                      # the oldest window tokens leave it: quantize them, once, for later steps
            old = self._quantize(self.keys[:, :overflow], self.values[:, :, :overflow])
            self.quantized = old if self.quantized is None else tuple(a.append(b) for a, b in zip(self.quantized, old))
            # copies, so the storage of the quantized tokens is freed rather than kept alive by a view
            self.keys, self.values = self.keys[:, overflow:].clone(), self.values[:, :, overflow:].clone()
        if held is None:
            return window_latent, window_rope
        return torch.cat([held[0], window_latent], dim=-2), torch.cat([held[1], window_rope], dim=-2)

    def _quantize(self, latent: torch.Tensor, k_rope: torch.Tensor) -> tuple[QuantizedRows, QuantizedRows]:
        b, n_kv, t, rope = k_rope.shape
        rope_rows = k_rope.transpose(1, 2).reshape(b, t, n_kv * rope)       # one row of all heads per token
        return (QuantizedRows.quantize(latent, self.nbits, self.group_size),
                QuantizedRows.quantize(rope_rows, self.nbits, self.group_size) if rope else
                QuantizedRows(rope_rows.to(torch.uint8), rope_rows[..., :0], rope_rows[..., :0], self.nbits))

    def _dequantize(self) -> tuple[torch.Tensor, torch.Tensor]:
        q_latent, q_rope = self.quantized
        dtype = self.keys.dtype
        b, n_kv, _, rope = self.values.shape
        rope_rows = q_rope.dequantize(dtype) if rope else torch.empty(b, q_rope.tokens, 0, dtype=dtype,
                                                                       device=self.keys.device)
        return q_latent.dequantize(dtype), rope_rows.reshape(b, q_rope.tokens, n_kv, rope).transpose(1, 2)

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


class MLACache(DynamicCache):
    """The full-precision latent cache: one `MLALatentLayer` per layer. What `generate()` builds by default."""

    def __init__(self, config=None, **_):
        if config is None:   # layers added as the forward pass reaches them
            Cache.__init__(self, layer_class_to_replicate=MLALatentLayer)
        else:
            Cache.__init__(self, layers=[MLALatentLayer() for _ in range(config.num_hidden_layers)])

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
        layers = [MLAQuantizedLayer(nbits, group_size, residual_length) for _ in range(config.num_hidden_layers)]
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


__all__ = ["MLACache", "MLAQuantizedCache", "MLALatentLayer", "MLAQuantizedLayer", "QuantizedRows",
           "cached_widths", "rope_key_channels", "check_quantization", "quantized_bytes_per_token", "SUPPORTED_BITS"]
